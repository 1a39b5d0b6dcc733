"""Stream links between torchrun ranks: N producer ranks fan in to M consumer ranks.

When a pipeline places two linked stages on different ranks (``ranks:`` in the pipeline file),
the producer's items leave through a sender thread and arrive through a receiver thread, each
backed by an ordinary bounded :class:`~dflash_core.links.Channel` on its side. The threads make
the transfer overlap with the work on both ends: the target computes the next row while the
sender ships the last one, and the drafter trains on row i while row i+1 arrives.

Wire format per item over torch.distributed point-to-point (one process group per rank pair, so
pairs never wait on each other): the item with every tensor replaced by a placeholder, pickled,
as a uint8 tensor (preceded by its length; -1 ends the stream), then each tensor. A CUDA tensor
bound for a CUDA consumer goes GPU to GPU (NCCL); anything else goes through host memory (gloo).
Producer ``i`` of N sends to consumer ``i mod M``; a consumer reads its producers round robin,
which restores the order of rows dealt out rank by rank (row r to producer r mod N).
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from dflash_core.devices import use_device
from dflash_core.links import Channel, ConsumerClosed, StopRun

_GROUPS: dict[tuple[int, ...], Any] = {}
log = logging.getLogger("dflash_pipe.remote")


def make_groups(rank_sets: list[tuple[int, ...]]) -> None:
    """Create a process group per rank set, in one order on every rank (torch requires that
    every rank calls ``new_group`` for every group, members or not)."""
    import torch.distributed as dist

    for ranks in sorted(set(rank_sets)):
        if ranks not in _GROUPS:
            _GROUPS[ranks] = dist.new_group(list(ranks))


def group(ranks: tuple[int, ...] | None) -> Any:
    """The process group of ``ranks`` made by :func:`make_groups`; None (the default group) for
    None or every rank."""
    import torch.distributed as dist

    if ranks is None or tuple(ranks) == tuple(range(dist.get_world_size())):
        return None
    if ranks not in _GROUPS:
        raise KeyError(f"no process group for ranks {list(ranks)} (make_groups was not called)")
    return _GROUPS[ranks]


def pair(a: int, b: int) -> tuple[int, int]:
    """The rank set of the process group that links ranks ``a`` and ``b`` (either order)."""
    return (min(a, b), max(a, b))


def route(producers: tuple[int, ...], consumers: tuple[int, ...]) -> dict[int, list[int]]:
    """consumer rank -> its producer ranks (producer i of N -> consumer i mod M)."""
    out: dict[int, list[int]] = {c: [] for c in consumers}
    for i, p in enumerate(producers):
        out[consumers[i % len(consumers)]].append(p)
    return out


@dataclass
class _Slot:
    """A tensor's place in an encoded item."""

    index: int
    shape: tuple[int, ...]
    dtype: Any
    cuda: bool


def _map(x: Any, fn: Any) -> Any:
    """``x`` with every leaf replaced by ``fn(leaf)``, through dicts, lists and tuples: the one
    walk of an item's structure that encode, decode and slots share."""
    if isinstance(x, dict):
        return {k: _map(v, fn) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_map(v, fn) for v in x)
    return fn(x)


def encode(item: Any, cuda_ok: bool) -> tuple[bytes, list[Any]]:
    """(pickled item with tensors as _Slot placeholders, the tensors in slot order). Tensors go by
    NCCL (stay on the GPU) only when both ends are CUDA (``cuda_ok``), else through the host."""
    import torch

    tensors: list[Any] = []
    seen: dict[int, _Slot] = {}  # one tensor referenced twice (a tied LM head) is sent once

    def strip(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in seen:
            t = x.detach()
            t = t if (t.is_cuda and cuda_ok) else t.cpu()
            tensors.append(t.contiguous())
            seen[id(x)] = _Slot(len(tensors) - 1, tuple(t.shape), t.dtype, t.is_cuda)
        return seen[id(x)]

    return pickle.dumps(_map(item, strip), protocol=pickle.HIGHEST_PROTOCOL), tensors


def decode(structure: Any, tensors: list[Any]) -> Any:
    """Inverse of :func:`encode`, given the unpickled item and its tensors in slot order."""
    return _map(structure, lambda x: tensors[x.index] if isinstance(x, _Slot) else x)


def slots(structure: Any) -> list[_Slot]:
    """The tensor placeholders of an unpickled item, in slot order."""
    found: dict[int, _Slot] = {}
    _map(structure, lambda x: found.setdefault(x.index, x) if isinstance(x, _Slot) else x)
    return [found[i] for i in sorted(found)]


def send_stream(channel: Channel, dst: int, pair: Any, cuda_ok: bool) -> None:
    """Sender thread: every item of ``channel`` to rank ``dst``, then the end marker."""
    import torch
    import torch.distributed as dist

    for item in channel:
        blob, tensors = encode(item, cuda_ok)
        dist.send(torch.tensor([len(blob)], dtype=torch.int64), dst, group=pair)
        dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst, group=pair)
        for t in tensors:
            dist.send(t, dst, group=pair)
    dist.send(torch.tensor([-1], dtype=torch.int64), dst, group=pair)


def receive_stream(sources: list[tuple[int, Any]], channel: Channel, device: str) -> None:
    """Receiver thread: items from ``sources`` [(rank, pair group)] round robin into ``channel``
    until every source has ended; CUDA tensors land on ``device``."""
    import torch
    import torch.distributed as dist

    live = list(sources)
    stream = None
    if device.startswith("cuda"):
        # receive on a stream of our own: waiting on the device's current stream would also wait
        # for the drafter's step queued there, holding the row back and inflating the transfer time
        stream = torch.cuda.Stream(use_device(device))
    stats: dict[str, TransferStats] = {}  # by the items' "kind" (a target header is not a row)
    try:
        while live:
            for src, pair in list(live):
                size = torch.empty(1, dtype=torch.int64)
                dist.recv(size, src, group=pair)
                n = int(size.item())
                if n < 0:
                    live.remove((src, pair))
                    continue
                raw = torch.empty(n, dtype=torch.uint8)
                dist.recv(raw, src, group=pair)
                structure = pickle.loads(raw.numpy().tobytes())
                # the sender follows the header with the tensors at once: from here until they
                # have landed is the transfer itself, not the wait for the producer's next item
                started = time.perf_counter()
                tensors = []
                with torch.cuda.stream(stream) if stream is not None else nullcontext():
                    for slot in slots(structure):
                        t = torch.empty(slot.shape, dtype=slot.dtype, device=device if slot.cuda else "cpu")
                        dist.recv(t, src, group=pair)
                        tensors.append(t)
                if stream is not None and any(t.is_cuda for t in tensors):
                    stream.synchronize()  # landed: the consumer reads them on its own stream
                kind = structure.get("kind", "item") if isinstance(structure, dict) else "item"
                stats.setdefault(str(kind), TransferStats()).add(
                    sum(t.numel() * t.element_size() for t in tensors), time.perf_counter() - started)
                channel.put(decode(structure, tensors))
        channel.close()
    except (ConsumerClosed, StopRun):
        pass
    for kind, kind_stats in stats.items():
        log.info("received %d %s items from ranks %s: %s", kind_stats.items, kind, [src for src, _ in sources],
                 kind_stats)


@dataclass
class TransferStats:
    """Bytes and seconds of the tensors of the items a receiver took in (the transfer time per row
    that a layout must hide behind the target's forward)."""

    items: int = 0
    nbytes: int = 0
    seconds: float = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        self.items += 1
        self.nbytes += nbytes
        self.seconds += seconds

    def __str__(self) -> str:
        per_item = self.seconds / self.items
        rate = self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")
        return (f"{self.nbytes / self.items / 1e6:.4g} MB of tensors each, {per_item * 1e3:.2f} ms per item "
                f"({rate:.3g} GB/s)")


def start_thread(target: Any, *args: Any, name: str) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    thread.start()
    return thread
