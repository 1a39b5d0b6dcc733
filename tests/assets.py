"""The test assets, kept in ``tests/assets/`` (each folder's README says where it comes from and its
license): the Qwen3 tokenizer, and the Qwen3.6 tokenizer built by ``scripts/build_qwen3_6_tokenizer.py``.
z-lab's reference loader (``tests/assets/zlab-dflash``) is read by ``tests/drafter/served_loaders.py``."""

from __future__ import annotations

import gzip
import lzma
import shutil
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
QWEN3_TOKENIZER = ASSETS / "qwen3-tokenizer"
QWEN3_6_TOKENIZER = ASSETS / "qwen3_6-tokenizer"


def unpack_tokenizer(src: Path, dest: Path) -> Path:
    """Copy a tokenizer asset into ``dest`` with tokenizer.json decompressed (loadable offline)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, dest / name)
    packed = src / "tokenizer.json.gz"
    opener = gzip.open if packed.exists() else lzma.open
    with opener(packed if packed.exists() else src / "tokenizer.json.xz", "rb") as f, \
            open(dest / "tokenizer.json", "wb") as dst:
        shutil.copyfileobj(f, dst)
    return dest


def unpack_qwen3_tokenizer(dest: Path) -> Path:
    """The Qwen3 tokenizer, unpacked into ``dest``."""
    return unpack_tokenizer(QWEN3_TOKENIZER, dest)
