"""Stream links: bounded queues whose every wait times out, re-checks the run, and moves on.

A producer blocked on a full queue is backpressure; a consumer blocked on an empty one is
waiting for work. Neither may hang when the peer is gone, so each wait wakes up every
``poll`` seconds to check the run's stop flag and whether the peer is still alive.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator

END = "__dflash_pipe_end_of_stream__"
POLL_S = 0.2


class StopRun(Exception):
    """Raised inside a stage's waits when the run is stopping (another stage failed)."""


class PeerDied(RuntimeError):
    """The stage on the other end of a link died without closing it."""


class ConsumerClosed(Exception):
    """The consumer finished without reading the rest of the stream (e.g. it needed only N items)."""


class Channel:
    """One producer -> one consumer link over a bounded queue.

    ``make_queue`` gives a ``queue.Queue`` between threads and a spawn-context
    ``multiprocessing.Queue`` when either side is a process; both have the same API.
    """

    def __init__(self, producer: str, consumer: str, q: Any, bound: int,
                 closed: Any = None) -> None:
        self.producer = producer
        self.consumer = consumer
        self.q = q
        self.bound = bound
        self.closed = closed if closed is not None else threading.Event()
        """Set by the consumer when it will read no more (a spawn-context Event across processes)."""
        self.stop_event: Any = None
        self.producer_alive: Callable[[], bool] = lambda: True
        self.consumer_alive: Callable[[], bool] = lambda: True

    def __getstate__(self) -> dict[str, Any]:
        # liveness callables hold thread/process handles: the other process gets fresh ones
        state = self.__dict__.copy()
        state["producer_alive"] = state["consumer_alive"] = _always_alive
        return state

    def fill(self) -> int:
        """Items waiting in the queue (best effort; for the progress display)."""
        try:
            return int(self.q.qsize())
        except (NotImplementedError, OSError, ValueError):
            return 0

    def _check(self, peer: str, alive: Callable[[], bool]) -> None:
        if self.stop_event is not None and self.stop_event.is_set():
            raise StopRun()
        if not alive():
            raise PeerDied(f"stage '{peer}' died without finishing its stream "
                           f"{self.producer} -> {self.consumer}")

    def put(self, item: Any) -> None:
        """Block until there is room; raise ConsumerClosed once the consumer stopped reading."""
        while True:
            if self.closed.is_set():
                raise ConsumerClosed(f"{self.consumer} stopped reading {self.producer}")
            try:
                self.q.put(item, timeout=POLL_S)
                return
            except queue.Full:
                if not self.closed.is_set():  # a consumer that closed and ended did not die
                    self._check(self.consumer, self.consumer_alive)

    def close(self) -> None:
        """Signal end of stream (the consumer's iterator then stops)."""
        self.put(END)

    def __iter__(self) -> Iterator[Any]:
        while True:
            try:
                item = self.q.get(timeout=POLL_S)
            except queue.Empty:
                self._check(self.producer, self.producer_alive)
                continue
            if isinstance(item, str) and item == END:
                return
            yield item


def fan_out(item: Any, channels: list[Channel]) -> None:
    """Put ``item`` on every channel; drop (in place) those whose consumer stopped reading."""
    for ch in list(channels):
        try:
            ch.put(item)
        except ConsumerClosed:
            channels.remove(ch)


def close_all(channels: list[Channel]) -> None:
    """End every stream; a consumer that already stopped reading needs no end marker."""
    for ch in channels:
        try:
            ch.close()
        except ConsumerClosed:
            pass


def _always_alive() -> bool:
    return True
