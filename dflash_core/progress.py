"""Per-stage progress: a rich live display on a terminal, plain lines otherwise.

Stages report with ``ctx.progress(advance, total=, unit=, **counters)``; every counter gets a
rate (``tokens`` -> tokens/s), and the runner adds the fill of each stream queue, which is
how a user sees which stage is the bottleneck (a full queue in front of a stage = that stage).

Every display keeps one ``rich.progress`` task per stage, added in pipeline order before any
stage starts, so rows keep that order; rich measures the rates and the time remaining
(``progress_columns.py`` says what each column shows).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

from rich.console import Console
from rich.progress import BarColumn, Progress, Task, TaskID, TextColumn, TimeElapsedColumn

from dflash_core.progress_columns import (ACTIVE, CountColumn, ETAColumn, FieldColumn, RateColumn,
                                          fmt)
from dflash_core.vocabulary import Status

PLAIN_INTERVAL_S = 10.0
SHOWN_METRICS = 6


class Display:
    """Receives runner callbacks into rich tasks; subclasses decide how to show them."""

    live = False

    def __init__(self, stages: Sequence[str] = (), console: Console | None = None,
                 get_time: Callable[[], float] | None = None) -> None:
        self.console = console or Console()
        self.count, self.rate, self.eta = CountColumn(), RateColumn(), ETAColumn(compact=True)
        self.progress = Progress(
            TextColumn("{task.description}"), FieldColumn("status"), BarColumn(bar_width=12),
            self.count, self.rate, self.eta, TimeElapsedColumn(), FieldColumn("queue"),
            FieldColumn("metrics"), console=self.console, refresh_per_second=4,
            get_time=get_time, disable=not self.live)
        self.tasks: dict[str, TaskID] = {}
        for stage in stages:
            self.task(stage)

    def task(self, stage: str) -> Task:
        """The stage's task (a stage the runner did not announce gets a row at the end)."""
        if stage not in self.tasks:
            self.tasks[stage] = self.progress.add_task(
                stage, start=False, total=None, status=Status.PENDING, unit="items", counters={},
                queue="", metrics="")
        return self._get(self.tasks[stage])

    def _get(self, tid: TaskID) -> Task:
        return next(t for t in self.progress.tasks if t.id == tid)

    def stage_started(self, stage: str) -> None:
        self.task(stage)
        self.progress.start_task(self.tasks[stage])
        self.progress.update(self.tasks[stage], status=ACTIVE)

    def event(self, stage: str, event: dict[str, Any]) -> None:
        task = self.task(stage)
        kind = event.get("type")
        if kind == "progress":
            if "start" in event:  # a resumed run: what an earlier run did counts, but not as a rate
                self.progress.reset(task.id, completed=int(event["start"]), total=task.total,
                                    **{**task.fields, "start_count": int(event["start"])})
            counters = task.fields["counters"]
            for key, value in event.items():
                if key in ("type", "advance", "unit", "total", "start") or not isinstance(value, (int, float)):
                    continue
                if key not in counters:
                    counters[key] = self._get(self.progress.add_task(key, total=None, visible=False))
                    counters[key].start_time = task.start_time  # rates over the same time
                self.progress.advance(counters[key].id, value)
            self.progress.update(task.id, advance=int(event.get("advance", 0)),
                                 unit=event.get("unit", task.fields["unit"]),
                                 **({"total": int(event["total"])} if "total" in event else {}))
        elif kind == "metrics":
            shown = [(k, v) for k, v in event.items() if k != "type"][:SHOWN_METRICS]
            self.progress.update(task.id, metrics="  ".join(f"{k}={fmt(v)}" for k, v in shown))
        elif kind == "log":
            self.console.print(f"[{stage}] {event.get('message', '')}", markup=False)

    def stage_done(self, stage: str, status: Status, result: Any) -> None:
        task = self.task(stage)
        for t in (task, *task.fields["counters"].values()):
            self.progress.stop_task(t.id)  # freezes elapsed time, so the rates stay put
        if not task.completed:  # cached, or reported no progress: count what it yielded
            self.progress.update(task.id, completed=result.items)
        if task.total is None:
            self.progress.update(task.id, total=task.completed)
        self.progress.update(task.id, status=status)

    def queues(self, fill: dict[str, tuple[int, int]]) -> None:
        for stage, tid in self.tasks.items():
            into = [f"{f}/{b}" for link, (f, b) in fill.items() if link.endswith(f"->{stage}")]
            self.progress.update(tid, queue=" ".join(into))

    def close(self) -> None:
        """Stop any live rendering."""


class PlainDisplay(Display):
    """For logs and CI: one line per stage event of note, progress at most every 10 s."""

    def __init__(self, stages: Sequence[str] = (), console: Console | None = None,
                 get_time: Callable[[], float] | None = None) -> None:
        super().__init__(stages, console, get_time)
        self.printed: dict[str, float] = {}

    def _print(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)

    def stage_started(self, stage: str) -> None:
        super().stage_started(stage)
        self._print(f"[{stage}] started")

    def event(self, stage: str, event: dict[str, Any]) -> None:
        super().event(stage, event)
        now = self.progress.get_time()
        if (event.get("type") in ("progress", "metrics")
                and now - self.printed.get(stage, -PLAIN_INTERVAL_S) >= PLAIN_INTERVAL_S):
            self.printed[stage] = now
            task = self.task(stage)
            parts = [col.render(task).plain for col in (self.count, self.rate, self.eta)]
            self._print(f"[{stage}] " + "  ".join(p for p in (*parts, task.fields["metrics"]) if p))

    def stage_done(self, stage: str, status: Status, result: Any) -> None:
        super().stage_done(stage, status, result)
        took = f" in {result.ended - result.started:.1f}s" if result.ended and result.started else ""
        self._print(f"[{stage}] {status}{took} ({result.items:,} items)")


class RichDisplay(Display):
    """The live table: one row per stage, with rates, metrics and the queue feeding it.
    While it is up, libraries' own progress bars are off and their log lines print above it."""

    live = True

    def __init__(self, stages: Sequence[str] = (), console: Console | None = None,
                 get_time: Callable[[], float] | None = None) -> None:
        from dflash_core.quiet_libraries import quiet_libraries

        super().__init__(stages, console, get_time)
        self.progress.start()
        self.quiet = quiet_libraries()
        self.quiet.__enter__()  # after start: the live display has redirected stdout/stderr

    def close(self) -> None:
        self.quiet.__exit__(None, None, None)
        self.progress.stop()


def make_display(stages: Sequence[str] = (), quiet: bool = False) -> Display:
    """Rich on a terminal, plain lines when stdout is not a TTY, counting only when quiet;
    ``stages`` in pipeline order."""
    if quiet:
        return Display(stages, Console(quiet=True))
    if sys.stdout.isatty():
        return RichDisplay(stages)
    return PlainDisplay(stages)
