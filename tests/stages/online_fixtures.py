"""A tiny random-init Qwen3 target on disk (with the real Qwen3 tokenizer) and a synthetic
row source whose next tokens are learnable, for online-training tests."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from dflash_core import Stage, StageContext, hookimpl
from tests.assets import unpack_qwen3_tokenizer



CKPT_FILES = ("export/config.json", "export/model.safetensors", "export/modeling_dflash.py", "train_state.pt",
              "pipeline_state.json")
"""What a complete checkpoint directory holds."""
TINY_TRAIN = dict(num_layers=1, block_size=4, num_anchors=16, lr=1e-2, mask_token_id=5999)
"""Train params that learn the synthetic rows quickly on the tiny target."""


def make_tiny_target(path: Path, layers: int = 4, hidden: int = 32, seed: int = 0,
                     vocab: int = 151936, initializer_range: float = 0.5) -> Path:
    """Save a random Qwen3 (real vocab size, tiny width) plus the Qwen3 tokenizer to ``path``.

    The default ``initializer_range`` gives a frozen random LM head usable logits (but hidden
    states of ~100); 0.1 keeps hidden states ~1, for tests with absolute tolerances."""
    import torch
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=hidden // 4, max_position_embeddings=4096, tie_word_embeddings=True,
        initializer_range=initializer_range)
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)
    unpack_qwen3_tokenizer(path)
    return path


_TARGETS: dict[tuple[Any, ...], Path] = {}
_TARGETS_LOCK = threading.Lock()


def tiny_target(root: Path, layers: int = 4, hidden: int = 64, seed: int = 0,
                vocab: int = 6000, initializer_range: float = 0.5) -> Path:
    """:func:`make_tiny_target` made once per process and argument set, under ``root``
    (tests pass pytest's session base temp), so several test modules share one copy."""
    key = (str(root), layers, hidden, seed, vocab, initializer_range)
    with _TARGETS_LOCK:
        if key not in _TARGETS:
            path = (Path(root) / f"tiny-target-l{layers}-h{hidden}-v{vocab}-s{seed}"
                                 f"-i{initializer_range}")
            if not (path / "config.json").exists():
                make_tiny_target(path, layers=layers, hidden=hidden, seed=seed, vocab=vocab,
                                 initializer_range=initializer_range)
            _TARGETS[key] = path
        return _TARGETS[key]


def online_pipeline(run_dir: Path | str, target: Path | str, *, pack: dict[str, Any],
                    train: dict[str, Any], checkpoint: dict[str, Any] | None = None,
                    layers: tuple[int, ...] = (0, 1, 2), extra: str = "", rows: str = "synthetic",
                    extract: dict[str, Any] | None = None) -> str:
    """YAML of pack:synthetic (or pack:``rows``) -> extract:hf_hooks -> train:dflash [-> checkpoint:fsspec];
    ``extract``: extract's params beyond the target and ``layers``."""
    import json

    extract_params = {"model": str(target), "layers": list(layers), **(extract or {})}
    text = (f"version: 1\nrun_dir: {run_dir}\nstages:\n"
            f"  pack: {{uses: 'pack:{rows}', params: {json.dumps(pack)}}}\n"
            f"  extract: {{uses: 'extract:hf_hooks', after: pack, params: {json.dumps(extract_params)}}}\n"
            f"  train: {{uses: 'train:dflash', after: extract, params: {json.dumps(train)}}}\n")
    if checkpoint is not None:
        text += (f"  checkpoint: {{uses: 'checkpoint:fsspec', after: train, "
                 f"params: {json.dumps(checkpoint)}}}\n")
    return text + extra


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
                mask += [0] * min(4, n) + [1] * (n - 4)  # a document shorter than 4: all prompt
                pos += list(range(n))
            yield {"input_ids": np.array(ids, dtype=np.int64), "loss_mask": np.array(mask, dtype=np.uint8),
                   "position_ids": np.array(pos, dtype=np.int64), "doc_lengths": lengths,
                   "state": {"position": i + 1}, "state_stage": ctx.stage,
                   "rows_per_epoch": per_rank // cfg.epochs, "epochs": cfg.epochs}


@dataclass
class HeldRowsConfig(SyntheticRowsConfig):
    until: str = "interrupt"
    """What releases the rows: the run's ``interrupt`` (SIGINT/SIGTERM), or only its ``stop``."""


class HeldRows(SyntheticRows):
    """:class:`SyntheticRows` held back until the run is interrupted (or stopped), so that a test
    can signal a run whose trainer has not stepped yet. Writes ``<run_dir>/held`` once holding."""

    name = "held"
    Config = HeldRowsConfig

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        Path(ctx.run_dir, "held").touch()
        release = ctx.interrupted if self.config.until == "interrupt" else ctx.should_stop
        while not release():
            time.sleep(0.01)
        yield from super().run(inputs, ctx)


def _split(total: int, parts: int, rng: np.random.Generator) -> list[int]:
    cuts = sorted(rng.choice(np.arange(12, total - 12), size=parts - 1, replace=False).tolist())
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


@dataclass
class RankStatesConfig:
    out: str = "rank_states"


class RankStates(Stage):
    """Debug sink beside the checkpoint stage (``after: train``): saves each rank's final
    drafter weights to ``<run_dir>/<out>/rank<r>.pt``, so a test can compare the ranks of a
    torchrun run (the checkpoint stage only writes rank 0's)."""

    kind = "debug"
    name = "rank_states"
    Config = RankStatesConfig
    inputs = ("states",)

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        import torch

        for state in inputs["states"]:
            if state.get("kind") == "state" and state.get("final"):
                out = os.path.join(ctx.run_dir, self.config.out)
                os.makedirs(out, exist_ok=True)
                torch.save(state["model"], os.path.join(out, f"rank{ctx.rank}.pt"))
        yield from ()


@hookimpl
def dflash_pipe_register_stages(registry: Any) -> None:
    registry.add(SyntheticRows)
    registry.add(HeldRows)
    registry.add(RankStates)
