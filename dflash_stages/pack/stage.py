"""pack:best_fit — tokenized samples → rows of at most ``tokens_per_row`` tokens, resumable.

The packing itself lives in :mod:`dflash_stages.pack.packing` (numpy only); this module is the
stage: it builds the sample index (:mod:`dflash_core.samples`) from the tokenize shards,
restores the cursor from ``ctx.resume_state`` and yields this rank's rows for every epoch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

from dflash_core.facts import MAX_SAMPLE_TOKENS, ROW_TOKENS
from dflash_core.items import SAMPLE_SOURCES, checked
from dflash_core.pipeline import Pipeline, Problem
from dflash_core.rows import PACKED_ROW, producer_fields
from dflash_core.samples import SampleIndex
from dflash_core.stage import Stage, StageContext
from dflash_stages.pack.packing import BestFitPacker, PackError

__all__ = ["PackConfig", "BestFitPack", "PackError"]


@dataclass
class PackConfig:
    tokens_per_row: int = field(default=8192, metadata={
        "help": "Row capacity in tokens; a sample longer than this is an error (tokenize max_len "
                "should prevent it)."})
    shuffle_window: int = field(default=10000, metadata={
        "help": "Samples per best-fit window (after the per-epoch shuffle); bounds memory and "
                "locality."})
    seed: int = field(default=0, metadata={"help": "with the epoch, seeds the shuffle of the samples"})
    epochs: int = field(default=1, metadata={"help": "passes over the samples, each shuffled anew"})
    drop_last: bool = field(default=False, metadata={
        "help": "Equal rows per rank: True drops the last R mod world_size rows of an epoch, False "
                "repeats the epoch's first rows to fill the last round."})
    pad_to: int = field(default=0, metadata={
        "help": "0: rows keep their length; else pad each row (pad_token_id, loss_mask 0) to a "
                "multiple of this."})
    pad_token_id: int = field(default=0, metadata={"help": "token id of the padding pad_to adds"})

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
    inputs = {"samples": SAMPLE_SOURCES}
    output = PACKED_ROW
    default_link = "stream"

    @classmethod
    def facts_for_consumers(cls, config: PackConfig) -> Mapping[str, Any]:
        """Rows padded to their capacity all have one length, which extract and train can
        compile for before the first row (rows padded to a smaller multiple have several)."""
        return {ROW_TOKENS: config.tokens_per_row} if config.pad_to == config.tokens_per_row else {}

    @classmethod
    def check(cls, pipeline: Pipeline, name: str) -> Iterable[Problem]:
        """A sample longer than a row cannot be packed: refuse a tokenize upstream whose longest
        sample exceeds ``tokens_per_row`` before anything runs (the packer would at its start)."""
        cfg: PackConfig = pipeline.stages[name].config
        longest = pipeline.upstream_facts(name).get(MAX_SAMPLE_TOKENS)
        if longest is None or longest <= cfg.tokens_per_row:
            return ()
        upstream = pipeline.stages[name].after["samples"]
        return [Problem(name, f"'{upstream}' upstream of '{name}' yields samples of up to {longest} tokens, "
                              f"longer than a row of '{name}' (tokens_per_row={cfg.tokens_per_row}): set "
                              f"tokenize max_len <= {cfg.tokens_per_row} or raise tokens_per_row",
                        ("params", "tokens_per_row"))]

    def run(self, inputs: Mapping[str, Any], ctx: StageContext) -> Iterator[dict]:
        cfg: PackConfig = self.config
        t0 = time.monotonic()
        index = SampleIndex.build(checked(inputs["samples"], SAMPLE_SOURCES, ctx.stage, ctx.upstream("samples")))
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
