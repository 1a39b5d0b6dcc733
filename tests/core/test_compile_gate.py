"""The compile gate: a call that may compile runs alone; warm calls run side by side."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch._dynamo.config as dynamo_config

from dflash_model.fast.compile_gate import CompileGate, compiled


def _traced_while(events: list[str], inside: threading.Event, release: threading.Event, gate=None):
    """Hold FX tracing open (the flag a lazy backward compile sets) until ``release``."""
    def body(y):
        inside.set()
        release.wait(30)
        return y + 1

    def run():
        if gate is None:
            torch.fx.symbolic_trace(body)
        else:
            with gate.call("train", 8192):
                torch.fx.symbolic_trace(body)
        events.append("traced")

    t = threading.Thread(target=run)
    t.start()
    assert inside.wait(30)
    return t


def _call(fn, events: list[str], gate=None) -> threading.Thread:
    def run():
        try:
            if gate is None:
                fn()
            else:
                with gate.call("extract", 8192):
                    fn()
            events.append("called")
        except RuntimeError as e:
            events.append(f"refused: {e}")

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.fixture
def torch_default_check():
    """torch's own setting (refuse a compiled call during a trace), put back after the test: the
    gate turns the refusal off for the whole process."""
    with dynamo_config.patch(error_on_nested_fx_trace=True):
        yield


def test_compiled_call_waits_for_a_call_that_may_compile(torch_default_check):
    f = torch.compile(lambda x: x * 2, backend="eager")
    x = torch.ones(3)
    f(x)

    # without the gate the hazard is real: the other thread's compiled call is refused
    events: list[str] = []
    inside, release = threading.Event(), threading.Event()
    tracer = _traced_while(events, inside, release)
    _call(lambda: f(x), events).join(30)
    release.set()
    tracer.join(30)
    assert len(events) == 2 and events[0].startswith("refused: Detected that you are using FX"), events

    gate = CompileGate()
    with gate.call("extract", 8192):  # the target's first row: cold, alone, then warm
        f(x)
    assert gate.is_warm("extract", 8192) and not gate.is_warm("extract", 4096)

    # with it, the warm call waits until the cold one is done, then runs
    events, inside, release = [], threading.Event(), threading.Event()
    tracer = _traced_while(events, inside, release, gate)
    caller = _call(lambda: f(x), events, gate)
    time.sleep(0.2)  # give the caller the chance to run early (it must not)
    release.set()
    tracer.join(30)
    caller.join(30)
    assert events == ["traced", "called"]
    assert gate.is_warm("train", 8192)


def test_a_call_waits_for_a_trace_the_gate_does_not_see(torch_default_check):
    """A compile outside the gate (evaluate's work beside training, say): a warm call starts once it
    is done."""
    f = torch.compile(lambda x: x * 2 + 1, backend="eager")
    x = torch.ones(3)
    gate = CompileGate()
    with gate.call("extract", 8192):
        assert f(x).tolist() == [3.0, 3.0, 3.0]
    events: list = []
    inside, release = threading.Event(), threading.Event()
    tracer = _traced_while(events, inside, release)  # no gate: it waits for nobody
    caller = _call(lambda: events.append(f(x).tolist()), events, gate)
    time.sleep(0.2)  # the caller's chance to start early (it must not)
    release.set()
    tracer.join(30)
    caller.join(30)
    assert events == ["traced", [3.0, 3.0, 3.0], "called"]


def test_a_call_running_when_a_trace_begins_runs_its_compiled_functions_plainly(torch_default_check):
    """Refusing it would fail the run, and running it again could add a backward's gradients twice."""
    f = torch.compile(lambda x: x * 2 + 1, backend="eager")
    x = torch.ones(3)
    gate = CompileGate()
    with gate.call("train", 8192):
        f(x)
    events: list = []
    inside, release = threading.Event(), threading.Event()
    with gate.call("train", 8192):  # warm, in flight
        tracer = _traced_while(events, inside, release)  # begins while the call runs
        events.append(f(x).tolist())
    release.set()
    tracer.join(30)
    assert events == [[3.0, 3.0, 3.0], "traced"]


def test_warm_calls_run_side_by_side_and_a_failed_cold_call_stays_cold():
    gate = CompileGate()
    for party in ("a", "b"):
        with gate.call(party):
            pass
    both_in = threading.Barrier(2, timeout=10)  # each waits inside its call for the other

    def warm(party: str) -> None:
        with gate.call(party):
            both_in.wait()

    threads = [threading.Thread(target=warm, args=(p,)) for p in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not both_in.broken

    with pytest.raises(ValueError):
        with gate.call("a", "new shape"):
            raise ValueError("compile failed")
    assert not gate.is_warm("a", "new shape")


def test_a_party_is_warm_for_any_key_after_the_recompile_limit():
    """Rows of many lengths: past the limit torch._dynamo compiles no more for them, so the
    calls go back to running side by side."""
    gate = CompileGate(cold_keys=3)
    for length in (8100, 8150, 8192):
        assert not gate.is_warm("train", length)
        with gate.call("train", length):
            pass
        assert gate.is_warm("train", length)
    assert gate.is_warm("train", 8000) and not gate.is_warm("extract", 8000)
    assert CompileGate().is_warm("x", 1) is False  # default limit: torch._dynamo.config.recompile_limit


def test_uncompiled_calls_pass_through_a_cold_call():
    """Stages without compiled code (the CPU default) neither wait nor are waited for."""
    gate = CompileGate()
    done = threading.Event()

    def uncompiled() -> None:
        with gate.call("extract", 100, compiled=False):
            done.set()

    with gate.call("train", 8192):  # cold: a gated call would wait for it to end
        t = threading.Thread(target=uncompiled)
        t.start()
        assert done.wait(10)
    t.join(10)
    assert not gate.is_warm("extract", 100)


def _counting_backend(runs: list[int]):
    """A torch.compile backend whose graphs note each run: a compiled function run as plain
    Python (dynamo's fallback during another thread's trace) leaves no note."""
    def backend(gm, example_inputs):
        def run(*args):
            runs.append(1)
            return gm(*args)
        return run
    return backend


def test_a_compiled_function_entered_during_a_trace_waits_for_it_and_runs_compiled():
    """A call in flight when another thread begins a trace pauses at its next compiled function
    until the trace is over: plain Python there could be a dense attention matrix."""
    runs: list[int] = []
    g = compiled(lambda x: x * 3, backend=_counting_backend(runs))
    x = torch.ones(2)
    gate = CompileGate()
    with gate.call("train", 8192):
        assert g(x).tolist() == [3.0, 3.0]
    assert runs == [1]
    events: list = []
    inside, release = threading.Event(), threading.Event()

    def in_flight() -> None:
        with gate.call("train", 8192):  # warm: started before the trace
            started.set()
            assert inside.wait(30)
            events.append(g(x).tolist())

    started = threading.Event()
    caller = threading.Thread(target=in_flight)
    caller.start()
    assert started.wait(30)
    tracer = _traced_while(events, inside, release)
    time.sleep(0.2)  # the caller's chance to enter g during the trace (it must wait)
    assert events == []
    release.set()
    tracer.join(30)
    caller.join(30)
    assert events == ["traced", [3.0, 3.0]]
    assert runs == [1, 1]  # the compiled graph ran, not the plain function


def test_a_compiled_function_in_its_own_threads_trace_does_not_wait():
    """Symbolic tracing through one of our compiled functions: the flag is this thread's own."""
    g = compiled(lambda x: x * 3, backend="eager")
    done: list = []

    def trace() -> None:
        with dynamo_config.patch(error_on_nested_fx_trace=False):
            done.append(torch.fx.symbolic_trace(lambda x: g(x) + 1))

    t = threading.Thread(target=trace)
    t.start()
    t.join(30)
    assert not t.is_alive() and len(done) == 1
    assert done[0](torch.ones(2)).tolist() == [4.0, 4.0]
