"""Calls that may compile run alone when stages share a process.

On one GPU the target's forward (extract) and the drafter's step (train) run in threads of one
process, both through torch.compile'd code. Compiling sets process-wide flags: while the
drafter's first backward was compiled (lazily, inside ``backward()``), FX tracing was flagged and
the target's compiled forward in the other thread refused to run ("Detected that you are using
FX to symbolically trace a dynamo-optimized function"), failing the run at start-up.

So each stage makes its calls inside ``GATE.call(party, key, compiled)``, ``key`` being the input
shape that may change (the row length), and calls that compile graphs of their own a party of their
own (the trainer's no-grad validation of a row, beside its training step); a stage that runs no
compiled code (``compiled`` False, the CPU default) passes straight through. A call with a key its party has not
completed yet may compile: it waits for the calls in flight and runs alone. Every other call runs
side by side with the others', as before, at the cost of one lock round trip. Rows of many
lengths would make every call a new key, so a party's calls stop being held alone once it has
completed as many keys as torch._dynamo recompiles a function at most (``recompile_limit``, 8):
by then each compiled function has gone shape-dynamic or stopped compiling. A call that raised
does not count as completed.

The gate sees only the calls made through it. A compile it does not see (evaluate's work at a
checkpoint beside training, a library's own torch.compile) sets the same flag. So a gated call
waits to start while any thread traces, and so does each entry into a function compiled through
:func:`compiled` (all of ours are): a call already running when a trace begins pauses at its next
compiled function until the trace is over. Run as plain Python instead, as torch would, such a
function could cost far more than its compiled graph: flex attention falls back to a dense matrix
of every query's score against every key (tens of GB at a drafter step's shape), an FP8 quantizer
to float32 copies of its operand. A thread never waits for a trace of its own (its stack runs inside it). For the moment
between that check and the function's own, dynamo runs what it enters as plain Python rather than
refusing (``error_on_nested_fx_trace`` off, for the process): running the call again instead would
be wrong where the refusal came in its backward, after some of its gradients were added.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def _recompile_limit() -> int:
    """How many graphs torch._dynamo compiles for one function before it stops (8 by default)."""
    import torch._dynamo.config as config

    return int(getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", 8))


class CompileGate:
    def __init__(self, cold_keys: int | None = None) -> None:
        self._cold_keys = cold_keys  # None: torch._dynamo's recompile limit, read at first use
        self._cond = threading.Condition()
        self._in_flight = 0  # warm calls running now
        self._alone = False  # a cold call is running
        self._done: dict[str, set[Hashable]] = {}  # keys each party has completed

    def is_warm(self, party: str, key: Hashable = None) -> bool:
        """Whether a call of ``party`` with ``key`` can run beside others (it will not compile)."""
        if self._cold_keys is None:
            self._cold_keys = _recompile_limit()
        done = self._done.get(party, set())
        return key in done or len(done) >= self._cold_keys

    @contextmanager
    def call(self, party: str, key: Hashable = None, compiled: bool = True) -> Iterator[None]:
        if not compiled:
            yield
            return
        _tolerate_traces()
        _wait_for_traces()
        cold = not self.is_warm(party, key)
        with self._cond:
            if cold:
                self._cond.wait_for(lambda: not self._alone and self._in_flight == 0)
                self._alone = True
            else:
                self._cond.wait_for(lambda: not self._alone)
                self._in_flight += 1
        try:
            yield
        finally:
            with self._cond:
                if cold:
                    self._alone = False
                else:
                    self._in_flight -= 1
                self._cond.notify_all()
        self._done.setdefault(party, set()).add(key)


def _tracing() -> bool:
    """Whether some thread of the process is FX tracing now (torch keeps one flag for all)."""
    from torch.fx._symbolic_trace import is_fx_symbolic_tracing

    return is_fx_symbolic_tracing()


def _tracing_here() -> bool:
    """Whether this thread's own stack is inside an FX trace: waiting for it would never end."""
    from torch.fx._symbolic_trace import Tracer

    code = Tracer.trace.__code__  # the only place torch sets the flag
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _wait_for_traces(poll_s: float = 0.01) -> None:
    while _tracing() and not _tracing_here():
        time.sleep(poll_s)


def compiled(fn: F, **options: Any) -> F:
    """``torch.compile(fn, **options)``, entered only while no other thread traces (module
    docstring). Inside a compiled region, where dynamo inlines it, it is the compiled function."""
    import torch
    from torch.fx._symbolic_trace import is_fx_symbolic_tracing

    inner = torch.compile(fn, **options)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling() and is_fx_symbolic_tracing():  # one flag read a call
            _wait_for_traces()
        return inner(*args, **kwargs)

    return call  # type: ignore[return-value]


def _tolerate_traces() -> None:
    """A compiled function entered while another thread traces runs as plain Python, not refused."""
    import torch._dynamo.config as config

    config.error_on_nested_fx_trace = False


GATE = CompileGate()
"""The process's gate, shared by every stage running in it."""
