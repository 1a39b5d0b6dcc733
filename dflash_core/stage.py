"""The stage contract: what a plugin subclasses, and what it is handed when it runs.

A stage is a class with ``kind``, ``name``, a ``Config`` dataclass and a generator ``run``.
Keeping the contract this small lets the runner put a stage in a thread, a process or the
main thread, and link it to its neighbours by a queue or by stored artifacts, without the
stage knowing which.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Iterator, Mapping

from dflash_core.items import ItemType, PortType
from dflash_core.vocabulary import Executor, Link

if TYPE_CHECKING:
    from dflash_core.pipeline import Pipeline, Problem


@dataclass
class NoConfig:
    """Config of a stage that takes no params."""


class Stage:
    """Base class of every stage implementation (built-in or third-party).

    Subclasses set the class attributes and implement :meth:`run`. One instance is made per
    run of the stage, in the executor that runs it (so ``__init__`` may hold device state).
    """

    kind: ClassVar[str] = ""
    """Pipeline role this implementation can fill (``download``, ``tokenize``, …, or a new one)."""
    name: ClassVar[str] = ""
    """Implementation name, chosen in YAML with ``uses: kind:name`` or just ``uses: name``."""
    version: ClassVar[str] = "1"
    """Bump when the output for the same params changes: it invalidates cached artifacts."""
    Config: ClassVar[type] = NoConfig
    """Dataclass of the stage's ``params:``; validated against the YAML before anything runs."""
    inputs: ClassVar[Mapping[str, PortType] | tuple[str, ...]] = ("items",)
    """Input ports and the item types each accepts (``{"rows": PACKED_ROW}``, see
    :mod:`dflash_core.items`); ``()`` for a source stage. A tuple of names declares untyped
    ports, which accept anything."""
    output: ClassVar[ItemType | None] = None
    """The type of the items ``run`` yields; ``validate`` checks that it fits each consumer's
    port. None: undeclared (fits any port)."""
    default_link: ClassVar[Link | str] = Link.STREAM
    """How this stage's output reaches consumers unless the consumer's ``link:`` says otherwise."""
    default_executor: ClassVar[Executor | str] = Executor.THREAD
    """Where the stage runs unless the YAML's ``executor:`` says otherwise."""
    always_run: ClassVar[bool] = False
    """True for stages that read the outside world (e.g. download): never skipped as cached,
    but their artifact digest is computed from content, so unchanged data keeps consumers fresh."""
    cache_ignore: ClassVar[tuple[str, ...]] = ()
    """Params that do not change the output (worker counts, progress intervals): left out of the cache key."""
    preload: ClassVar[tuple[str, ...]] = ()
    """``module`` or ``module:attr`` imported by the runner in the main thread before any stage
    starts: libraries whose import is not thread-safe (transformers' lazy module) must not be
    first imported by two stage threads at once."""
    needs_torch: ClassVar[bool] = False
    """True if the stage imports torch; lets the runner resolve its ``device:`` (CUDA checks)."""
    stops_at_interrupt: ClassVar[bool] = False
    """True if ``run`` watches :meth:`StageContext.interrupted` and then ends by itself, having
    yielded what must be saved (the trainer's state): on SIGINT/SIGTERM the runner lets it and
    its consumers finish. Other stages are stopped at once."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: "StageContext") -> Iterator[Any]:
        """Consume ``inputs[port]`` iterables and yield output items as they are produced."""
        raise NotImplementedError(f"{type(self).__name__}.run")

    @classmethod
    def report(cls, summary: dict[str, Any]) -> Any:
        """A rich renderable shown after the run from the stage's ``ctx.summary`` (or None)."""
        return None

    @classmethod
    def facts_for_consumers(cls, config: Any) -> Mapping[str, Any]:
        """Facts this stage's settings fix for every stage downstream of it (names in
        :mod:`dflash_core.facts`): the engine hands them on as ``ctx.upstream_facts``, so a
        stage learns them from the stage that owns them, not by reading its params."""
        return {}

    @classmethod
    def facts_for_producers(cls, config: Any) -> Mapping[str, Any]:
        """Facts for the stages that feed this one directly (``ctx.consumer_facts``): the
        checkpoint stage tells its trainer the cadence it saves at."""
        return {}

    @classmethod
    def owes_after_training(cls, config: Any, work_dir: str, step: int) -> bool:
        """Whether a run whose training ended at ``step`` still lacks this stage's output for that
        step (a signal stopped the stage after the final checkpoint): ``run --resume`` then replays
        the final checkpoint to the stages after it instead of calling the run complete.
        ``work_dir`` is the stage's ``ctx.work_dir``. Stages that consume checkpoints override it."""
        return False

    @classmethod
    def check(cls, pipeline: "Pipeline", name: str) -> "Iterable[Problem]":
        """Mistakes between stage ``name`` (of this class) and the others that would only
        surface at run time: ``validate`` and ``run`` report them at the file's line before
        anything starts. Read what crosses stages through :meth:`Pipeline.upstream_facts`,
        :meth:`Pipeline.consumer_facts` and :meth:`Pipeline.fan_in`."""
        return ()


@dataclass
class StageContext:
    """What the runner hands a stage: its settings, where to write, and how to report.

    It is picklable (for process executors): the emitter is a plain callable the executor
    replaces with a queue-backed one.
    """

    stage: str
    """The stage's name in the pipeline file (``tokenize``), not the implementation's."""
    config: Any
    device: str = "cpu"
    run_dir: str = "."
    """Run directory (local path or fsspec URL) shared by all stages of the pipeline."""
    work_dir: str = "."
    """Directory for this stage's own files. For a materialized stage it is inside the artifact
    being written, so files put here become part of the artifact (and are removed with it)."""
    cache_dir: str = "."
    """Persistent per-stage directory (``<run_dir>/cache/<stage>``) that survives across runs,
    for work a re-run may skip (verified downloads)."""
    rank: int = 0
    world_size: int = 1
    """This stage's rank among the ranks that run it, and their number (torchrun)."""
    ranks: tuple[int, ...] | None = None
    """The global torchrun ranks running this stage (None = all): a stage that talks to its
    replicas (gradient all-reduce) uses ``dflash_core.remote.group(ctx.ranks)``."""
    resume_state: dict[str, Any] | None = None
    """This stage's state from the latest checkpoint when the run is resumed, else None."""
    resume_checkpoint: str | None = None
    """The checkpoint directory being resumed from (None on a fresh run)."""
    fan_in: dict[str, int] = field(default_factory=dict)
    """Input port -> producer ranks feeding each rank of this stage on it: N/M where N producer
    ranks stream to M ranks of this one, 1 (or absent) when both run on the same ranks."""
    upstream_facts: dict[str, Any] = field(default_factory=dict)
    """Facts the stages upstream of this one publish (``Stage.facts_for_consumers``; names in
    :mod:`dflash_core.facts`): the tokenizer the trainer's export records, for one."""
    consumer_facts: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Consumer stage name -> the facts it publishes to this stage (``Stage.facts_for_producers``):
    the checkpoint stage's cadence, for one."""
    pipeline: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Every stage of the pipeline: ``{name: {"kind", "impl", "params", "after", "ranks"}}``, for
    information (logs, a plugin's own display). What a stage needs of its neighbours the engine
    hands it as :attr:`fan_in`, :attr:`upstream_facts` and :attr:`consumer_facts`; :meth:`upstream`
    names the stage feeding a port from here."""
    summary: dict[str, Any] = field(default_factory=dict)
    """Stage-filled figures (records in/out, tokens, …): stored with the artifact and shown at the end."""
    emitter: Any = None
    stop_event: Any = None
    interrupt_event: Any = None

    @property
    def logger(self) -> logging.Logger:
        return logging.getLogger(f"dflash_pipe.stage.{self.stage}")

    def emit(self, event: dict[str, Any]) -> None:
        """Send an event (``type``: progress, metrics, checkpoint, log, …) to the runner and hooks."""
        if self.emitter is not None:
            self.emitter(self.stage, event)

    def progress(self, advance: int = 0, *, total: int | None = None, unit: str = "items",
                 start: int | None = None, **counters: float) -> None:
        """Report progress: ``advance`` items done, optional ``total`` and extra counters
        (``tokens=…``, ``bytes=…``) that the display turns into rates. ``start``: items an
        earlier run already did (a resumed run), counted in the position but not in the rate."""
        event: dict[str, Any] = {"type": "progress", "advance": advance, "unit": unit, **counters}
        if total is not None:
            event["total"] = total
        if start is not None:
            event["start"] = start
        self.emit(event)

    def stages_of_kind(self, kind: str) -> list[dict[str, Any]]:
        """Entries of :attr:`pipeline` with this kind, in file order (information: a stage's
        settings are its own; what crosses stages arrives as facts)."""
        return [dict(v, name=k) for k, v in self.pipeline.items() if v.get("kind") == kind]

    def upstream(self, port: str) -> str | None:
        """The pipeline name of the stage feeding input ``port`` (None when not known)."""
        return ((self.pipeline.get(self.stage) or {}).get("after") or {}).get(port)

    def interrupted(self) -> bool:
        """True once the user interrupted the run (SIGINT/SIGTERM): a stage that
        ``stops_at_interrupt`` saves its state and ends at its next safe point."""
        return bool(self.interrupt_event is not None and self.interrupt_event.is_set())

    def should_stop(self) -> bool:
        """True once the runner asked every stage to stop (another stage failed)."""
        return bool(self.stop_event is not None and self.stop_event.is_set())
