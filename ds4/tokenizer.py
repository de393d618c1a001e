"""DeepSeek V4 tokenizer: byte-level BPE built from GGUF metadata (the chat format is in ds4/chat.py)."""
from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Iterator

from tokenizers import AddedToken, models
from tokenizers import Tokenizer as HFTokenizer

from ds4.errors import ModelFileError, UsageError
from ds4.formats.vocab import ADDED_TYPES, BOS, CHAT_TOKENS, DSML, EOS, PAD, PRE_TOKENIZER_NAMES, v4_pre_tokenizer


def _byte_to_char() -> dict[int, str]:
    """The GPT-2 table that maps each byte to a printable code point."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


CHAR_TO_BYTE = {c: b for b, c in _byte_to_char().items()}


def _token_bytes(token: str, added: bool) -> bytes:
    """The bytes a token stands for; added tokens and non byte-level strings are their UTF-8."""
    if not added and all(c in CHAR_TO_BYTE for c in token):
        return bytes(CHAR_TO_BYTE[c] for c in token)
    return token.encode("utf-8")


def _get(md: dict, key: str, kind: type, default=None):
    """md[key] checked against kind; missing (with no default) or mistyped raises ModelFileError."""
    if key not in md:
        if default is not None:
            return default
        raise ModelFileError(f"tokenizer metadata: missing key {key!r}")
    value = md[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ModelFileError(f"tokenizer metadata: key {key!r} is {type(value).__name__}, "
                             f"expected {kind.__name__}")
    return value


class Tokenizer:
    """Byte-level BPE with the V4 pre-tokenizer; control/user-defined tokens match as whole strings."""

    def __init__(self, tokens: list[str], merges: list[tuple[str, str]], added: set[int],
                 bos_id: int, eos_id: int):
        self.tokens = tokens
        self.bos_id, self.eos_id = bos_id, eos_id
        self.control_ids = sorted(added)  # control/user-defined tokens: never produced from plain text
        self._ids = {t: i for i, t in enumerate(tokens)}
        model = models.BPE(vocab=self._ids, merges=merges, fuse_unk=False, byte_fallback=False)
        self._hf = HFTokenizer(model)
        self._hf.pre_tokenizer = v4_pre_tokenizer()
        self._hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                     for i in sorted(added)])
        self._bytes = [_token_bytes(t, i in added) for i, t in enumerate(tokens)]
        controls = sorted((tokens[i] for i in added), key=len, reverse=True)
        self._control_re = re.compile("(" + "|".join(map(re.escape, controls)) + ")" if controls else "(?!)")

    @classmethod
    def from_metadata(cls, md: dict) -> Tokenizer:
        """Build from GGUF metadata: tokenizer.ggml.{model,pre,tokens,merges,token_type,bos/eos_token_id}."""
        model = _get(md, "tokenizer.ggml.model", str, "gpt2")
        if model != "gpt2":
            raise ModelFileError(f"tokenizer metadata: key 'tokenizer.ggml.model' is {model!r}, "
                                 "expected 'gpt2'")
        pre = _get(md, "tokenizer.ggml.pre", str, PRE_TOKENIZER_NAMES[0])
        if pre not in PRE_TOKENIZER_NAMES:
            raise ModelFileError(f"tokenizer metadata: key 'tokenizer.ggml.pre' is {pre!r}, "
                                 f"expected one of {PRE_TOKENIZER_NAMES}")
        tokens = _get(md, "tokenizer.ggml.tokens", list)
        if not tokens or not all(isinstance(t, str) for t in tokens):
            raise ModelFileError("tokenizer metadata: key 'tokenizer.ggml.tokens' must be a non-empty "
                                 "list of str")
        merges = []
        for rank, merge in enumerate(_get(md, "tokenizer.ggml.merges", list)):
            pair = merge.split(" ") if isinstance(merge, str) else []
            if len(pair) != 2:
                raise ModelFileError(f"tokenizer metadata: key 'tokenizer.ggml.merges'[{rank}] = {merge!r} "
                                     "is not of the form 'a b'")
            merges.append((pair[0], pair[1]))
        if "tokenizer.ggml.token_type" in md:
            types = _get(md, "tokenizer.ggml.token_type", list)
            if len(types) != len(tokens):
                raise ModelFileError(f"tokenizer metadata: key 'tokenizer.ggml.token_type' has {len(types)} "
                                     f"entries for {len(tokens)} tokens")
            added = {i for i, t in enumerate(types) if t in ADDED_TYPES}
        else:
            added = {i for i, t in enumerate(tokens) if t in (*CHAT_TOKENS, PAD, DSML)}
        added_strings = {tokens[i] for i in added}
        for name in CHAT_TOKENS:
            if name not in added_strings:
                raise ModelFileError(f"tokenizer metadata: key 'tokenizer.ggml.tokens' lacks the control "
                                     f"token {name}")
        ids = {t: i for i, t in enumerate(tokens)}
        bos_id = _get(md, "tokenizer.ggml.bos_token_id", int, ids[BOS])
        eos_id = _get(md, "tokenizer.ggml.eos_token_id", int, ids[EOS])
        for key, value in (("tokenizer.ggml.bos_token_id", bos_id), ("tokenizer.ggml.eos_token_id", eos_id)):
            if not 0 <= value < len(tokens):
                raise ModelFileError(f"tokenizer metadata: key {key!r} = {value} is outside the vocab")
        return cls(tokens, merges, added, bos_id, eos_id)

    @property
    def vocab_size(self) -> int:
        """Number of token ids (the model's embedding rows)."""
        return len(self.tokens)

    def token_id(self, token: str) -> int:
        """Id of a token given by its exact vocab string (e.g. '<｜User｜>')."""
        if token not in self._ids:
            raise UsageError(f"token {token!r} is not in the vocab")
        return self._ids[token]

    def encode(self, text: str, *, specials: bool = False) -> list[int]:
        """Token ids of text as plain text; `specials=True` opts in to control-token strings becoming controls."""
        self._hf.encode_special_tokens = not specials
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_parts(self, parts: Iterable[tuple[str, bool]]) -> list[int]:
        """Token ids of (text, is_template) pieces: control strings become controls only in template pieces.

        Plain text between two controls is tokenized as one run, so the ids equal `encode(joined, specials=True)`
        whenever the caller pieces hold no control string.
        """
        ids: list[int] = []
        run: list[str] = []
        for text, is_template in parts:
            pieces = self._control_re.split(text) if is_template else [text]
            for k, piece in enumerate(pieces):
                if k % 2 == 0:
                    run.append(piece)
                else:
                    ids += self.encode("".join(run)) + [self._ids[piece]]
                    run = []
        return ids + self.encode("".join(run))

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token id stands for."""
        if not 0 <= token_id < len(self._bytes):
            raise UsageError(f"token id {token_id} is outside the vocab (size {len(self._bytes)})")
        return self._bytes[token_id]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ids; invalid UTF-8 becomes U+FFFD."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def decode_stream(self, ids: Iterable[int]) -> Iterator[str]:
        """Yield text as ids arrive, holding back incomplete UTF-8; the pieces join to decode(ids)."""
        stream = StreamDecoder(self)
        for i in ids:
            piece = stream.push(i)
            if piece:
                yield piece
        tail = stream.flush()
        if tail:
            yield tail


class StreamDecoder:
    """Incremental decoder: push ids one by one, get the text that is complete so far."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token (may be empty while a multi-byte character is split)."""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is held back at the end of the stream (U+FFFD for a truncated character)."""
        return self._utf8.decode(b"", final=True)
