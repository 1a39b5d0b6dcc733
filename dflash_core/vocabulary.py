"""The engine's words: a stage's status in a run, what a run dir holds of its output, how a
link carries items, where a stage runs.

Each is a ``str``-valued enum whose members print as their value, so they stand where plain
strings stood before: a pipeline file's ``link: stream``, a plugin's ``status == "done"``, JSON
written with them all keep working, while the engine's own code names members, and a misspelt
one raises instead of quietly comparing unequal.
"""

from __future__ import annotations

import enum


class Word(str, enum.Enum):
    """A ``str`` enum that formats as its value (``f"{Link.STREAM}"`` is ``stream``), as
    Python 3.11's ``StrEnum`` does; the project supports 3.10."""

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """The members' values, in definition order (what a user may write)."""
        return tuple(m.value for m in cls)


class Status(Word):
    """Where a stage is in one run (``StageResult.status``, the ``after_stage`` hook)."""

    PENDING = "pending"
    """Not started: its inputs are not ready yet."""
    RUNNING = "running"
    DONE = "done"
    """Ran to its end; a materialized output is committed."""
    CACHED = "cached"
    """Not run: a fresh artifact for the same key was found and is replayed to consumers."""
    FAILED = "failed"
    STOPPED = "stopped"
    """Ended by the runner (another stage failed, or the run was interrupted)."""


class Freshness(Word):
    """What a run directory holds of a stage's output, compared with the pipeline file as it is
    now (``dflash-pipe status``, ``--only``, ``--dry-run``)."""

    FRESH = "fresh"
    """Its artifact exists and was made from the same params, version and inputs."""
    STALE = "stale"
    """Its artifact exists, but something it was made from has changed since."""
    MISSING = "missing"
    """Never made in this run dir, or gone or incomplete."""
    STREAMED = "streamed"
    """Its output is never stored: it goes to its consumers by stream links."""


class Link(Word):
    """How a stage's input reaches it from its upstream (``link:`` in the pipeline file)."""

    STREAM = "stream"
    """Item by item over a bounded queue, while both stages run; nothing is stored."""
    MATERIALIZE = "materialize"
    """Stored as an artifact first; the consumer starts once it is committed (and may be cached)."""


class Executor(Word):
    """Where a stage's loop runs (``executor:`` in the pipeline file)."""

    INLINE = "inline"
    """As a generator inside its single stream consumer's worker (no queue in between)."""
    THREAD = "thread"
    PROCESS = "process"
    """A spawned process (never forked: CUDA state does not survive a fork)."""
