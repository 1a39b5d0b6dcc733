"""Two stages written against the public dflash-pipe API only (``dflash_core``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

from dflash_core import Stage, StageContext, hookimpl


@dataclass
class SequentialConfig:
    tokens_per_row: int = 8192


class SequentialPack(Stage):
    """First-fit in arrival order: rows close as soon as the next sample does not fit."""

    kind = "pack"
    name = "sequential"
    Config = SequentialConfig
    inputs = ("samples",)

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        limit = self.config.tokens_per_row
        ids: list[int] = []
        mask: list[int] = []
        pos: list[int] = []
        lengths: list[int] = []
        rows = 0
        for sample in inputs["samples"]:
            n = len(sample["input_ids"])
            if n > limit:
                raise ValueError(f"sample of {n} tokens exceeds tokens_per_row={limit}")
            if len(ids) + n > limit:
                yield _row(ids, mask, pos, lengths)
                rows += 1
                ids, mask, pos, lengths = [], [], [], []
            ids += list(sample["input_ids"])
            mask += list(sample["loss_mask"])
            pos += list(range(n))
            lengths.append(n)
            ctx.progress(1, unit="samples", tokens=n)
        if ids:
            yield _row(ids, mask, pos, lengths)
            rows += 1
        ctx.summary["rows"] = rows


def _row(ids: list[int], mask: list[int], pos: list[int], lengths: list[int]) -> dict[str, Any]:
    return {"input_ids": ids, "loss_mask": mask, "position_ids": pos, "doc_lengths": lengths}


class LengthHistogram(Stage):
    """Counts samples per power-of-two length bucket (a new stage kind)."""

    kind = "lengths"
    name = "histogram"
    inputs = ("samples",)
    default_link = "materialize"

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        buckets: dict[int, int] = {}
        for sample in inputs["samples"]:
            n = len(sample["input_ids"])
            bucket = 1 << max(n - 1, 0).bit_length()
            buckets[bucket] = buckets.get(bucket, 0) + 1
        ctx.summary["buckets"] = len(buckets)
        for bucket in sorted(buckets):
            yield {"max_len": bucket, "samples": buckets[bucket]}


@hookimpl
def dflash_pipe_register_stages(registry: Any) -> None:
    registry.add(SequentialPack)
    registry.add(LengthHistogram)
