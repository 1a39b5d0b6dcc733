"""The columns of a stage's progress row, as ``rich.progress`` columns over one task per stage.

A stage's task carries in its fields: ``status``, ``unit``, ``counters`` (one hidden task per
extra counter such as tokens, so rich measures its rate too), ``queue`` and ``metrics``.
Rich gives the rates (over its speed-estimate window) and the time remaining; these columns
only decide what a finished or not-yet-known figure shows.
"""

from __future__ import annotations

from typing import Any

from rich.progress import ProgressColumn, Task, TimeRemainingColumn
from rich.text import Text

from dflash_core.vocabulary import Status

ACTIVE = Status.RUNNING


def fmt(value: Any) -> str:
    """A metric value, short: floats to 4 significant digits."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def rate(task: Task, running: bool) -> float | None:
    """Per second: rich's windowed speed while the stage runs; once it has ended, the average
    over its whole run (its elapsed time is frozen then, so the figure stays put)."""
    if running and task.speed is not None:
        return task.speed
    elapsed = task.elapsed
    return (task.completed - task.fields.get("start_count", 0)) / elapsed if elapsed else None


class CountColumn(ProgressColumn):
    """``done/total unit`` (the total only once a stage knows it)."""

    def render(self, task: Task) -> Text:
        total = f"/{int(task.total):,}" if task.total is not None else ""
        return Text(f"{int(task.completed):,}{total} {task.fields.get('unit', 'items')}")


class RateColumn(ProgressColumn):
    """Items per second, then each counter per second (tokens/s, …)."""

    def render(self, task: Task) -> Text:
        parts = []
        running = task.fields.get("status") == ACTIVE
        for name, counter in [(task.fields.get("unit", "items"), task),
                              *task.fields.get("counters", {}).items()]:
            value = rate(counter, running)
            if value is not None:
                parts.append(f"{value:,.1f} {name}/s" if counter is task else f"{value:,.0f} {name}/s")
        return Text("  ".join(parts))


class ETAColumn(TimeRemainingColumn):
    """Rich's time remaining, shown only while a stage runs toward a total it has not passed
    (a total that was an estimate can be overrun: then nothing, never a negative time)."""

    def render(self, task: Task) -> Text:
        remaining = task.remaining
        if task.fields.get("status") != ACTIVE or remaining is None or remaining < 0:
            return Text("")
        return Text(f"ETA {super().render(task).plain}")


class FieldColumn(ProgressColumn):
    """A text field of the task as it is (status, queue fill, metrics)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def render(self, task: Task) -> Text:
        return Text(str(task.fields.get(self.name, "")))
