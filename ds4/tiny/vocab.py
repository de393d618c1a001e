"""The tiny models' vocabulary: a small deterministic byte-level BPE trained on a fixed text."""
from __future__ import annotations

import json

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from ds4.errors import UsageError
from ds4.formats.vocab import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    PAD,
    THINK_END,
    THINK_START,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_USER_DEFINED,
    USER,
    bpe_metadata,
    v4_pre_tokenizer,
)

TINY_ADDED = ((BOS, TOKEN_CONTROL), (EOS, TOKEN_CONTROL), (PAD, TOKEN_CONTROL), (USER, TOKEN_USER_DEFINED),
              (ASSISTANT, TOKEN_USER_DEFINED), (THINK_START, TOKEN_USER_DEFINED),
              (THINK_END, TOKEN_USER_DEFINED), (DSML, TOKEN_USER_DEFINED))

TINY_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. Hello, world! How are you today? I am fine, thank you.
Once upon a time there was a little model that wanted to think before it answered every question.
User: What is 12 + 30? Assistant: The answer is 42. In 2024 there were 366 days; 1,234,567.89 is a number.
Il gatto è sulla sedia. Perché la città è così bella? Però il caffè è già pronto, e la pizza anche.
Der Bär läuft über die Straße. Ça va très bien, merci. ¿Dónde está la estación? Ελληνικά. Русский язык.
我们今天学习中文。这是一个简单的句子。深度求索的模型会思考。你好，世界！
日本語のテキストです。ひらがなとカタカナ、そして漢字。こんにちは、元気ですか？
한국어 문장입니다. 안녕하세요! 😀 👍 🎉
def add(a, b):
    return a + b

for i in range(10):
    print(f"{i}: {add(i, i)}")
if (x > 0 && y < 0) { return {"key": [1, 2, 3]}; }
<tool_result>{"files": ["README.md", "setup.cfg"]}</tool_result>
"""


def tiny_vocab_metadata(vocab_size: int = 512) -> dict:
    """A small deterministic byte-level BPE vocab (all 256 bytes, the V4 control tokens, trained merges)."""
    if vocab_size < 256 + len(TINY_ADDED):
        raise UsageError(f"tiny vocab_size must be at least {256 + len(TINY_ADDED)}, got {vocab_size}")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = v4_pre_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  special_tokens=[t for t, _ in TINY_ADDED],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(TINY_TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    model = json.loads(hf.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    added_types = dict(TINY_ADDED)
    return bpe_metadata(tokens, model["merges"], [added_types.get(t, TOKEN_NORMAL) for t in tokens])
