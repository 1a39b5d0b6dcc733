"""Stream links and executors: backpressure, failure propagation, dead processes, executor mixes.

All stages are the small CPU stages of ``tests/core/engine_stages.py``; nothing is mocked:
threads, spawned processes and queues are the runner's own.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest

from dflash_core import hookimpl
from dflash_core.artifacts import ArtifactStore
from dflash_core.pipeline_file import load_pipeline
from dflash_core.plugins import PluginManager
from dflash_core.runner import Runner, RunFailed
from tests.conftest import STAGES
from tests.core import engine_stages

# The issue asks that a failure stops every other stage "within a second". Measured here it is
# ~0.3 s with thread stages (stream waits poll every 0.2 s) and ~0.5 s when a stage is a
# process (its interpreter has to exit too). The asserted bounds are generous so that a loaded
# 2-core CI machine does not make the test flaky: 3 s, and 2 s more for process teardown.
STOP_BOUND_S = 3.0
PROCESS_EXTRA_S = 2.0


def _pm() -> PluginManager:
    return PluginManager(autoload=False, extra_plugins=[STAGES])


def _run(path: Path, **kw) -> dict:
    pm = _pm()
    return Runner(load_pipeline(path, pm), pm, **kw).run()


def _stage_threads_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("stage-") and t.is_alive()]


# ------------------------------------------------------------------------- backpressure
def test_slow_consumer_bounds_what_the_producer_has_in_flight(write_pipeline):
    """With a slow consumer, yielded - consumed never exceeds the queue bound + 2.

    The +2, from the code: when the producer counts item k as yielded, items < k have all been
    put (``drive`` puts an item before it asks the generator for the next one), so yielded -
    consumed = (items in the queue <= bound) + (item k, counted but not yet put) + (an item
    the consumer took off the queue but has not counted yet, at most one: it counts right after
    ``q.get``). The item the consumer is busy with was counted when received.
    """
    bound, n = 4, 60
    trace = engine_stages.trace_reset("backpressure")
    path = write_pipeline("""
        stages:
          src:  {uses: numbers, params: {n: 60, trace: backpressure}}
          sink: {uses: collect, after: src, link: stream, params: {delay: 0.005, trace: backpressure}}
    """)
    results = _run(path, queue_bound=bound)
    assert results["sink"].status == "done" and results["sink"].items == n
    assert trace["yielded"] == n and trace["consumed"] == n
    assert trace["max_in_flight"] <= bound + 2, trace
    # and the bound was actually reached: the producer ran ahead until the queue was full
    assert trace["max_in_flight"] >= bound, trace


# ------------------------------------------------------------------- failure propagation
@pytest.mark.parametrize("src_executor,scale_executor", [
    ("thread", "thread"), ("process", "thread"), ("thread", "process")])
def test_exception_names_the_stage_and_stops_the_others_quickly(write_pipeline, tmp_path,
                                                                 src_executor, scale_executor):
    """scale raises on its 20th item; the source (endless, never checks should_stop) and the
    sink are stopped, and run() returns promptly with RunFailed naming 'scale'."""
    path = write_pipeline(f"""
        stages:
          src:   {{uses: numbers, executor: {src_executor}, params: {{forever: true, delay: 0.001}}}}
          scale: {{uses: scale, after: src, link: stream, executor: {scale_executor},
                   params: {{fail_at: 20}}}}
          sink:  {{uses: collect, after: scale, link: stream}}
    """)
    pm = _pm()
    runner = Runner(load_pipeline(path, pm), pm)
    with pytest.raises(RunFailed) as info:
        runner.run()
    returned = time.time()
    raised = float((tmp_path / "run" / "raised_at").read_text())
    assert info.value.stage == "scale"
    assert "ValueError: scale refuses item 20" in info.value.message
    assert "scale refuses item 20" in info.value.tb  # the stage's traceback is kept
    bound = STOP_BOUND_S + (PROCESS_EXTRA_S if "process" in (src_executor, scale_executor)
                            else 0.0)
    assert returned - raised < bound, f"took {returned - raised:.2f}s to stop"
    # every other stage really stopped: no stage thread or stage process is left running
    assert _stage_threads_alive() == []
    assert multiprocessing.active_children() == []


def test_sigkilled_process_stage_fails_the_run_and_is_named(write_pipeline, tmp_path):
    """A process stage that dies by SIGKILL mid-stream (no exception, no event) makes the run
    fail within seconds, naming that stage, instead of hanging its peers."""
    path = write_pipeline("""
        stages:
          src:   {uses: numbers, params: {forever: true, delay: 0.001}}
          scale: {uses: scale, after: src, link: stream, executor: process, params: {kill_at: 5}}
          sink:  {uses: collect, after: scale, link: stream}
    """)
    pm = _pm()
    runner = Runner(load_pipeline(path, pm), pm)
    with pytest.raises(RunFailed) as info:
        runner.run()
    returned = time.time()
    killed = float((tmp_path / "run" / "killed_at").read_text())
    assert info.value.stage == "scale"  # the dead one, not a peer that saw it die
    assert "SIGKILL" in info.value.message
    assert returned - killed < STOP_BOUND_S + PROCESS_EXTRA_S, f"took {returned - killed:.2f}s"
    assert _stage_threads_alive() == []
    assert multiprocessing.active_children() == []


# -------------------------------------------------------------- consumers that stop early
@pytest.mark.parametrize("src_executor", ["thread", "inline", "process"])
def test_a_consumer_that_stops_early_ends_its_producers_not_the_run(write_pipeline,
                                                                    src_executor):
    """sink needs only 3 of 1000 items. Its producers must end (status done) instead of
    blocking on a full queue, being taken for crashed, or (inline) never reporting done."""
    path = write_pipeline(f"""
        stages:
          src:   {{uses: numbers, executor: {src_executor}, params: {{n: 1000}}}}
          scale: {{uses: scale, after: src, link: stream, executor: inline}}
          sink:  {{uses: collect, after: scale, link: stream, params: {{take: 3}}}}
    """)
    start = time.time()
    results = _run(path, queue_bound=4)
    assert time.time() - start < 30
    assert {s: r.status for s, r in results.items()} == dict.fromkeys(("src", "scale", "sink"), "done")
    assert results["sink"].items == 3 and results["scale"].items == 3
    store = ArtifactStore(str(path.parent / "run"))
    assert list(store.items("sink", results["sink"].key)) == [{"i": k, "v": 2 * k} for k in range(3)]
    if src_executor == "inline":
        assert results["src"].items == 3  # pulled item by item by its consumer
    else:  # it ran ahead by at most the queue (4) + the item it was putting
        assert 3 <= results["src"].items <= 3 + 4 + 2
    assert _stage_threads_alive() == [] and multiprocessing.active_children() == []


def test_a_consumer_that_reads_nothing_ends_its_inline_upstreams(write_pipeline):
    path = write_pipeline("""
        stages:
          src:   {uses: numbers, executor: inline, params: {n: 10}}
          scale: {uses: scale, after: src, link: stream, executor: inline}
          sink:  {uses: collect, after: scale, link: stream, params: {take: 0}}
    """)
    results = _run(path)
    assert {s: (r.status, r.items) for s, r in results.items()} == dict.fromkeys(
        ("src", "scale", "sink"), ("done", 0))


# ---------------------------------------------------------------------- executor mixes
EXPECTED = [{"i": k, "v": 3 * (10 + k)} for k in range(25)]


@pytest.mark.parametrize("executors", [
    ("thread", "thread", "thread"),
    ("inline", "inline", "thread"),      # src and scale both fused into the sink's thread
    ("thread", "process", "thread"),
    ("process", "inline", "process"),    # inline before a process consumer: falls back to a thread
], ids="-".join)
def test_executor_mixes_give_the_same_items(write_pipeline, executors):
    src_ex, scale_ex, sink_ex = executors
    path = write_pipeline(f"""
        stages:
          src:   {{uses: numbers, executor: {src_ex}, params: {{n: 25, start: 10}}}}
          scale: {{uses: scale, after: src, link: stream, executor: {scale_ex}, params: {{factor: 3}}}}
          sink:  {{uses: collect, after: scale, link: stream, executor: {sink_ex}}}
    """)
    results = _run(path)
    assert {s: r.status for s, r in results.items()} == dict.fromkeys(("src", "scale", "sink"), "done")
    store = ArtifactStore(str(path.parent / "run"))
    assert list(store.items("sink", results["sink"].key)) == EXPECTED
    assert [results[s].items for s in ("src", "scale", "sink")] == [25, 25, 25]

    where = {s: (results[s].summary["pid"], results[s].summary["thread"]) for s in results}
    for stage, executor in zip(("src", "scale", "sink"), executors):
        pid, thread = where[stage]
        if executor == "process":
            assert pid != os.getpid(), stage
        elif executor == "thread":
            assert (pid, thread) == (os.getpid(), f"stage-{stage}"), stage
    if executors == ("inline", "inline", "thread"):
        assert where["src"] == where["scale"] == (os.getpid(), "stage-sink")
    if executors == ("process", "inline", "process"):
        assert where["scale"] == (os.getpid(), "stage-scale")


class SlowBeforeStage:
    """A hook plugin that holds the runner in ``before_stage`` for ``stage``, as a slow hook or a
    busy machine does between a worker's creation and its start."""

    def __init__(self, stage: str, seconds: float) -> None:
        self.stage, self.seconds = stage, seconds

    @hookimpl
    def dflash_pipe_before_stage(self, stage: str, kind: str, impl: str, device: str) -> None:
        if stage == self.stage:
            time.sleep(self.seconds)


def test_a_stream_consumer_waiting_on_a_stage_about_to_start_does_not_take_it_for_dead(write_pipeline):
    """sink streams from mid, so it starts at once and waits; mid starts only once src is
    materialized. While the runner is still between mid's creation and its start (here held
    for a second, five of the consumer's polls), mid is not dead: the run ends with every item."""
    path = write_pipeline("""
        stages:
          src:  {uses: numbers, params: {n: 5}}
          mid:  {uses: scale, after: src}
          sink: {uses: collect, after: mid, link: stream}
    """)
    pm = _pm()
    pm.add_plugin(SlowBeforeStage("mid", 1.0), "slow_before_stage")
    results = Runner(load_pipeline(path, pm), pm).run()
    assert {s: r.status for s, r in results.items()} == dict.fromkeys(("src", "mid", "sink"), "done")
    store = ArtifactStore(str(path.parent / "run"))
    assert list(store.items("sink", results["sink"].key)) == [{"i": k, "v": 2 * k} for k in range(5)]
