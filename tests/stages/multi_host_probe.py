"""Probes for the two-host torchrun tests (tests/stages/test_multi_host.py): what each global rank
ran, on which device, and which rows its trainer read — so a test can tell local-rank from
global-rank placement apart on the second host, where they differ.

Every record goes under the directory named by ``$MULTI_HOST_PROBE``, one file per rank and kind,
tagged with torchrun's RANK, LOCAL_RANK and GROUP_RANK (the node)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from dflash_core import StageContext, hookimpl
from dflash_stages.train.stage import DFlashTrain
from tests.stages.online_fixtures import SyntheticRows

PROBE_ENV = "MULTI_HOST_PROBE"


def _torchrun_env() -> dict[str, int]:
    return {k.lower(): int(os.environ.get(k, "0")) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK")}


def _record(kind: str, record: dict[str, Any]) -> None:
    """Append ``record`` (with this process's torchrun ranks) to ``rank<RANK>.<kind>.jsonl``."""
    env = _torchrun_env()
    out = Path(os.environ[PROBE_ENV])
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"rank{env['rank']}.{kind}.jsonl", "a") as f:
        f.write(json.dumps({**env, **record}) + "\n")


def read_probe(root: Path, kind: str) -> list[dict[str, Any]]:
    """Every rank's ``kind`` records, in rank order."""
    return [json.loads(line) for path in sorted(root.glob(f"rank*.{kind}.jsonl"))
            for line in path.read_text().splitlines()]


class IndexedRows(SyntheticRows):
    """:class:`SyntheticRows` with each row's global index (``row_index``), which extract passes
    through to the trainer."""

    name = "indexed"

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        for row in super().run(inputs, ctx):
            yield {**row, "row_index": (row["state"]["position"] - 1) * ctx.world_size + ctx.rank}


class ProbedTrain(DFlashTrain):
    """train:dflash that records the ``row_index`` of every feature row its trainer reads, with its
    device and stage rank, once the stream ends."""

    name = "probed"

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        read: list[int] = []

        def tap(items: Iterable[Any]) -> Iterator[Any]:
            for item in items:
                if isinstance(item, Mapping) and "row_index" in item:
                    read.append(int(item["row_index"]))
                yield item

        yield from super().run({**inputs, "features": tap(inputs["features"])}, ctx)
        _record("trained", {"device": ctx.device, "stage_rank": ctx.rank, "rows": read})


@hookimpl
def dflash_pipe_before_stage(stage: str, kind: str, impl: str, device: str) -> None:
    if PROBE_ENV in os.environ:
        _record("stages", {"stage": stage, "device": device})


@hookimpl
def dflash_pipe_register_stages(registry: Any) -> None:
    registry.add(IndexedRows)
    registry.add(ProbedTrain)
