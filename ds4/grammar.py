"""Constrained decoding: a grammar masks the logits before every choice, so the output always parses.

The grammar engine is llguidance (chosen over outlines-core by the per-token cost on the 129,280-token V4
vocabulary, `python scripts/bench.py grammar`, BENCHMARKS.md): it computes each token's mask from the parser
state on the fly, with no per-schema index to build. Grammars: any JSON object (`response_format` json_object),
a JSON schema (json_schema), and DSML tool-call blocks for a set of tools (`tool_choice` required or a named
function; docs/server.md).
"""
from __future__ import annotations

import json

import llguidance
import torch

from ds4.chat import DSML, INVOKE_END, TOOL_CALLS_END, TOOL_CALLS_START
from ds4.errors import UsageError
from ds4.tokenizer import Tokenizer

JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: ", " and ": " only, no runs of whitespace


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads from a tokenizer: each token's bytes, EOS, an encoder."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.eos_token_id, self.bos_token_id = tokenizer.eos_id, tokenizer.bos_id
        n = len(tokenizer.tokens)
        self.tokens = [tokenizer.token_bytes(i) if i < n else b"" for i in range(vocab_size)]
        self.special_token_ids = tokenizer.control_ids
        self.encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return self.encode(text)


_ll_tokenizers: dict[int, llguidance.LLTokenizer] = {}


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer` with `vocab_size` rows of logits (built once per tokenizer)."""
    key = id(tokenizer)
    if key not in _ll_tokenizers:
        wrapper = llguidance.TokenizerWrapper(_Vocabulary(tokenizer, vocab_size))
        _ll_tokenizers[key] = llguidance.LLTokenizer(wrapper, n_vocab=vocab_size)
    return _ll_tokenizers[key]


def json_grammar(schema: dict | None = None) -> str:
    """The grammar of JSON matching `schema` (None: any JSON object)."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"},
                                                             defaults=JSON_OPTIONS)
    except (ValueError, TypeError, RuntimeError) as e:
        raise UsageError(f"the JSON schema cannot be enforced: {e}") from None


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def tool_call_grammar(tools: list[dict]) -> str:
    """Lark grammar of a DSML tool-call block calling only `tools` (OpenAI function definitions): string
    parameters as text, the others as JSON of their schema, required ones always, in schema order."""
    rules, invokes = [], []
    for t, fn in enumerate(tools):
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise UsageError(f"tool {t} has no function name")
        schema = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = set(schema.get("required")) if isinstance(schema.get("required"), list) else set()
        params = []
        for p, (name, prop) in enumerate(props.items()):
            prop = prop if isinstance(prop, dict) else {}
            text = prop.get("type") == "string"
            head = f'<{DSML}parameter name="{name}" string="{"true" if text else "false"}">'
            limit = prop.get("maxLength") if text and isinstance(prop.get("maxLength"), int) else None
            value = (f"/[^<]{{0,{limit}}}/" if limit is not None else "/[^<]*/") if text else \
                f"%json {json.dumps(prop)}"
            rules.append(f"p{t}_{p}: {_lark_string(head)} {value} {_lark_string(f'</{DSML}parameter>')} \"\\n\"")
            params.append(f"p{t}_{p}" + ("" if name in required else "?"))
        head = f'<{DSML}invoke name="{fn["name"]}">\n'
        rules.append(f"i{t}: {_lark_string(head)} {' '.join(params)} {_lark_string(INVOKE_END)}")
        invokes.append(f"i{t}")
    calls = " | ".join(invokes)
    return "\n".join([f"start: {_lark_string(TOOL_CALLS_START + chr(10))} ({calls}) (\"\\n\" ({calls}))* "
                      f"{_lark_string(chr(10) + TOOL_CALLS_END)}", *rules])


def unpack(bitmask: bytes, vocab_size: int) -> torch.Tensor:
    """llguidance's bitmask (bit i of byte i // 8 for token i) as [vocab_size] bool."""
    bits = torch.frombuffer(bytearray(bitmask), dtype=torch.uint8)
    return ((bits[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(-1)[:vocab_size].bool()


def masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """`logits` [V] as float32 on the host, -inf where not `allowed`."""
    logits = logits.to("cpu", torch.float32).reshape(-1)
    return torch.where(allowed, logits, torch.full_like(logits, float("-inf")))


class Constraint:
    """One generation's grammar state: `mask` the logits, then `advance` with the token chosen, or `follow`
    an output that may also lose tokens (speculative drafts rejected: the parser rolls back)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, grammar: str):
        self.matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer, vocab_size), grammar)
        if self.matcher.is_error():
            raise UsageError(f"the grammar cannot be enforced: {self.matcher.get_error()}")
        self.vocab_size, self.grammar = vocab_size, grammar   # the text: a rank repeating the job builds its own
        self.consumed: list[int] = []   # the tokens the parser has taken, in order

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next (EOS once the output is complete)."""
        return unpack(self.matcher.compute_bitmask(), self.vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V] (float32, host) with the tokens the grammar forbids at -inf."""
        return masked(logits, self.allowed())

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (the one tokenization of the only text it allows), not consumed."""
        return [] if self.complete else self.matcher.compute_ff_tokens()

    def mask_forced(self, logits: torch.Tensor) -> torch.Tensor:
        """`mask`, narrowed to the first of the tokens the grammar forces next when it forces text (their one
        tokenization: the masked drafter proposes them and the verify accepts them, many per target pass)."""
        forced = self.forced()
        if not forced:
            return self.mask(logits)
        return masked(logits, torch.arange(self.vocab_size) == forced[0])

    def advance(self, token: int) -> None:
        """Move the parser past `token` (one the mask allowed)."""
        if not self.matcher.consume_token(token):
            raise UsageError(f"token {token} breaks the grammar: {self.matcher.get_error()}")
        self.consumed.append(token)

    def follow(self, output: list[int]) -> None:
        """Put the parser just after `output`: roll back the consumed tokens it does not share, consume the rest."""
        common = 0
        while common < min(len(output), len(self.consumed)) and output[common] == self.consumed[common]:
            common += 1
        if common < len(self.consumed):
            if not self.matcher.rollback(len(self.consumed) - common):
                raise UsageError(f"the grammar cannot roll back: {self.matcher.get_error()}")
            del self.consumed[common:]
        for token in output[common:]:
            self.advance(token)

    @property
    def complete(self) -> bool:
        """Whether the output is complete and nothing but EOS may follow."""
        return self.matcher.is_stopped()
