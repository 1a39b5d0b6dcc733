"""Small stage plugins for the engine tests (``-p tests.core.engine_stages``).

Every class is module-level so that process executors can pickle it by reference. Nothing
here imports torch: ``validate``/``list-stages``/``plugins`` with this plugin must stay light.

- ``source:numbers``  yields ``{"i": k, "v": start + k}``; can run forever, throttle, trace.
- ``source:samples``  yields tokenize-like samples ``{"input_ids", "loss_mask"}``.
- ``map:scale``       ``v * factor``; can raise (``fail_at``) or SIGKILL itself (``kill_at``).
- ``sink:collect``    passes items through (materialized): what a test reads back.
- :class:`Recorder`   a hook plugin recording every lifecycle/event hook call.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Literal, Mapping

from dflash_core import Stage, StageContext, hookimpl

# ------------------------------------------------------------------------------ tracing
# Producer/consumer counters shared between thread stages of one test (keyed by ``trace``).
_TRACE_LOCK = threading.Lock()
TRACE: dict[str, dict[str, int]] = {}


def trace_reset(tag: str) -> dict[str, int]:
    with _TRACE_LOCK:
        TRACE[tag] = {"yielded": 0, "consumed": 0, "max_in_flight": 0}
        return TRACE[tag]


def _trace_yield(tag: str) -> None:
    """Called by a producer right before it yields an item."""
    if not tag:
        return
    with _TRACE_LOCK:
        t = TRACE[tag]
        t["yielded"] += 1
        t["max_in_flight"] = max(t["max_in_flight"], t["yielded"] - t["consumed"])


def _trace_consume(tag: str) -> None:
    """Called by a consumer as soon as it receives an item."""
    if tag:
        with _TRACE_LOCK:
            TRACE[tag]["consumed"] += 1


def _where(ctx: StageContext) -> None:
    """Record where the stage ran (process executors have another pid, inline a borrowed thread)."""
    ctx.summary["pid"] = os.getpid()
    ctx.summary["thread"] = threading.current_thread().name


# ------------------------------------------------------------------------------- stages
@dataclass
class NumbersConfig:
    n: int = 10
    start: int = 0
    forever: bool = field(default=False, metadata={
        "help": "Ignore n and yield until the runner stops the stage (never checks should_stop)."})
    delay: float = 0.0
    trace: str = ""
    pad: int = field(default=0, metadata={
        "help": "Add a pad string of this many bytes to each item (big items fill OS pipes)."})
    json_safe: bool = field(default=True, metadata={
        "help": "False: v is a set, which a materialized link cannot store."})


class Numbers(Stage):
    kind = "source"
    name = "numbers"
    Config = NumbersConfig
    inputs = ()
    default_link = "materialize"
    cache_ignore = ("delay", "trace")

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        _where(ctx)
        cfg = self.config
        k = 0
        while cfg.forever or k < cfg.n:
            if cfg.delay:
                time.sleep(cfg.delay)
            _trace_yield(cfg.trace)
            value = cfg.start + k if cfg.json_safe else {cfg.start + k}
            yield {"i": k, "v": value, **({"pad": "x" * cfg.pad} if cfg.pad else {})}
            k += 1
        ctx.summary["count"] = k


@dataclass
class SamplesConfig:
    n: int = 12


class Samples(Stage):
    """Tokenized samples of lengths 3..13 (what a tokenize stage would yield)."""

    kind = "tokenize"
    name = "test_samples"
    Config = SamplesConfig
    inputs = ()
    default_link = "materialize"

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        for k in range(self.config.n):
            length = 3 + (k * 7) % 11
            yield {"input_ids": [100 * k + j for j in range(length)],
                   "loss_mask": [int(j >= length // 2) for j in range(length)]}
        ctx.summary["samples"] = self.config.n


class TwoPartError(Exception):
    """Built from two arguments but keeps one ``args``: pickle cannot rebuild it."""

    def __init__(self, what: str, index: int) -> None:
        super().__init__(f"{what} {index}")


@dataclass
class ScaleConfig:
    factor: int = 2
    fail_at: int = field(default=-1, metadata={
        "help": "Raise ValueError on this item index (after writing the time to <run_dir>/raised_at)."})
    fail_with: Literal["value", "unpicklable"] = field(default="value", metadata={
        "help": "What fail_at raises: ValueError, or a TwoPartError (whose pickle cannot "
                "be loaded: what a process executor's failure may be)."})
    kill_at: int = field(default=-1, metadata={
        "help": "SIGKILL the stage's own process on this item index (use with executor: process), "
                "after writing the time to <run_dir>/killed_at."})
    delay: float = 0.0


class Scale(Stage):
    kind = "map"
    name = "scale"
    Config = ScaleConfig
    cache_ignore = ("delay",)

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        _where(ctx)
        cfg = self.config
        for k, item in enumerate(inputs["items"]):
            if k == cfg.fail_at:
                with open(os.path.join(ctx.run_dir, "raised_at"), "w") as f:
                    f.write(repr(time.time()))
                if cfg.fail_with == "unpicklable":
                    raise TwoPartError("scale refuses item", k)
                raise ValueError(f"scale refuses item {k}")
            if k == cfg.kill_at:
                with open(os.path.join(ctx.run_dir, "killed_at"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            if cfg.delay:
                time.sleep(cfg.delay)
            ctx.progress(1, unit="items", values=1)
            ctx.logger.debug("scale: item %d", k)
            yield {"i": item["i"], "v": item["v"] * cfg.factor}  # drops any pad
        ctx.logger.info("scale: factor %d", cfg.factor)


@dataclass
class CollectConfig:
    delay: float = field(default=0.0, metadata={
        "help": "Seconds spent on each item (a slow consumer)."})
    trace: str = ""
    take: int = field(default=-1, metadata={
        "help": "Stop after this many items without reading the rest (0: read nothing); -1: read all."})


class Collect(Stage):
    kind = "sink"
    name = "collect"
    Config = CollectConfig
    default_link = "materialize"
    cache_ignore = ("delay", "trace")

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        _where(ctx)
        cfg = self.config
        count = 0
        for item in inputs["items"] if cfg.take != 0 else ():
            _trace_consume(cfg.trace)
            if cfg.delay:
                time.sleep(cfg.delay)
            count += 1
            yield item
            if count == cfg.take:
                break
        ctx.summary["count"] = count
        ctx.emit({"type": "metrics", "count": count})


@hookimpl
def dflash_pipe_register_stages(registry: Any) -> None:
    for cls in (Numbers, Samples, Scale, Collect):
        registry.add(cls)


# ------------------------------------------------------------------------------- hooks
class Recorder:
    """A hook plugin: ``pm.add_plugin(Recorder(), "recorder")``; ``calls`` lists (hook, kwargs)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def of(self, hook: str) -> list[dict[str, Any]]:
        return [kw for name, kw in self.calls if name == hook]

    @hookimpl
    def dflash_pipe_before_stage(self, stage: str, kind: str, impl: str, device: str) -> None:
        self.calls.append(("before_stage", {"stage": stage, "kind": kind, "impl": impl,
                                            "device": device}))

    @hookimpl
    def dflash_pipe_after_stage(self, stage: str, status: str, summary: dict[str, Any]) -> None:
        self.calls.append(("after_stage", {"stage": stage, "status": status,
                                           "summary": dict(summary)}))

    @hookimpl
    def dflash_pipe_on_stage_error(self, stage: str, error: BaseException) -> None:
        self.calls.append(("on_stage_error", {"stage": stage, "error": error}))

    @hookimpl
    def dflash_pipe_on_event(self, stage: str, event: dict[str, Any]) -> None:
        self.calls.append(("on_event", {"stage": stage, "event": dict(event)}))
