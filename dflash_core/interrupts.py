"""SIGINT/SIGTERM during ``dflash-pipe run``: the first asks the run to save and stop, the
second aborts. Outside a run (loading plugins, the other commands) a signal ends the command at
once, with its message and exit status.

Schedulers send SIGTERM some time before they kill a preempted job, and a user's Ctrl-C is
seldom meant to lose the steps since the last checkpoint: the handler only records the signal
(the runner polls it, so nothing heavy runs inside a signal handler). A second signal raises
KeyboardInterrupt (:class:`Stopped`), for a user who will not wait for the save.
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from typing import Callable, ContextManager, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
REDELIVER_S = 0.05
"""Delay before a signal whose exception Python dropped is sent again (``_handling``)."""


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by ``signum``: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


class Stopped(KeyboardInterrupt):
    """A SIGINT/SIGTERM that ends the command at once; ``signum`` gives its exit status."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_on_signals(received: list[int]) -> ContextManager[None]:
    """While inside, SIGINT and SIGTERM raise :class:`Stopped`: a command ends with its message and
    128 + the signal, where SIGTERM's default action would kill it without a word.

    Each signal is also appended to ``received``: native code that calls back into Python (torch
    reading a sequence into a tensor while weights load) can swallow :class:`Stopped` and raise an
    error of its own, and the command must still end as stopped, not as that error."""

    def handler(signum: int, frame: object) -> None:
        received.append(signum)
        raise Stopped(signum)

    return _handling(handler)


def graceful_signals(on_first: Callable[[int], None]) -> ContextManager[None]:
    """While inside, the first SIGINT/SIGTERM calls ``on_first(signum)``, any later one raises
    :class:`Stopped`."""
    seen: list[int] = []

    def handler(signum: int, frame: object) -> None:
        seen.append(signum)
        if len(seen) > 1:
            raise Stopped(signum)
        on_first(signum)

    return _handling(handler)


@contextmanager
def _handling(handler: Callable[[int, object], None]) -> Iterator[None]:
    """``handler`` for SIGINT and SIGTERM while inside; the previous handlers come back on exit.
    Signal handlers can only be set from the main thread: elsewhere (a run started in a worker
    thread) nothing changes.

    A handler runs wherever the main thread is, a weakref callback or a ``__del__`` included, and
    Python drops what those raise (it reports it to ``sys.unraisablehook``): a :class:`Stopped`
    raised there would be lost and the command would go on. While inside, such a :class:`Stopped`
    is sent again as its signal, a moment later and from another thread, so that the handler runs
    again once the main thread has left the place that dropped it (again, if need be)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    previous_hook = sys.unraisablehook
    inside = threading.Event()
    inside.set()

    def send_again(signum: int) -> None:
        if inside.is_set():  # not once the previous handlers are back: they may be the default action
            signal.raise_signal(signum)

    def redeliver(unraisable: "sys.UnraisableHookArgs") -> None:
        if isinstance(unraisable.exc_value, Stopped):
            timer = threading.Timer(REDELIVER_S, send_again, (unraisable.exc_value.signum,))
            timer.daemon = True
            timer.start()
        else:
            previous_hook(unraisable)

    sys.unraisablehook = redeliver
    try:
        yield
    finally:
        inside.clear()
        sys.unraisablehook = previous_hook
        for s, h in previous.items():
            signal.signal(s, h)
