"""Calls that may compile run alone when stages share a process.

On one GPU the target's forward (extract) and the drafter's step (train) run in threads of one
process, both through torch.compile'd code. Compiling sets process-wide flags: while the
drafter's first backward was compiled (lazily, inside ``backward()``), FX tracing was flagged and
the target's compiled forward in the other thread refused to run ("Detected that you are using
FX to symbolically trace a dynamo-optimized function"), failing the run at start-up.

So each stage makes its calls into compiled code inside ``GATE.call(party, key)``. A party's first
call with a given ``key`` (a new input shape: it may compile) waits for the calls in flight and
runs alone; every later call runs side by side with the others' as before, at the cost of one
lock round trip. A call that raised stays cold: its retry runs alone again.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager


class CompileGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._in_flight = 0  # warm calls running now
        self._alone = False  # a cold call is running
        self._warm: set[tuple[str, Hashable]] = set()

    def is_warm(self, party: str, key: Hashable = None) -> bool:
        return (party, key) in self._warm

    @contextmanager
    def call(self, party: str, key: Hashable = None) -> Iterator[None]:
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
        if cold:
            self._warm.add((party, key))


GATE = CompileGate()
"""The process's gate, shared by every stage running in it."""
