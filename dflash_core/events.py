"""What a stage's worker tells the runner about the stage itself, and how a failure is kept.

A worker sends ``(stage, event)`` pairs on one queue: the dicts a stage emits with
``ctx.emit`` (progress, metrics, …, handed on to plugins) and the engine's own lifecycle
events below, which the runner consumes. Being types rather than tagged dicts, the two cannot
be confused and a lifecycle event's fields are named where it is made.

A :class:`Failure` keeps the exception itself, so that ``on_stage_error`` hooks and the
root-cause search see its real type. From a process executor the exception crosses a pickle:
one that does not survive it arrives as a :class:`StageError` carrying its type's name and
traceback text.
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass, field
from typing import Any

from dflash_core.links import PeerDied, StopRun


class StageError(Exception):
    """Stands for a stage's exception that could not be rebuilt in the runner's process (its
    class takes other arguments than its ``args``, or it holds something unpicklable).

    ``type_name`` is the original class's qualified name, ``traceback`` the text of its
    traceback as formatted in the stage's process.
    """

    def __init__(self, type_name: str, message: str, traceback: str = "") -> None:
        super().__init__(f"{type_name}: {message}" if message else type_name)
        self.type_name, self.traceback = type_name, traceback


def _qualified(tp: type) -> str:
    return tp.__qualname__ if tp.__module__ == "builtins" else f"{tp.__module__}.{tp.__qualname__}"


@dataclass(eq=False)
class Failure:
    """One stage's failure: which stage, its exception and that exception's traceback text.

    ``message`` is the exception's last line (``ValueError: bad row``), as the CLI shows it.
    A failure the runner finds itself (a worker that died, an interrupt) has no exception.
    """

    stage: str
    message: str
    traceback: str = ""
    type_name: str = ""
    """Qualified name of the exception's class (``ValueError``, ``dflash_core.links.PeerDied``)."""
    exception: BaseException | None = field(default=None, repr=False)

    @classmethod
    def of(cls, stage: str, exc: BaseException) -> "Failure":
        """The failure of ``stage`` that raised ``exc`` (called where it was caught)."""
        message = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(stage, message, tb, _qualified(type(exc)), exc)

    @property
    def error(self) -> BaseException:
        """The exception to hand to hooks: the original, or a :class:`StageError` standing for it."""
        if self.exception is not None:
            return self.exception
        detail = self.message.partition(": ")[2] if self.type_name else self.message
        return StageError(self.type_name or "error", detail, self.traceback)

    @property
    def is_consequence(self) -> bool:
        """True if the stage only saw the run stop or a peer die (itself, or what it was
        handling when it raised): the cause lies elsewhere."""
        seen: set[int] = set()
        exc = self.exception
        while exc is not None and id(exc) not in seen:
            if isinstance(exc, (PeerDied, StopRun)):
                return True
            seen.add(id(exc))
            exc = exc.__cause__ or exc.__context__
        return False

    def __getstate__(self) -> dict[str, Any]:
        # pickled on a process queue's feeder thread, where an error would drop the event:
        # the exception travels as bytes, or not at all
        state = self.__dict__.copy()
        try:
            state["exception"] = pickle.dumps(self.exception)
        except Exception:
            state["exception"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        blob = state.get("exception")
        try:
            state["exception"] = pickle.loads(blob) if blob is not None else None
        except Exception:  # its class cannot be rebuilt from its args: error gives a StageError
            state["exception"] = None
        self.__dict__.update(state)


def root_cause(failures: list[Failure]) -> Failure:
    """The failure that started it: not one that only saw its peer die or the run stop."""
    return next((f for f in failures if not f.is_consequence), failures[0])


@dataclass(frozen=True)
class Started:
    """The stage's loop began (in the process ``pid``)."""

    pid: int


@dataclass(frozen=True)
class Finished:
    """The stage yielded its last item; a materialized output is committed as ``digest``."""

    items: int
    digest: str | None
    summary: dict[str, Any]


@dataclass(frozen=True)
class Stopped:
    """The stage ended because the run was stopping."""


@dataclass(frozen=True)
class Failed:
    """The stage raised."""

    failure: Failure


@dataclass(frozen=True)
class Logged:
    """A log record of a stage in a spawned process, for the run's process to log: its handlers
    (the console beside the live display) print a process's records as they print a thread's."""

    logger: str
    level: int
    message: str
    """The record's message with its arguments, and its traceback where it has one."""


Lifecycle = Started | Finished | Stopped | Failed | Logged
"""The engine's own events, as opposed to the dicts a stage emits."""
