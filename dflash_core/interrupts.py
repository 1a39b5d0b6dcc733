"""SIGINT/SIGTERM during ``dflash-pipe run``: the first asks the run to save and stop, the
second aborts.

Schedulers send SIGTERM some time before they kill a preempted job, and a user's Ctrl-C is
seldom meant to lose the steps since the last checkpoint: the handler only records the signal
(the runner polls it, so nothing heavy runs inside a signal handler). A second signal raises
KeyboardInterrupt, for a user who will not wait for the save.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by ``signum``: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


@contextmanager
def graceful_signals(on_first: Callable[[int], None]) -> Iterator[None]:
    """While inside, the first SIGINT/SIGTERM calls ``on_first(signum)``, any later one raises
    KeyboardInterrupt; the previous handlers come back on exit. Signal handlers can only be
    set from the main thread: elsewhere (a run started in a worker thread) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    seen: list[int] = []

    def handler(signum: int, frame: object) -> None:
        seen.append(signum)
        if len(seen) > 1:
            raise KeyboardInterrupt
        on_first(signum)

    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
