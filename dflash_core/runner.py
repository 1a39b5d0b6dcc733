"""Runs a validated pipeline: decides what must run, links the stages, supervises them.

Scheduling is lazy: a stage is launched once its materialized inputs are committed, because
only then is its artifact key known (a download that found nothing new keeps tokenize
cached). Stream-linked stages run concurrently and the main thread only supervises: it
drains events, watches for dead workers and stops everything on the first failure.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from dflash_core.artifacts import ArtifactStore, join
from dflash_core.events import (Failed, Failure, Finished, Lifecycle, Logged, Started, Stopped,
                                root_cause)
from dflash_core.executors import (ArtifactSource, ChannelSource, InlineSource, ProcessWorker,
                                   StageTask, ThreadWorker)
from dflash_core.links import POLL_S, Channel, close_all, fan_out
from dflash_core.pipeline import Pipeline
from dflash_core.runstate import (RunLock, RunRecord, StageStatus, analyse, is_materialized, log_failures,
                                  semantic_params, stage_key, stream_work_dir)
from dflash_core.stage import StageContext
from dflash_core.vocabulary import Executor, Freshness, Link, Status

QUEUE_BOUND = 8
STOP_GRACE_S = 1.0


class Refused(Exception):
    """``--only``/``--from`` cannot run: an input is missing, stale or streamed (exit 4)."""


class RunFailed(Exception):
    """A stage failed: ``failure`` is the root cause (``stage`` names it, ``tb`` is its traceback);
    ``log``: the run dir's failures.log, where every failure of the run and its traceback went
    (None if it could not be written)."""

    def __init__(self, failure: Failure, log: str | None = None) -> None:
        super().__init__(f"stage '{failure.stage}' failed: {failure.message}")
        self.failure, self.log = failure, log
        self.stage, self.message, self.tb = failure.stage, failure.message, failure.traceback


class Interrupted(Exception):
    """The run stopped on a signal (SIGINT/SIGTERM): after its stateful stages saved and ended,
    or at once when ``aborted`` (a second signal). ``failures``: stages that failed meanwhile."""

    def __init__(self, signum: int, aborted: bool, results: dict[str, "StageResult"],
                 failures: list[Failure]) -> None:
        super().__init__(f"interrupted by signal {signum}")
        self.signum, self.aborted, self.results, self.failures = signum, aborted, results, failures


@dataclass
class Decision:
    """What a run would do with one stage, and why (``--dry-run`` prints these)."""

    stage: str
    action: str
    """run | cached? | from-artifact | skip"""
    reason: str


@dataclass
class StageResult:
    stage: str
    status: Status = Status.PENDING
    items: int = 0
    digest: str | None = None
    key: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    started: float = 0.0
    ended: float = 0.0


class Runner:
    def __init__(self, pipeline: Pipeline, plugins: Any, *, only: str | None = None,
                 from_stage: str | None = None, display: Any = None, queue_bound: int = QUEUE_BOUND,
                 resume_states: dict[str, Any] | None = None,
                 resume_checkpoint: str | None = None) -> None:
        self.p = pipeline
        self.plugins = plugins
        self.only, self.from_stage = only, from_stage
        self.display = display
        self.queue_bound = queue_bound
        self.store = ArtifactStore(pipeline.run_dir)
        self.record = RunRecord(pipeline.run_dir)
        self.resume_states = resume_states or {}
        self.resume_checkpoint = resume_checkpoint
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.placement: dict[str, tuple[int, ...]] = {}
        """Stage -> ranks running it (set under torchrun)."""
        self.interrupt_signal: int | None = None
        """The signal that asked this run to stop (set by a signal handler, polled by the loop)."""

    def interrupt(self, signum: int) -> None:
        """Ask the run to save and stop (safe in a signal handler: it only records ``signum``)."""
        self.interrupt_signal = signum

    # ---------------------------------------------------------------- deciding
    def selected(self) -> list[str]:
        """Stages this invocation runs, in order."""
        order = self.p.order()
        for flag, name in (("--only", self.only), ("--from", self.from_stage)):
            if name is not None and name not in self.p.stages:
                raise Refused(f"{flag} {name}: no such stage (stages: {', '.join(order)})")
        if self.only:
            return [self.only]
        if self.from_stage:
            chosen = {self.from_stage, *self.p.downstream(self.from_stage)}
            return [s for s in order if s in chosen]
        return order

    def external_inputs(self, statuses: dict[str, StageStatus],
                        chosen_stages: list[str] | None = None) -> dict[str, StageStatus]:
        """Upstreams of selected stages that are not selected: they must be fresh artifacts."""
        chosen = set(self.selected() if chosen_stages is None else chosen_stages)
        needed: dict[str, StageStatus] = {}
        for stage in chosen:
            for upstream in self.p.stages[stage].after.values():
                if upstream in chosen:
                    continue
                st = statuses[upstream]
                if self.p.link(upstream, stage) == Link.STREAM or st.state == Freshness.STREAMED:
                    raise Refused(
                        f"cannot run '{stage}' alone: its input '{upstream}' is streamed, not "
                        f"materialized (run the whole pipeline, or set 'link: materialize' on "
                        f"'{stage}')")
                if st.state != Freshness.FRESH:
                    raise Refused(f"cannot run '{stage}': its input '{upstream}' is {st.state}: "
                                  f"{st.cause} (run 'dflash-pipe run' without --only first)")
                needed[upstream] = st
        return needed

    def decide(self) -> list[Decision]:
        """What ``run`` would do and why, without running or loading anything."""
        statuses = analyse(self.p, self.store, self.record)
        external = self.external_inputs(statuses)
        chosen = self.selected()
        out: list[Decision] = []
        for stage in self.p.order():
            spec = self.p.stages[stage]
            st = statuses[stage]
            if stage in external:
                out.append(Decision(stage, "from-artifact", f"fresh artifact {st.key}"))
            elif stage not in chosen:
                out.append(Decision(stage, "skip", "not selected"))
            elif self.only:
                out.append(Decision(stage, "run", "--only"))
            elif self.from_stage:
                out.append(Decision(stage, "run", f"--from {self.from_stage}"))
            elif spec.cls.always_run:
                out.append(Decision(stage, "run", "reads the outside world: always checked"))
            elif streamed_in := [u for u in spec.after.values()
                                 if self.p.link(u, stage) == Link.STREAM]:
                # as _cached: a stage fed by a stream link is never skipped
                out.append(Decision(stage, "run", f"input '{streamed_in[0]}' is streamed: "
                                                   "runs with it"))
            elif st.state == Freshness.FRESH:
                out.append(Decision(stage, "cached", f"fresh artifact {st.key}"))
            else:
                out.append(Decision(stage, "run", st.cause))
        return out

    # ----------------------------------------------------------------- running
    def run(self) -> dict[str, StageResult]:
        preload([self.p.stages[s].cls for s in self.selected()])
        if self.world_size > 1:
            return self._run_distributed()
        statuses = analyse(self.p, self.store, self.record)
        external = self.external_inputs(statuses)
        chosen = self.selected()
        lock = RunLock(self.p.run_dir, self.store)
        lock.acquire()
        try:
            return _Supervisor(self, chosen, external).run()
        finally:
            lock.release()

    def shared_prefix(self) -> list[str]:
        """Selected stages whose output is the same on every rank: materialized, fed only by
        materialized links. Under torchrun rank 0 makes them once; the others read them."""
        prefix: list[str] = []
        for stage in self.selected():
            spec = self.p.stages[stage]
            if is_materialized(self.p, stage) and all(
                    self.p.link(u, stage) == Link.MATERIALIZE for u in spec.after.values()):
                prefix.append(stage)
        return prefix

    def _run_distributed(self) -> dict[str, StageResult]:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():  # gloo for barriers, NCCL for CUDA tensors
            cuda = torch.cuda.is_available() and dist.is_nccl_available()
            dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
        self.placement, cross = self._place(dist.get_world_size())
        prefix = self.shared_prefix()
        results: dict[str, StageResult] = {}
        if self.rank == 0 and prefix:
            lock = RunLock(self.p.run_dir, self.store)
            lock.acquire()
            try:
                statuses = analyse(self.p, self.store, self.record)
                results.update(_Supervisor(self, prefix, self.external_inputs(statuses, prefix)).run())
            finally:
                lock.release()
        dist.barrier()
        self.record = RunRecord(self.p.run_dir)
        statuses = analyse(self.p, self.store, self.record)
        rest = [s for s in self.selected() if s not in prefix]
        external = self.external_inputs(statuses, rest)
        mine = [s for s in rest if self.rank in self.placement[s]]
        results.update(_Supervisor(self, mine, external, cross).run())
        return results

    def _place(self, world: int) -> tuple[dict[str, tuple[int, ...]], list[tuple[str, str]]]:
        """Ranks of every stage, the links that cross ranks, and their process groups (made on
        every rank in the same order, as torch requires)."""
        from dflash_core import remote

        place = {s: spec.ranks or tuple(range(world)) for s, spec in self.p.stages.items()}
        beyond = {s: list(r) for s, r in place.items() if max(r) >= world}
        if beyond:
            raise Refused(f"ranks beyond WORLD_SIZE={world}: " +
                          ", ".join(f"{s} {r}" for s, r in beyond.items()))
        cross = [(u, s) for s in self.p.order() for u in self.p.stages[s].after.values()
                 if place[u] != place[s]]
        sets = [r for r in place.values() if len(r) < world]
        for u, s in cross:
            for consumer, producers in remote.route(place[u], place[s]).items():
                sets += [remote.pair(p, consumer) for p in producers]
        remote.make_groups(sets)
        return place, cross

    def stage_rank(self, stage: str) -> tuple[int, int]:
        """(rank among the stage's ranks, how many) — what the stage sees as rank/world_size."""
        ranks = self.placement.get(stage)
        if ranks is None:
            return self.rank, self.world_size
        return ranks.index(self.rank) if self.rank in ranks else 0, len(ranks)

    def _fire(self, name: str, **kwargs: Any) -> None:
        if self.plugins is not None:
            getattr(self.plugins.hook, name)(**kwargs)


class _Supervisor:
    """One run: channels, workers, the event loop and shutdown."""

    def __init__(self, runner: Runner, chosen: list[str],
                 external: dict[str, StageStatus], cross: list[tuple[str, str]] | None = None) -> None:
        self.r = runner
        self.cross = [(u, d) for u, d in cross or [] if u in chosen or d in chosen]
        """Links to or from another rank this process serves (remote.py threads)."""
        self.remote_threads: dict[tuple[str, str], threading.Thread] = {}
        self.p = runner.p
        self.chosen = chosen
        self.digests: dict[str, str] = {s: st.digest for s, st in external.items() if st.digest}
        self.keys: dict[str, str] = {s: st.key for s, st in external.items() if st.key}
        self.results = {s: StageResult(s) for s in chosen}
        self.uses_process = any(self._executor(s) == Executor.PROCESS for s in chosen)
        ctx = mp.get_context("spawn")
        self.stop: Any = ctx.Event() if self.uses_process else threading.Event()
        self.interrupt: Any = ctx.Event() if self.uses_process else threading.Event()
        self.savers: set[str] = set()
        """On an interrupt: the stages it waits for (those that save state, and their consumers)."""
        self.thread_events: queue.Queue[Any] = queue.Queue()
        self.proc_events: Any = ctx.Queue() if self.uses_process else None
        self.channels = self._make_channels(ctx)
        self.workers: dict[str, Any] = {}
        self.fused: dict[str, str] = {}
        """inline stage -> the consumer whose thread runs it"""
        self.failures: list[Failure] = []

    # which executor a stage really gets: inline is fused into its single stream consumer
    def _executor(self, stage: str) -> Executor:
        spec = self.p.stages[stage]
        if spec.executor != Executor.INLINE:
            return Executor(spec.executor)
        consumers = [c for c in self.p.consumers(stage) if c in self.chosen]
        if (len(consumers) == 1 and self.p.link(stage, consumers[0]) == Link.STREAM
                and self._executor(consumers[0]) != Executor.PROCESS):
            return Executor.INLINE
        return Executor.THREAD

    def _make_channels(self, ctx: Any) -> dict[tuple[str, str], Channel]:
        channels = {}
        for stage in self.chosen:
            for upstream in self.p.stages[stage].after.values():
                if upstream not in self.chosen or self.p.link(upstream, stage) != Link.STREAM:
                    continue
                if self._executor(upstream) == Executor.INLINE:
                    continue
                crosses = Executor.PROCESS in (self._executor(upstream), self._executor(stage))
                q = ctx.Queue(self.r.queue_bound) if crosses else queue.Queue(self.r.queue_bound)
                closed = ctx.Event() if crosses else threading.Event()
                channels[(upstream, stage)] = Channel(upstream, stage, q, self.r.queue_bound,
                                                      closed)
        for upstream, stage in self.cross:  # the local end of a link to/from another rank
            channels[(upstream, stage)] = Channel(upstream, stage, queue.Queue(self.r.queue_bound),
                                                  self.r.queue_bound)
        return channels

    def _start_remote(self) -> None:
        """Sender threads for links leaving this rank, receiver threads for links arriving."""
        from dflash_core import remote

        me = self.r.rank
        for up, down in self.cross:
            ch = self.channels[(up, down)]
            ch.stop_event = self.stop
            routes = remote.route(self.r.placement[up], self.r.placement[down])
            if up in self.chosen:  # we produce: send to our consumer rank
                dst = next(c for c, ps in routes.items() if me in ps)
                cuda_ok = self.p.stages[down].device.startswith("cuda")
                t = remote.start_thread(remote.send_stream, ch, dst, remote.group(remote.pair(me, dst)),
                                        cuda_ok, name=f"send-{up}-to-rank{dst}")
                ch.consumer_alive = t.is_alive
            else:  # we consume: receive from our producer ranks, round robin
                sources = [(p, remote.group(remote.pair(p, me))) for p in routes[me]]
                t = remote.start_thread(remote.receive_stream, sources, ch, self.p.stages[down].device,
                                        name=f"recv-{up}-on-rank{me}")
                ch.producer_alive = t.is_alive
            self.remote_threads[(up, down)] = t

    # ------------------------------------------------------------------ launch
    def _ready(self, stage: str) -> bool:
        for upstream in self.p.stages[stage].after.values():
            if self.p.link(upstream, stage) == Link.MATERIALIZE and upstream not in self.digests:
                return False
            # an inline upstream runs inside this stage's worker: its own inputs must be ready
            if (upstream in self.chosen and self._executor(upstream) == Executor.INLINE
                    and not self._ready(upstream)):
                return False
        return True

    def _task(self, stage: str) -> StageTask:
        spec = self.p.stages[stage]
        upstream_digests: dict[str, str] = {}
        inputs: dict[str, Any] = {}
        for port, upstream in spec.after.items():
            if (upstream, stage) in self.channels:
                inputs[port] = ChannelSource(self.channels[(upstream, stage)])
                upstream_digests[upstream] = "stream"
            elif upstream in self.chosen and self._executor(upstream) == Executor.INLINE:
                inputs[port] = InlineSource(self._task(upstream))
                self.fused[upstream] = stage
                upstream_digests[upstream] = "stream"
            else:
                inputs[port] = ArtifactSource(self.p.run_dir, upstream, self.keys[upstream])
                upstream_digests[upstream] = self.digests[upstream]
        key = stage_key(self.p, stage, upstream_digests)
        if "stream" in upstream_digests.values():
            key = f"{key[:12]}-{int(time.time() * 1000) % 10**8:08d}"  # never reused
        materialized = is_materialized(self.p, stage)
        run_dir = self.p.run_dir
        work_dir = self.r.store.dir(stage, key) if materialized else stream_work_dir(self.p, stage)
        cache_dir = join(run_dir, "cache", stage)
        for d in (work_dir, cache_dir):
            if "://" not in d:
                os.makedirs(d, exist_ok=True)
        rank, world_size = self.r.stage_rank(stage)
        ctx = StageContext(stage=stage, config=spec.config, device=spec.device, run_dir=run_dir,
                           work_dir=work_dir, cache_dir=cache_dir, rank=rank,
                           world_size=world_size, ranks=self.r.placement.get(stage),
                           resume_state=self.r.resume_states.get(stage),
                           resume_checkpoint=self.r.resume_checkpoint,
                           fan_in=self.p.fan_in(stage), upstream_facts=self.p.upstream_facts(stage),
                           consumer_facts=self.p.consumer_facts(stage),
                           pipeline=self._pipeline_view(), interrupt_event=self.interrupt)
        outputs = [ch for (up, _), ch in self.channels.items() if up == stage]
        meta = {"impl": spec.impl, "version": spec.cls.version,
                "params": semantic_params(self.p, stage), "upstream": upstream_digests}
        self.keys[stage] = key
        return StageTask(stage, spec.cls, ctx, inputs, outputs,
                         key if materialized else None, meta)

    def _pipeline_view(self) -> dict[str, dict[str, Any]]:
        return {name: {"kind": spec.cls.kind, "impl": spec.impl,
                       "params": semantic_params(self.p, name), "after": dict(spec.after),
                       "ranks": self.r.placement.get(name)}
                for name, spec in self.p.stages.items()}

    def _cached(self, stage: str) -> bool:
        """Skip a fresh stage (plain ``run`` only) and replay its artifact to stream consumers."""
        spec = self.p.stages[stage]
        if (self.r.only or self.r.from_stage or spec.cls.always_run
                or not is_materialized(self.p, stage)):
            return False
        if any(self.p.link(u, stage) == Link.STREAM for u in spec.after.values()):
            return False
        upstream = {u: self.digests[u] for u in spec.after.values()}
        key = stage_key(self.p, stage, upstream)
        manifest = self.r.store.manifest(stage, key)
        if manifest is None:
            return False
        self.keys[stage], self.digests[stage] = key, manifest["digest"]
        res = self.results[stage]
        res.status, res.key, res.digest = Status.CACHED, key, manifest["digest"]
        res.items, res.summary = manifest.get("items", 0), manifest.get("summary", {})
        outputs = [ch for (up, _), ch in self.channels.items() if up == stage]
        if outputs:
            threading.Thread(target=_replay, args=(self.r.store, stage, key, outputs, self.stop),
                             daemon=True).start()
        self._notify_done(stage, Status.CACHED)
        return True

    def _launch(self, stage: str) -> None:
        if self._cached(stage):
            return
        if self._executor(stage) == Executor.INLINE:
            return  # runs inside its consumer's worker
        task = self._task(stage)
        executor = self._executor(stage)
        if executor == Executor.PROCESS:
            worker: Any = ProcessWorker(task, self.proc_events, self.stop)
        else:
            worker = ThreadWorker(task, self.thread_events, self.stop)
        self.workers[stage] = worker
        spec = self.p.stages[stage]
        self.r._fire("dflash_pipe_before_stage", stage=stage, kind=spec.cls.kind,
                     impl=spec.impl, device=spec.device)
        res = self.results[stage]
        res.status, res.started, res.key = Status.RUNNING, time.time(), task.artifact_key
        if self.r.display:
            self.r.display.stage_started(stage)
        worker.start()
        # wired once started: a worker not yet started is not alive, and a stream consumer
        # already waiting on this stage would take it for dead
        self._wire_liveness(stage, worker)

    def _wire_liveness(self, stage: str, worker: Any) -> None:
        for (up, down), ch in self.channels.items():
            if up == stage:
                ch.producer_alive = worker.alive
            if down == stage:
                ch.consumer_alive = worker.alive

    # -------------------------------------------------------------- event loop
    def run(self) -> dict[str, StageResult]:
        pending = list(self.chosen)
        self._start_remote()
        aborted = False
        try:
            while True:
                if self.r.interrupt_signal is not None and not self.interrupt.is_set():
                    self._begin_interrupt()
                for stage in list(pending) if not self.interrupt.is_set() else ():
                    if self._ready(stage):
                        pending.remove(stage)
                        self._launch(stage)
                self._drain(0.05)
                self._check_workers()
                if self.failures:
                    break
                if self.interrupt.is_set() and not any(
                        self.results[s].status == Status.RUNNING for s in self.savers):
                    break
                if not pending and all(
                        self.results[s].status in (Status.DONE, Status.CACHED)
                        for s in self.chosen):
                    break
                if self.r.display:
                    self.r.display.queues({f"{u}->{d}": (ch.fill(), ch.bound)
                                           for (u, d), ch in self.channels.items()})
        except KeyboardInterrupt:
            if self.r.interrupt_signal is None:  # no handler (not the CLI's main thread)
                self.failures.append(Failure("(runner)", "interrupted (Ctrl-C)"))
            aborted = True
        if self.r.interrupt_signal is not None:
            # whatever failed after the signal is its consequence (a pool worker hit by the
            # terminal's Ctrl-C): the outcome is the interrupt; the failures are reported with it
            self._stop_all()
            raise Interrupted(self.r.interrupt_signal, aborted, self.results, self.failures)
        if not self.failures:
            self._finish_sends()
        if self.failures:
            self._shutdown()
        self._reap()
        return self.results

    def _begin_interrupt(self) -> None:
        """Tell the stages; wait for those that save state (and their consumers), stop the rest."""
        import signal

        self.interrupt.set()
        saving = [s for s in self.chosen if self.results[s].status == Status.RUNNING
                  and self.p.stages[s].cls.stops_at_interrupt]
        self.savers = {*saving,
                       *(c for s in saving for c in self.p.consumers(s) if c in self.chosen)}
        what = (f"{', '.join(saving)} will save at the next step and stop" if saving
                else "stopping (no running stage has state to save)")
        logging.getLogger("dflash_pipe.runner").warning(
            "%s: %s; send it again to abort at once", signal.Signals(self.r.interrupt_signal).name,
            what)

    def _finish_sends(self) -> None:
        """Our stages are done, but items may still be on their way to other ranks: wait."""
        for (up, _), t in self.remote_threads.items():
            while up in self.chosen and t.is_alive():
                t.join(POLL_S)
                if self.stop.is_set():
                    return

    def _drain(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while True:
            got = False
            for q in (self.thread_events, self.proc_events):
                if q is None:
                    continue
                try:
                    stage, event = q.get_nowait()
                except (queue.Empty, OSError, ValueError):
                    continue
                got = True
                self._on_event(stage, event)
            if not got:
                if time.time() >= deadline:
                    return
                time.sleep(0.01)

    def _on_event(self, stage: str, event: dict[str, Any] | Lifecycle) -> None:
        """A worker's report: a lifecycle event (the engine's) or a dict the stage emitted."""
        res = self.results.get(stage)
        if isinstance(event, Started):
            if res is not None and stage in self.fused:  # an inline stage has just started
                res.status, res.started = Status.RUNNING, time.time()
                spec = self.p.stages[stage]
                self.r._fire("dflash_pipe_before_stage", stage=stage, kind=spec.cls.kind,
                             impl=spec.impl, device=spec.device)
                if self.r.display:
                    self.r.display.stage_started(stage)
        elif isinstance(event, Finished):
            if res is None:
                return
            res.status, res.ended = Status.DONE, time.time()
            res.items, res.digest, res.summary = event.items, event.digest, event.summary
            if res.digest:
                self.digests[stage] = res.digest
                spec = self.p.stages[stage]
                self.r.record.record(stage, {
                    "key": self.keys[stage], "digest": res.digest, "impl": spec.impl,
                    "version": spec.cls.version, "params": semantic_params(self.p, stage),
                    "upstream": {u: self.digests.get(u, "stream") for u in spec.after.values()},
                    "items": res.items, "finished": res.ended})
            self._notify_done(stage, Status.DONE)
        elif isinstance(event, Failed):
            if res is not None:
                res.status = Status.FAILED
            self.failures.append(event.failure)
            self.r._fire("dflash_pipe_on_stage_error", stage=stage, error=event.failure.error)
        elif isinstance(event, Stopped):
            if res is not None and res.status == Status.RUNNING:
                res.status = Status.STOPPED
        elif isinstance(event, Logged):
            logging.getLogger(event.logger).log(event.level, "%s", event.message)
        else:
            if event.get("type") == "checkpoint":
                self.r._fire("dflash_pipe_checkpoint_saved", stage=stage,
                             step=int(event.get("step", 0)), path=str(event.get("path", "")))
            self.r._fire("dflash_pipe_on_event", stage=stage, event=event)
            if self.r.display:
                self.r.display.event(stage, event)

    def _notify_done(self, stage: str, status: Status) -> None:
        res = self.results[stage]
        self.r._fire("dflash_pipe_after_stage", stage=stage, status=status, summary=res.summary)
        if self.r.display:
            self.r.display.stage_done(stage, status, res)

    def _check_workers(self) -> None:
        for stage, worker in self.workers.items():
            ended = (Status.DONE, Status.FAILED, Status.STOPPED)
            if worker.alive() or self.results[stage].status in ended:
                continue
            self._drain(0.2)  # its last events may still be in flight
            if self.results[stage].status not in ended:
                self.results[stage].status = Status.FAILED
                self.failures.append(
                    Failure(stage, f"died without finishing ({worker.exit_info()})"))

    def _shutdown(self) -> None:
        self._stop_all()
        raise RunFailed(root_cause(self.failures), self._log_failures())

    def _log_failures(self) -> str | None:
        try:
            return log_failures(self.p.run_dir, self.failures, self.r.rank)
        except Exception as exc:  # a run dir that cannot take it must not hide the failure itself
            logging.getLogger("dflash_pipe.runner").warning("failures not written to %s: %s: %s",
                                                            self.p.run_dir, type(exc).__name__, exc)
            return None

    def _stop_all(self) -> None:
        """Stop every worker still running: the stop flag, a grace period, then kill."""
        self._check_workers()  # a killed process is the cause, not its peer's PeerDied
        self.stop.set()
        deadline = time.time() + STOP_GRACE_S
        for worker in self.workers.values():
            worker.join(max(0.0, deadline - time.time()))
        for stage, worker in self.workers.items():
            if worker.alive():
                worker.kill()
                worker.join(1.0)
            if self.results[stage].status == Status.RUNNING:
                self.results[stage].status = Status.STOPPED
        self._drain(0.05)
        self._release_queues()

    def _reap(self) -> None:
        """After a successful run: let the workers exit (a process flushes its queues first)."""
        deadline = time.time() + STOP_GRACE_S
        for worker in self.workers.values():
            worker.join(max(0.0, deadline - time.time()))
        for worker in self.workers.values():
            if worker.alive():  # done, but stuck on its way out: it has nothing left to give
                worker.kill()
                worker.join(1.0)
        self._release_queues()

    def _release_queues(self) -> None:
        # a consumer process that died or stopped reading leaves our feeder thread blocked on
        # a full pipe, and interpreter exit would join it forever: drop what it still holds
        for ch in self.channels.values():
            cancel = getattr(ch.q, "cancel_join_thread", None)
            if cancel is not None:
                cancel()


def preload(classes: list[type]) -> None:
    """Import what the stages declared in ``preload``, here in the main thread, once."""
    import importlib

    for spec in sorted({m for cls in classes for m in cls.preload}):
        module, _, attr = spec.partition(":")
        loaded = importlib.import_module(module)
        if attr:
            getattr(loaded, attr)


def _replay(store: ArtifactStore, stage: str, key: str, outputs: list[Channel], stop: Any) -> None:
    open_ = list(outputs)
    for ch in open_:
        ch.stop_event = stop
    try:
        for item in store.items(stage, key):
            fan_out(item, open_)
            if not open_:
                return
        close_all(open_)
    except Exception:  # the consumer sees the stop flag; nothing to report twice
        pass

