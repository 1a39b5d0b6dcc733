"""The fast encoder of tokenize:chat_template gives the Rust tokenizer's ids exactly (fuzzed)."""

from __future__ import annotations

import random

import pytest

from dflash_stages.tokenize.fast import fast_encoder_for

ASCII = list("aAbZz09 \t\n\r\x0b\x0c\x1c\x1f\x00\x7f'sStTmMdDlLrReEvV.,;:!?-_()[]{}<>/\\\"`~@#$%^&*+=|")
ASCII += ["<|im_end|>", "<think>", "</think>", "<|im_start|>", "<tool_call>", "'ll", "'RE", "\r\n",
          "   ", "\n\n", "123456", "x_1", "don't", "HELLO", " world"]
UNICODE = list("éèñüßſ’“”—–…•→≤≥×÷πΩ中文日本語한국어½²Ⅻ٣🙂👍🏽")
UNICODE += list("\u00a0\u2003\u3000\u0301\u0085\u200b\u2028\ufeff")
UNICODE += ["e\u0301", "A\u030a", "\u1100\u1161", "ǅ", "ʼs"]
# combining marks (\p{M}): Qwen3.5/3.6's regex keeps them in letter runs, Qwen3's splits them off
UNICODE += list("\u093f\u0947\u094d\u0e31\u0e48\u064e\u05b7\u20dd\u20e3\ufe0f\u200d")
UNICODE += ["हिन्दी", "ภาษาไทย", "مَرْحَبًا", "1\u20e3", "'\u0301s"]


@pytest.mark.parametrize("name", ["qwen3", "qwen3_6"])
def test_fast_encoder_matches_tokenizer(name: str, request: pytest.FixtureRequest) -> None:
    tok = request.getfixturevalue(name)
    fast = fast_encoder_for(tok)
    assert fast is not None, f"the {name} tokenizer should get the fast path"
    rust = tok.backend_tokenizer
    rng = random.Random(1234)
    texts = []
    for i in range(3000):
        pool = ASCII + (UNICODE if i % 2 else [])
        texts.append("".join(rng.choice(pool) for _ in range(rng.randint(0, 80))))
    texts.append("\ud800 lone surrogate")   # not encodable: left to the tokenizer (None)
    checked = 0
    for text in texts:
        ids = fast.encode(text)
        if ids is None:
            continue
        assert ids == rust.encode(text, add_special_tokens=False).ids, repr(text)
        checked += 1
    assert checked == len(texts) - 1
    assert fast.encode(texts[-1]) is None


def test_other_tokenizers_are_not_taken() -> None:
    class NoBackend:
        pass

    assert fast_encoder_for(NoBackend()) is None
