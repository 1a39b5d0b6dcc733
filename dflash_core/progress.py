"""Per-stage progress: a rich live display on a terminal, plain lines otherwise.

Stages report with ``ctx.progress(advance, total=, unit=, **counters)``; every counter gets a
rate (``tokens`` -> tokens/s), and the runner adds the fill of each stream queue, which is
how a user sees which stage is the bottleneck (a full queue in front of a stage = that stage).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from rich.console import Console
from rich.live import Live
from rich.table import Table

PLAIN_INTERVAL_S = 10.0


@dataclass
class _StageLine:
    started: float = field(default_factory=time.time)
    done: int = 0
    start: int = 0
    """Of ``done``, what an earlier run did (a resumed run): left out of the rate and ETA."""
    total: int | None = None
    unit: str = "items"
    counters: dict[str, float] = field(default_factory=dict)
    status: str = "running"
    metrics: dict[str, Any] = field(default_factory=dict)
    last_plain: float = 0.0

    def rate_text(self) -> str:
        elapsed = max(time.time() - self.started, 1e-6)
        now = self.done - self.start
        parts = [f"{self.done:,}{'/' + format(self.total, ',') if self.total else ''} {self.unit}",
                 f"{now / elapsed:,.1f} {self.unit}/s"]
        for name, value in self.counters.items():
            parts.append(f"{value / elapsed:,.0f} {name}/s")
        if self.total and now > 0:
            eta = elapsed * (self.total - self.done) / now
            parts.append(f"ETA {eta:,.0f}s")
        return "  ".join(parts)


class Display:
    """Receives runner callbacks; subclasses decide how to show them."""

    def __init__(self, console: Console | None = None, stream: TextIO | None = None) -> None:
        self.console = console or Console(file=stream or sys.stdout)
        self.lines: dict[str, _StageLine] = {}
        self.queue_fill: dict[str, tuple[int, int]] = {}

    def stage_started(self, stage: str) -> None:
        self.lines[stage] = _StageLine()

    def event(self, stage: str, event: dict[str, Any]) -> None:
        line = self.lines.setdefault(stage, _StageLine())
        kind = event.get("type")
        if kind == "progress":
            line.done += int(event.get("advance", 0))
            line.unit = event.get("unit", line.unit)
            if "total" in event:
                line.total = int(event["total"])
            if "start" in event:
                line.done += int(event["start"]) - line.start
                line.start = int(event["start"])
            for key, value in event.items():
                if (key not in ("type", "advance", "unit", "total", "start")
                        and isinstance(value, (int, float))):
                    line.counters[key] = line.counters.get(key, 0.0) + value
        elif kind == "metrics":
            line.metrics = {k: v for k, v in event.items() if k != "type"}
        elif kind == "log":
            self.console.print(f"[{stage}] {event.get('message', '')}", markup=False)

    def stage_done(self, stage: str, status: str, result: Any) -> None:
        line = self.lines.setdefault(stage, _StageLine())
        line.status = status

    def queues(self, fill: dict[str, tuple[int, int]]) -> None:
        self.queue_fill = fill

    def close(self) -> None:
        """Stop any live rendering."""


class PlainDisplay(Display):
    """For logs and CI: one line per stage event of note, progress at most every 10 s."""

    def stage_started(self, stage: str) -> None:
        super().stage_started(stage)
        self.console.print(f"[{stage}] started", highlight=False, markup=False)

    def event(self, stage: str, event: dict[str, Any]) -> None:
        super().event(stage, event)
        line = self.lines[stage]
        now = time.time()
        if event.get("type") in ("progress", "metrics") and now - line.last_plain >= PLAIN_INTERVAL_S:
            line.last_plain = now
            metrics = "  ".join(f"{k}={_fmt(v)}" for k, v in line.metrics.items())
            self.console.print(f"[{stage}] {line.rate_text()}  {metrics}".rstrip(), highlight=False,
                               markup=False)

    def stage_done(self, stage: str, status: str, result: Any) -> None:
        super().stage_done(stage, status, result)
        took = f" in {result.ended - result.started:.1f}s" if result.ended and result.started else ""
        self.console.print(f"[{stage}] {status}{took} ({result.items:,} items)", highlight=False,
                           markup=False)


class RichDisplay(Display):
    """A live table: one row per stage, with rates, metrics and the queue feeding it."""

    def __init__(self, console: Console | None = None) -> None:
        super().__init__(console)
        self.live = Live(self._table(), console=self.console, refresh_per_second=4,
                         transient=False)
        self.live.start()

    def _table(self) -> Table:
        table = Table(box=None, pad_edge=False)
        for col in ("stage", "status", "progress", "in-queue", "metrics"):
            table.add_column(col)
        for stage, line in self.lines.items():
            fill = [f"{f}/{b}" for name, (f, b) in self.queue_fill.items()
                    if name.endswith(f"->{stage}")]
            metrics = "  ".join(f"{k}={_fmt(v)}" for k, v in list(line.metrics.items())[:6])
            table.add_row(stage, line.status, line.rate_text(), " ".join(fill), metrics)
        return table

    def _refresh(self) -> None:
        self.live.update(self._table())

    def stage_started(self, stage: str) -> None:
        super().stage_started(stage)
        self._refresh()

    def event(self, stage: str, event: dict[str, Any]) -> None:
        super().event(stage, event)
        self._refresh()

    def stage_done(self, stage: str, status: str, result: Any) -> None:
        super().stage_done(stage, status, result)
        self._refresh()

    def queues(self, fill: dict[str, tuple[int, int]]) -> None:
        super().queues(fill)
        self._refresh()

    def close(self) -> None:
        self.live.stop()


def make_display(quiet: bool = False) -> Display:
    """Rich on a terminal, plain lines when stdout is not a TTY, counting only when quiet."""
    if quiet:
        return Display(Console(quiet=True))
    if sys.stdout.isatty():
        return RichDisplay()
    return PlainDisplay()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
