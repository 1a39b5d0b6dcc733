"""Best-fit-decreasing packing of tokenized samples into rows, with a resumable cursor.

Pure numpy (no torch). The samples are read through :class:`dflash_core.samples.SampleIndex`
(lengths up front, tokens on demand). Two parts:

- :func:`order_epoch` — the epoch's rows as sample ids, from lengths alone: a permutation seeded by
  (seed, epoch); consecutive windows of ``shuffle_window`` samples; inside a window, samples by
  length descending each go to the open row with the least room that still fits them (else a new
  row); the window's rows are then shuffled (seeded by seed, epoch, window) and closed.
- :class:`BestFitPacker` — iterates this rank's rows across epochs; ``state_dict()`` /
  ``load_state_dict()`` (``{"epoch", "position"}``) resume at the exact next row.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from dflash_core.rows import packed_row
from dflash_core.samples import SampleError, SampleIndex

__all__ = ["PackError", "SampleIndex", "EpochOrder", "order_epoch", "BestFitPacker"]


class PackError(SampleError):
    """A packing problem with a one-line message (sample too long, bad state)."""


# ---------------------------------------------------------------------------------------------
# The epoch's order of rows (lengths only)
# ---------------------------------------------------------------------------------------------


@dataclass
class EpochOrder:
    """Which samples make up each row of one epoch, rows in the order they are served."""

    samples: np.ndarray       # int64 [M]: sample ids, row after row
    row_offsets: np.ndarray   # int64 [R+1]: row g = samples[row_offsets[g]:row_offsets[g+1]]
    window_rows: np.ndarray   # int64 [W+1]: rows of window w = [window_rows[w], window_rows[w+1])

    @property
    def num_rows(self) -> int:
        return len(self.row_offsets) - 1

    def row(self, g: int) -> np.ndarray:
        return self.samples[self.row_offsets[g]:self.row_offsets[g + 1]]


def _best_fit(order: np.ndarray, lengths: np.ndarray, cap: int) -> list[list[int]]:
    """Best-fit decreasing: each sample (already sorted) into the fullest open row it fits."""
    rows: list[list[int]] = []
    rems: list[int] = []   # sorted remaining room of the open rows …
    rids: list[int] = []   # … and which row each is
    for sid, n in zip(order.tolist(), lengths[order].tolist()):
        i = bisect_left(rems, n)
        if i == len(rems):
            r, room = len(rows), cap - n
            rows.append([sid])
        else:
            r, room = rids.pop(i), rems.pop(i) - n
            rows[r].append(sid)
        if room > 0:
            j = bisect_left(rems, room)
            rems.insert(j, room)
            rids.insert(j, r)
    return rows


def order_epoch(lengths: np.ndarray, tokens_per_row: int, shuffle_window: int, seed: int,
                epoch: int) -> EpochOrder:
    """The rows of ``epoch`` as sample ids (the module docstring says how); the same on every rank."""
    n = len(lengths)
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    samples: list[np.ndarray] = []
    sizes: list[int] = []
    window_rows = [0]
    for w, start in enumerate(range(0, n, shuffle_window)):
        win = perm[start:start + shuffle_window]
        win = win[np.argsort(-lengths[win].astype(np.int64), kind="stable")]
        rows = _best_fit(win, lengths, tokens_per_row)
        for k in np.random.default_rng([seed, epoch, 1, w]).permutation(len(rows)).tolist():
            samples.append(np.asarray(rows[k], np.int64))
            sizes.append(len(rows[k]))
        window_rows.append(window_rows[-1] + len(rows))
    offsets = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return EpochOrder(np.concatenate(samples) if samples else np.zeros(0, np.int64), offsets,
                     np.asarray(window_rows, np.int64))


# ---------------------------------------------------------------------------------------------
# The resumable packer
# ---------------------------------------------------------------------------------------------


class BestFitPacker:
    """Iterator over this rank's packed rows, epoch after epoch (torchdata.nodes-style state).

    Rank ``r`` of ``W`` takes the epoch's rows ``r, r+W, r+2W, …``. Every rank yields the same
    number of rows per epoch: ``floor(R/W)`` with ``drop_last`` (the last ``R mod W`` rows are not
    used), else ``ceil(R/W)``, the missing tail rows repeating the epoch's first rows.
    """

    def __init__(self, index: SampleIndex, *, tokens_per_row: int, shuffle_window: int = 10000,
                 seed: int = 0, epochs: int = 1, rank: int = 0, world_size: int = 1,
                 drop_last: bool = False, pad_to: int = 0, pad_token_id: int = 0) -> None:
        if not 0 <= rank < world_size:
            raise PackError(f"rank {rank} is not in [0, world_size={world_size})")
        self.index = index
        self.tokens_per_row = tokens_per_row
        self.shuffle_window = max(1, shuffle_window)
        self.seed, self.epochs = seed, epochs
        self.rank, self.world_size = rank, world_size
        self.drop_last, self.pad_to, self.pad_token_id = drop_last, pad_to, pad_token_id
        too_long = index.lengths > tokens_per_row
        if too_long.any():
            raise PackError(f"{int(too_long.sum())} samples are longer than tokens_per_row="
                            f"{tokens_per_row} (longest {int(index.lengths.max())} tokens); "
                            "set tokenize max_len <= tokens_per_row or raise tokens_per_row")
        self._orders: OrderedDict[int, EpochOrder] = OrderedDict()
        self._chunk: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._chunk_key: tuple[int, int, int] | None = None  # (epoch, first k, end k)
        self.reset()

    # -- state ------------------------------------------------------------------------------------
    def reset(self, initial_state: dict | None = None) -> None:
        self.epoch, self.position = 0, 0
        self._chunk, self._chunk_key = {}, None
        if initial_state is not None:
            self.load_state_dict(initial_state)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        try:
            epoch, position = int(state["epoch"]), int(state["position"])
        except (KeyError, TypeError, ValueError):
            raise PackError(f"bad pack state {state!r}: want {{'epoch': int, 'position': int}}") from None
        if epoch < 0 or position < 0:
            raise PackError(f"bad pack state {state!r}: negative epoch/position")
        self.epoch, self.position = epoch, position
        self._chunk, self._chunk_key = {}, None
        self._normalize()

    # -- the epoch's order ------------------------------------------------------------------------
    def order(self, epoch: int) -> EpochOrder:
        """``order_epoch`` for ``epoch``, kept for this epoch and the one before."""
        if epoch not in self._orders:
            self._orders[epoch] = order_epoch(self.index.lengths, self.tokens_per_row,
                                              self.shuffle_window, self.seed, epoch)
            while len(self._orders) > 2:
                self._orders.popitem(last=False)
        return self._orders[epoch]

    def rows_in_epoch(self, epoch: int) -> int:
        """Rows this rank yields in ``epoch`` (the same for every rank)."""
        total = self.order(epoch).num_rows
        return total // self.world_size if self.drop_last else -(-total // self.world_size)

    def global_row(self, epoch: int, k: int) -> int:
        total = self.order(epoch).num_rows
        g = k * self.world_size + self.rank
        return g if g < total else g % total

    def _normalize(self) -> None:
        while self.epoch < self.epochs and self.position >= self.rows_in_epoch(self.epoch):
            self.position -= self.rows_in_epoch(self.epoch)
            self.epoch += 1
            self._chunk, self._chunk_key = {}, None

    # -- iteration --------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        self._normalize()
        if self.epoch >= self.epochs:
            raise StopIteration
        epoch, k = self.epoch, self.position
        order = self.order(epoch)
        if self._chunk_key is None or not (self._chunk_key[0] == epoch
                                           and self._chunk_key[1] <= k < self._chunk_key[2]):
            self._materialize(epoch, k)
        g = self.global_row(epoch, k)
        sids = order.row(g)
        parts = [self._chunk[int(s)] for s in sids]
        lens = np.array([len(p[0]) for p in parts], np.int64)
        n = int(lens.sum())
        pad = (-n) % self.pad_to if self.pad_to else 0
        ids = np.concatenate([p[0] for p in parts] + [np.full(pad, self.pad_token_id, np.int64)])
        mask = np.concatenate([p[1] for p in parts] + [np.zeros(pad, np.bool_)])
        doc_lengths = np.concatenate([lens, [pad]]) if pad else lens
        starts = np.concatenate([[0], np.cumsum(doc_lengths)[:-1]])
        position_ids = np.arange(n + pad, dtype=np.int64) - np.repeat(starts, doc_lengths)
        self.position += 1
        self._normalize()
        return packed_row(ids, mask, position_ids, doc_lengths, num_tokens=n, num_pad=pad,
                          samples=sids.copy(), epoch=epoch, index=k, global_index=g,
                          state=self.state_dict())

    def _materialize(self, epoch: int, k0: int) -> None:
        """Load the tokens of this rank's rows from ``k0`` to the end of ``k0``'s window."""
        order = self.order(epoch)
        n_rows = self.rows_in_epoch(epoch)
        ks = np.arange(k0, n_rows, dtype=np.int64)
        gs = ks * self.world_size + self.rank
        gs = np.where(gs < order.num_rows, gs, gs % max(order.num_rows, 1))
        win = np.searchsorted(order.window_rows, gs, side="right") - 1
        same = (win == win[0]) & (np.concatenate([[True], np.diff(gs) > 0]).cumprod() > 0)
        end = int(np.argmin(same)) if not same.all() else len(same)
        sids = np.concatenate([order.row(int(g)) for g in gs[:end]])
        self._chunk = self.index.load(sids)
        self._chunk_key = (epoch, k0, k0 + end)
