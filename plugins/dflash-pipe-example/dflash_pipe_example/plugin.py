"""Two stages written against the public dflash-pipe API (``dflash_core``) alone: the stage
contract, the item types of their links (``dflash_core.items``, ``dflash_core.rows``) and the
reader of tokenize's sample shards (``dflash_core.samples``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

from dflash_core import Stage, StageContext, hookimpl
from dflash_core.items import SAMPLE_SOURCES, checked
from dflash_core.rows import PACKED_ROW, packed_row, producer_fields


@dataclass
class SequentialConfig:
    tokens_per_row: int = field(default=8192, metadata={
        "help": "row capacity in tokens; a longer sample is an error"})


class SequentialPack(Stage):
    """First-fit in arrival order: a row closes as soon as the next sample does not fit.

    Its rows carry every field of ``dflash_core.rows.PACKED_ROW`` (``packed_row`` and
    ``producer_fields`` build them): the trainer's LR schedule needs ``epochs`` and
    ``rows_per_epoch`` (so the rows are laid out from the sample lengths before any is yielded), and ``state`` is the cursor ``--resume`` hands back as ``ctx.resume_state``.
    One epoch, one rank.
    """

    kind = "pack"
    name = "sequential"
    Config = SequentialConfig
    inputs = {"samples": SAMPLE_SOURCES}  # tokenize's shards, or inline samples
    output = PACKED_ROW

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        from dflash_core.samples import SampleIndex  # numpy and pyarrow: only when a run reads samples

        index = SampleIndex.build(checked(inputs["samples"], SAMPLE_SOURCES, ctx.stage, ctx.upstream("samples")))
        try:
            rows = _row_samples(index.lengths.tolist(), self.config.tokens_per_row)
            start = int((ctx.resume_state or {}).get("position", 0))
            for i in range(start, len(rows)):
                docs = index.load(rows[i])
                ids = [int(t) for s in rows[i] for t in docs[s][0]]
                mask = [int(m) for s in rows[i] for m in docs[s][1]]
                lengths = [len(docs[s][0]) for s in rows[i]]
                ctx.progress(1, total=len(rows), unit="rows", tokens=len(ids))
                yield packed_row(ids, mask, [p for n in lengths for p in range(n)], lengths,
                                 **producer_fields(state={"position": i + 1}, stage=ctx.stage, epochs=1,
                                                   rows_per_epoch=len(rows)))
            ctx.summary["rows"] = len(rows)
        finally:
            index.close()


def _row_samples(lengths: list[int], limit: int) -> list[list[int]]:
    """Sample ids of each row, in arrival order."""
    rows: list[list[int]] = []
    used = limit
    for sample, n in enumerate(lengths):
        if n > limit:
            raise ValueError(f"sample of {n} tokens exceeds tokens_per_row={limit}")
        if used + n > limit:
            rows.append([])
            used = 0
        rows[-1].append(sample)
        used += n
    return rows


class LengthHistogram(Stage):
    """Counts samples per power-of-two length bucket (a new stage kind)."""

    kind = "lengths"
    name = "histogram"
    inputs = {"samples": SAMPLE_SOURCES}
    default_link = "materialize"

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        from dflash_core.samples import SampleIndex  # numpy and pyarrow: only when a run reads samples

        index = SampleIndex.build(checked(inputs["samples"], SAMPLE_SOURCES, ctx.stage, ctx.upstream("samples")))
        buckets: dict[int, int] = {}
        for n in index.lengths.tolist():
            bucket = 1 << max(n - 1, 0).bit_length()
            buckets[bucket] = buckets.get(bucket, 0) + 1
        index.close()
        ctx.summary["buckets"] = len(buckets)
        for bucket in sorted(buckets):
            yield {"max_len": bucket, "samples": buckets[bucket]}


@hookimpl
def dflash_pipe_register_stages(registry: Any) -> None:
    registry.add(SequentialPack)
    registry.add(LengthHistogram)
