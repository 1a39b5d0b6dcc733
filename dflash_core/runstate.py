"""What a run directory remembers, and what is fresh, stale or missing in it.

``state.json`` records, per materialized stage, the artifact it last produced (key, digest,
params, the digests of the inputs it was made from). ``status``, ``--only`` and ``--dry-run``
compare that record with the pipeline file as it is now, so each can say *why* a stage would
run again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from dflash_core.artifacts import ArtifactStore, artifact_key, join, read_json, write_bytes, write_json
from dflash_core.events import Failure
from dflash_core.pipeline import Pipeline
from dflash_core.vocabulary import Freshness, Link

STATE_FILE = "state.json"
FAILURES_FILE = "failures.log"
LOCK_FILE = ".lock"


def semantic_params(pipeline: Pipeline, stage: str) -> dict[str, Any]:
    """The params that define a stage's output: all fields (defaults included) but cache_ignore."""
    spec = pipeline.stages[stage]
    values = dataclasses.asdict(spec.config) if dataclasses.is_dataclass(spec.config) else {}
    return {k: v for k, v in values.items() if k not in spec.cls.cache_ignore}


def is_materialized(pipeline: Pipeline, stage: str) -> bool:
    """True if the stage's output is written to the artifact store in a full run."""
    consumers = pipeline.consumers(stage)
    if not consumers:
        return pipeline.stages[stage].cls.default_link == Link.MATERIALIZE
    return any(pipeline.link(stage, c) == Link.MATERIALIZE for c in consumers)


def stream_work_dir(pipeline: Pipeline, stage: str) -> str:
    """``ctx.work_dir`` of a stage that is not materialized: one place a run after run, where its
    files (evaluate's reports) are found again."""
    return join(pipeline.run_dir, "work", stage)


def stage_key(pipeline: Pipeline, stage: str, upstream_digests: dict[str, str]) -> str:
    spec = pipeline.stages[stage]
    return artifact_key(spec.impl, spec.cls.version, semantic_params(pipeline, stage),
                        upstream_digests)


@dataclass
class StageStatus:
    """A stage's output in the run dir, and the first cause found when it is not fresh."""

    stage: str
    state: Freshness
    cause: str = ""
    key: str | None = None
    digest: str | None = None


class RunRecord:
    """``<run_dir>/state.json``: the last artifact of each stage. Written by the main process only."""

    def __init__(self, run_dir: str) -> None:
        self.url = join(run_dir, STATE_FILE)
        data = read_json(self.url) or {}
        self.stages: dict[str, dict[str, Any]] = data.get("stages", {})

    def record(self, stage: str, entry: dict[str, Any]) -> None:
        self.stages[stage] = entry
        write_json(self.url, {"stages": self.stages})


def log_failures(run_dir: str, failures: list[Failure], rank: int = 0) -> str:
    """Append a failed run's failures, each with its traceback, to ``<run_dir>/failures.log``
    (``failures.rank<N>.log`` on rank N > 0 under torchrun) and return its URL. The CLI prints one
    line per failure; a run that failed in an unattended job keeps the rest here, dated, for
    whoever reads it later."""
    import fsspec

    url = join(run_dir, FAILURES_FILE if rank == 0 else f"failures.rank{rank}.log")
    try:
        with fsspec.open(url, "rt") as f:
            before = f.read()
    except FileNotFoundError:
        before = ""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    blocks = [f"== {stamp}: the run failed on {socket.gethostname()}, pid {os.getpid()}\n"]
    for failure in failures:
        blocks.append(f"-- stage {failure.stage!r}: {failure.message}\n{failure.traceback or '(no traceback)'}\n")
    write_bytes(url, (before + "".join(blocks) + "\n").encode())
    return url


def analyse(pipeline: Pipeline, store: ArtifactStore, record: RunRecord) -> dict[str, StageStatus]:
    """Fresh/stale/missing/streamed for every stage, with the first cause found."""
    out: dict[str, StageStatus] = {}
    for stage in pipeline.order():
        rec = record.stages.get(stage)
        if not is_materialized(pipeline, stage):
            consumers = ", ".join(pipeline.consumers(stage))
            cause = (f"output is streamed to {consumers}, not stored" if consumers else
                     "output is not stored (a last stage with a stream link by default)")
            out[stage] = StageStatus(stage, Freshness.STREAMED, cause)
            continue
        if rec is None:
            out[stage] = StageStatus(stage, Freshness.MISSING, "never materialized in this run dir")
            continue
        if not store.exists(stage, rec["key"]):
            out[stage] = StageStatus(stage, Freshness.MISSING,
                                      f"artifact {rec['key']} is gone or incomplete")
            continue
        status = StageStatus(stage, Freshness.FRESH, "", rec["key"], rec["digest"])
        cause = _stale_cause(pipeline, stage, rec, out, record)
        if cause:
            status.state, status.cause = Freshness.STALE, cause
        out[stage] = status
    return out


def _stale_cause(pipeline: Pipeline, stage: str, rec: dict[str, Any],
                 known: dict[str, StageStatus], record: RunRecord) -> str:
    spec = pipeline.stages[stage]
    if rec.get("impl") != spec.impl or rec.get("version") != spec.cls.version:
        return (f"implementation changed: {rec.get('impl')} v{rec.get('version')} -> "
                f"{spec.impl} v{spec.cls.version}")
    now = semantic_params(pipeline, stage)
    was = rec.get("params", {})
    for name in sorted(set(now) | set(was)):
        if _canon(now.get(name)) != _canon(was.get(name)):
            return f"param '{name}' changed: {was.get(name)!r} -> {now.get(name)!r}"
    for upstream in spec.after.values():
        up = known[upstream]
        if up.state == Freshness.STREAMED:
            return f"input '{upstream}' is streamed, not stored"
        if up.state != Freshness.FRESH:
            return f"upstream '{upstream}' is {up.state} ({up.cause})"
        if rec.get("upstream", {}).get(upstream) != up.digest:
            return f"upstream '{upstream}' output changed since this artifact was made"
    return ""


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


class RunLock:
    """One run per run dir at a time. Local: an exclusive flock; object stores: a marker object."""

    def __init__(self, run_dir: str, store: ArtifactStore) -> None:
        self.url = join(run_dir, LOCK_FILE)
        self.store = store
        self._fh: Any = None

    def acquire(self) -> None:
        if self.store.local:
            import fcntl

            path = self.store._path(self.url)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._fh = open(path, "a+")
            try:
                fcntl.flock(self._fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._fh.seek(0)
                holder = self._fh.read().strip() or "another process"
                self._fh.close()
                raise RuntimeError(f"run dir is in use by {holder} (lock {path})") from None
            self._fh.seek(0)
            self._fh.truncate()
            self._fh.write(f"pid {os.getpid()} on {socket.gethostname()}")
            self._fh.flush()
        else:
            write_json(self.url, {"pid": os.getpid(), "host": socket.gethostname(),
                                  "since": time.time()})

    def release(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        elif not self.store.local:
            try:
                self.store.fs.rm(self.store._path(self.url))
            except FileNotFoundError:
                pass
