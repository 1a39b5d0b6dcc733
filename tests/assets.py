"""The shared test assets (``../shared/assets`` beside the repository)."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

QWEN3_TOKENIZER = Path(__file__).resolve().parents[1] / ".." / "shared" / "assets" / "qwen3-tokenizer"


def unpack_qwen3_tokenizer(dest: Path) -> Path:
    """Copy the Qwen3 tokenizer into ``dest`` with tokenizer.json un-gzipped (loadable offline)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(QWEN3_TOKENIZER / name, dest / name)
    with gzip.open(QWEN3_TOKENIZER / "tokenizer.json.gz", "rb") as src, \
            open(dest / "tokenizer.json", "wb") as dst:
        shutil.copyfileobj(src, dst)
    return dest
