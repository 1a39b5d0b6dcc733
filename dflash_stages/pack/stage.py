"""pack:best_fit — tokenized samples → rows of at most ``tokens_per_row`` tokens, resumable.

The packing itself lives in :mod:`dflash_stages.pack.packing` (numpy/pyarrow only); this module is the
stage: it builds the sample index from the tokenize shards, restores the cursor from
``ctx.resume_state`` and yields this rank's rows for every epoch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from dflash_core.rows import producer_fields
from dflash_core.stage import Stage, StageContext
from dflash_stages.pack.packing import BestFitPacker, PackError, SampleIndex

__all__ = ["PackConfig", "BestFitPack", "PackError"]


@dataclass
class PackConfig:
    tokens_per_row: int = 8192
    """Row capacity in tokens; a sample longer than this is an error (tokenize max_len should prevent it)."""
    shuffle_window: int = 10000
    """Samples per best-fit window (after the per-epoch shuffle); bounds memory and locality."""
    seed: int = 0
    epochs: int = 1
    drop_last: bool = False
    """Equal rows per rank: True drops the last R mod world_size rows of an epoch, False repeats
    the epoch's first rows to fill the last round."""
    pad_to: int = 0
    """0: rows keep their length; else pad each row (pad_token_id, loss_mask 0) to a multiple of this."""
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if self.tokens_per_row < 1:
            raise ValueError("tokens_per_row must be >= 1")
        if self.shuffle_window < 1:
            raise ValueError("shuffle_window must be >= 1")
        if self.epochs < 1:
            raise ValueError("epochs must be >= 1")
        if self.pad_to < 0:
            raise ValueError("pad_to must be >= 0")
        if self.pad_to and self.tokens_per_row % self.pad_to:
            raise ValueError(f"tokens_per_row ({self.tokens_per_row}) must be a multiple of "
                             f"pad_to ({self.pad_to})")


class BestFitPack(Stage):
    """Best-fit-decreasing packing within a shuffle window; deterministic per (seed, epoch)."""

    kind = "pack"
    name = "best_fit"
    version = "1"
    Config = PackConfig
    inputs = ("samples",)
    default_link = "stream"

    def run(self, inputs: Mapping[str, Any], ctx: StageContext) -> Iterator[dict]:
        cfg: PackConfig = self.config
        t0 = time.monotonic()
        index = SampleIndex.build(inputs["samples"])
        try:
            packer = BestFitPacker(index, tokens_per_row=cfg.tokens_per_row,
                                   shuffle_window=cfg.shuffle_window, seed=cfg.seed,
                                   epochs=cfg.epochs, rank=ctx.rank, world_size=ctx.world_size,
                                   drop_last=cfg.drop_last, pad_to=cfg.pad_to,
                                   pad_token_id=cfg.pad_token_id)
            resume = getattr(ctx, "resume_state", None)
            if resume:
                packer.load_state_dict(resume)
                ctx.logger.info("pack: resuming at epoch %d row %d", packer.epoch, packer.position)
            ctx.logger.info("pack: %d samples (%d empty left out), %d tokens, indexed in %.1f s",
                            len(index), index.empty, int(index.lengths.sum(dtype="int64")),
                            time.monotonic() - t0)
            s = ctx.summary
            s.update({"samples": len(index), "empty_samples": index.empty, "epochs": cfg.epochs,
                      "rows": 0, "tokens": 0, "loss_tokens": 0, "pad_tokens": 0, "fill": 0.0,
                      "start": packer.state_dict()})
            rows_per_epoch: dict[int, int] = {}

            def total() -> int:
                if packer.epoch >= cfg.epochs:
                    return s["rows"]
                e0 = packer.state_dict()["epoch"]
                rows_per_epoch.setdefault(e0, packer.rows_in_epoch(e0))
                left = rows_per_epoch[e0] - packer.position
                return s["rows"] + left + rows_per_epoch[e0] * (cfg.epochs - e0 - 1)

            ctx.progress(0, total=total(), unit="rows")
            for row in packer:
                s["rows"] += 1
                s["tokens"] += row["num_tokens"]
                s["loss_tokens"] += int(row["loss_mask"].sum())
                s["pad_tokens"] += row["num_pad"]
                s["fill"] = round(s["tokens"] / (s["rows"] * cfg.tokens_per_row), 6)
                ctx.progress(1, total=total(), unit="rows", tokens=row["num_tokens"])
                # for the trainer: whose cursor ``state`` is, and the schedule's length
                row.update(producer_fields(state=row["state"], stage=ctx.stage, epochs=cfg.epochs,
                                           rows_per_epoch=rows_per_epoch.get(0) or packer.rows_in_epoch(0)))
                yield row
                if ctx.should_stop():
                    return
        finally:
            index.close()
