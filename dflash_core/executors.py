"""Running one stage: in the caller's thread (inline), a worker thread, or a spawned process.

:func:`drive` is the one loop every executor shares: build the stage, feed it its inputs,
tee each yielded item to the artifact writer and the stream links, commit, report. Executors
differ only in where that loop runs and how its events reach the runner.
"""

from __future__ import annotations

import inspect
import logging
import multiprocessing as mp
import os
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

from dflash_core.artifacts import ArtifactStore
from dflash_core.events import Failed, Failure, Finished, Lifecycle, Logged, Started, Stopped
from dflash_core.links import POLL_S, Channel, StopRun, close_all, fan_out
from dflash_core.stage import Stage, StageContext


@dataclass
class ArtifactSource:
    """An input read back from a committed artifact."""

    run_dir: str
    stage: str
    key: str

    def open(self, emit: Any, stop: Any) -> Iterator[Any]:
        return ArtifactStore(self.run_dir).items(self.stage, self.key)


@dataclass
class ChannelSource:
    channel: Channel

    def open(self, emit: Any, stop: Any) -> Iterator[Any]:
        return iter(self.channel)


@dataclass
class InlineSource:
    """An ``inline`` upstream, run as a generator inside its consumer's thread."""

    task: "StageTask"

    def open(self, emit: Any, stop: Any) -> Iterator[Any]:
        return drive(self.task, emit, stop)


@dataclass
class StageTask:
    """Everything needed to run one stage, picklable for process executors."""

    name: str
    cls: type[Stage]
    ctx: StageContext
    inputs: dict[str, Any] = field(default_factory=dict)
    outputs: list[Channel] = field(default_factory=list)
    artifact_key: str | None = None
    """Set when the output is materialized: the key it is written under."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Extra manifest fields (impl, params, upstream digests)."""


class StageFailed(Exception):
    """A stage raised: carries its :class:`Failure` out through the inline stages that ran it."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(f"{failure.stage}: {failure.message}")
        self.failure = failure


def drive(task: StageTask, emit: Any, stop: Any) -> Iterator[Any]:
    """Run ``task``'s stage, yield its items, commit its artifact, emit start/done events."""
    ctx = task.ctx
    ctx.emitter, ctx.stop_event = emit, stop
    for ch in task.outputs:
        ch.stop_event = stop
    try:
        inputs = {port: src.open(emit, stop) for port, src in task.inputs.items()}
        for src in task.inputs.values():
            if isinstance(src, ChannelSource):
                src.channel.stop_event = stop
        writer = (ArtifactStore(ctx.run_dir).writer(task.name, task.artifact_key)
                  if task.artifact_key else None)
        emit(task.name, Started(os.getpid()))
        stage = task.cls(ctx.config)
        count = 0
        outputs = list(task.outputs)  # stream links whose consumer still reads
        items = stage.run(inputs, ctx)
        for item in items:
            if writer is not None:
                writer.add(item)
            fan_out(item, outputs)
            count += 1
            yield item  # GeneratorExit here: the consumer of this inline stage stopped reading
            if stop is not None and stop.is_set():
                raise StopRun()
            if task.outputs and not outputs and writer is None:
                items.close()  # every consumer finished early and nothing is stored: stop here
                break
        close_all(outputs)
        _release_inputs(task, inputs, emit)
        digest = writer.commit({**task.meta, "summary": ctx.summary}) if writer else None
        emit(task.name, Finished(count, digest, ctx.summary))
    except (StopRun, StageFailed):
        raise
    except GeneratorExit:  # inline stages are never materialized: nothing to commit
        if stop is None or not stop.is_set():
            _release_inputs(task, inputs, emit)
            emit(task.name, Finished(count, None, ctx.summary))
        raise
    except BaseException as exc:  # report every failure with the stage's name
        raise StageFailed(Failure.of(task.name, exc)) from exc


def _release_inputs(task: StageTask, inputs: dict[str, Any], emit: Any) -> None:
    """This stage reads no more: stop what still feeds it, so that nothing waits on a reader
    that is gone. Inline upstreams are closed (and report done); stream producers see their
    link closed and end instead of blocking on a full queue (or taking this for a crash)."""
    for port, src in task.inputs.items():
        it = inputs.get(port)
        if isinstance(src, InlineSource) and it is not None \
                and inspect.getgeneratorstate(it) == inspect.GEN_CREATED:
            _never_started(src.task, emit)
        elif isinstance(src, ChannelSource):
            src.channel.closed.set()
        close = getattr(it, "close", None)
        if close is not None:
            close()


def _never_started(task: StageTask, emit: Any) -> None:
    """An inline stage whose consumer ended before reading it: report it done with no items."""
    for src in task.inputs.values():
        if isinstance(src, InlineSource):
            _never_started(src.task, emit)
        elif isinstance(src, ChannelSource):
            src.channel.closed.set()
    emit(task.name, Finished(0, None, {}))


def _work(task: StageTask, emit: Any, stop: Any) -> None:
    """Drain a stage whose items go to links/writer only; report failures as events."""
    try:
        for _ in drive(task, emit, stop):
            pass
    except StopRun:
        emit(task.name, Stopped())
    except StageFailed as exc:
        emit(exc.failure.stage, Failed(exc.failure))


class QueueEmitter:
    """``ctx.emit`` backend: puts (stage, event) on a queue the runner drains."""

    def __init__(self, q: Any) -> None:
        self.q = q

    def __call__(self, stage: str, event: dict[str, Any] | Lifecycle) -> None:
        self.q.put((stage, event))


class ThreadWorker:
    def __init__(self, task: StageTask, events: "queue.Queue[Any]", stop: threading.Event) -> None:
        self.name = task.name
        self.thread = threading.Thread(target=_work, args=(task, QueueEmitter(events), stop),
                                       name=f"stage-{task.name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def exit_info(self) -> str:
        return "thread ended"

    def kill(self) -> None:
        """Threads cannot be killed; they see the stop flag at their next wait."""

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)


class _ToRunner(logging.Handler):
    """Sends a spawned stage's log records to the run's process (as :class:`Logged` events): a
    spawned interpreter starts with no logging set up, and writing to the terminal itself would
    cut through the run's live display."""

    def __init__(self, stage: str, emit: QueueEmitter) -> None:
        super().__init__()
        self.stage, self._emit = stage, emit

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info:
                message += "\n" + logging.Formatter().formatException(record.exc_info)
            self._emit(self.stage, Logged(record.name, record.levelno, message))
        except Exception:
            self.handleError(record)


def _process_main(task: StageTask, events: Any, stop: Any, log_level: int) -> None:
    import signal

    # a terminal's Ctrl-C reaches the whole process group: the parent decides what it means
    # (save and stop, or abort) and tells this process through the run's events
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    root = logging.getLogger()
    root.handlers[:] = [_ToRunner(task.name, QueueEmitter(events))]
    root.setLevel(log_level)
    parent = os.getppid()

    def parent_alive() -> bool:
        return os.getppid() == parent

    for ch in task.outputs:
        ch.consumer_alive = parent_alive
    for src in task.inputs.values():
        if isinstance(src, ChannelSource):
            src.channel.producer_alive = parent_alive
    _work(task, QueueEmitter(events), stop)
    _wait_until_read(task.outputs, stop, parent_alive)
    for ch in task.outputs:
        if ch.closed.is_set() or stop.is_set():
            # nobody reads the rest: exiting must not wait for it to drain into the pipe
            ch.q.cancel_join_thread()


def _wait_until_read(outputs: list[Channel], stop: Any, parent_alive: Any) -> None:
    """Stay alive until every consumer has finished reading (it sets ``closed``), the run
    stops, or the parent is gone. torch sends a tensor through a process queue as a handle
    to memory this process still owns: a CPU tensor's shared-memory file descriptor is
    handed over on request by this process's resource-sharer thread, a CUDA tensor is
    mapped through CUDA IPC. Exiting right after the last ``put`` made the consumer fail on
    the rows still queued (FileNotFoundError connecting to the sharer)."""
    while outputs and not all(ch.closed.is_set() for ch in outputs):
        if stop.is_set() or not parent_alive():
            return
        stop.wait(POLL_S)


class ProcessWorker:
    """A stage in a spawned process (never fork: CUDA state does not survive a fork)."""

    def __init__(self, task: StageTask, events: Any, stop: Any) -> None:
        self.name = task.name
        # the run's log level: the records the spawned process sends are those this one would print
        self.process = mp.get_context("spawn").Process(
            target=_process_main, args=(task, events, stop, logging.getLogger().getEffectiveLevel()),
            name=f"stage-{task.name}", daemon=True)

    def start(self) -> None:
        self.process.start()

    def alive(self) -> bool:
        return self.process.is_alive()

    def exit_info(self) -> str:
        code = self.process.exitcode
        if code is not None and code < 0:
            import signal

            try:
                return f"process killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"process killed by signal {-code}"
        return f"process exited with code {code}"

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.terminate()

    def join(self, timeout: float) -> None:
        self.process.join(timeout)
