"""A tiny random-init Qwen3 target on disk (with the real Qwen3 tokenizer) and a synthetic
row source whose next tokens are learnable, for online-training tests."""

from __future__ import annotations

import gzip
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from dflash_core import Stage, StageContext, hookimpl

TOKENIZER_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "assets" / "qwen3-tokenizer"


def make_tiny_target(path: Path, layers: int = 4, hidden: int = 32, seed: int = 0,
                     vocab: int = 151936) -> Path:
    """Save a random Qwen3 (real vocab size, tiny width) plus the Qwen3 tokenizer to ``path``."""
    import torch
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=hidden // 4, max_position_embeddings=4096, tie_word_embeddings=True,
        initializer_range=0.5)  # large embeddings: a frozen random LM head with usable logits
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TOKENIZER_DIR / name, path / name)
    with gzip.open(TOKENIZER_DIR / "tokenizer.json.gz", "rb") as f:
        (path / "tokenizer.json").write_bytes(f.read())
    return path


@dataclass
class SyntheticRowsConfig:
    rows: int = 8
    tokens_per_row: int = 96
    docs_per_row: int = 3
    period: int = 7
    seed: int = 0
    epochs: int = 1


class SyntheticRows(Stage):
    """Packed rows of arithmetic sequences (token = base + (i mod period)), in pack's row
    format, with a resumable cursor. The next token is a function of the current one, so a
    drafter can learn it."""

    kind = "pack"
    name = "synthetic"
    Config = SyntheticRowsConfig
    inputs = ()

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        cfg = self.config
        start = (ctx.resume_state or {}).get("position", 0)
        total = cfg.rows * cfg.epochs
        per_rank = total // ctx.world_size
        for i in range(start, per_rank):
            global_i = i * ctx.world_size + ctx.rank
            rng = np.random.default_rng([cfg.seed, global_i])
            lengths = _split(cfg.tokens_per_row, cfg.docs_per_row, rng)
            ids, mask, pos = [], [], []
            for n in lengths:
                base = 1000 + 10 * int(rng.integers(0, 8))
                ids += [base + (j % cfg.period) for j in range(n)]
                mask += [0] * 4 + [1] * (n - 4)
                pos += list(range(n))
            yield {"input_ids": np.array(ids, dtype=np.int64), "loss_mask": np.array(mask, dtype=np.uint8),
                   "position_ids": np.array(pos, dtype=np.int64), "doc_lengths": lengths,
                   "state": {"position": i + 1}, "state_stage": ctx.stage,
                   "rows_per_epoch": per_rank // cfg.epochs, "epochs": cfg.epochs}


def _split(total: int, parts: int, rng: np.random.Generator) -> list[int]:
    cuts = sorted(rng.choice(np.arange(12, total - 12), size=parts - 1, replace=False).tolist())
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


@hookimpl
def dflash_pipe_register_stages(registry: Any) -> None:
    registry.add(SyntheticRows)
