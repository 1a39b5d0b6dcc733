"""The public reader of tokenized samples: what pack stages (built-in or a plugin's) read.

Its input is a stream of :data:`~dflash_core.items.SAMPLE_SHARD` items (tokenize's Arrow IPC
shards), :data:`~dflash_core.items.FILE_ITEM` items naming such shards, or inline
:data:`~dflash_core.items.SAMPLE` dicts (``items.SAMPLE_SOURCES``; check them where they enter with
``dflash_core.items.checked``). :class:`SampleIndex` keeps per sample only its length and where it
lives (source, record batch, row): 16 bytes a sample (~14 MB for 900K). Tokens are read on demand,
a window at a time, from memory-mapped shards. Needs numpy and pyarrow (imported by the stages
that read samples, never by the engine's commands).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

__all__ = ["SampleError", "SampleIndex"]


class SampleError(RuntimeError):
    """Samples that cannot be read: an unexpected item, a shard without its columns, a row whose
    token and mask counts differ."""




class _ArrowShard:
    """One Arrow IPC shard (file or stream format), memory-mapped while open.

    A remote shard is copied to a local temp file once (a stream-format shard is rewritten once
    as an IPC file) so that record batches can be read at random. Shards are closed after
    indexing and reopened on demand (the index keeps a bounded number open).
    """

    def __init__(self, url: str, tmp: "_TmpDir") -> None:
        self.url = url
        self._tmp = tmp
        self._reader: Any = None
        self._mmap: Any = None
        self._local: str | None = None

    def _open(self) -> Any:
        if self._reader is not None:
            return self._reader
        import pyarrow as pa

        if self._local is None:
            self._local = self._localize()
        self._mmap = pa.memory_map(self._local, "r")
        self._reader = pa.ipc.open_file(self._mmap)
        names = self._reader.schema.names
        for col in ("input_ids", "loss_mask"):
            if col not in names:
                raise SampleError(f"shard {self.url} has no '{col}' column (columns: {names})")
        return self._reader

    def _localize(self) -> str:
        import pyarrow as pa
        from fsspec.core import url_to_fs

        fs, path = url_to_fs(self.url)
        protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
        if protocol in ("file", "local"):
            local = path
        else:  # remote: one sequential copy, then random access on the local copy
            local = os.path.join(self._tmp.path(), f"shard-{id(self)}.arrow")
            fs.get_file(path, local)
        try:
            with pa.memory_map(local, "r") as f:
                pa.ipc.open_file(f)
            return local
        except pa.ArrowInvalid:  # IPC stream format: rewrite once as an IPC file
            converted = os.path.join(self._tmp.path(), f"shard-{id(self)}-file.arrow")
            with pa.memory_map(local, "r") as f, pa.ipc.open_stream(f) as rd:
                with pa.OSFile(converted, "wb") as sink, pa.ipc.new_file(sink, rd.schema) as wr:
                    for batch in rd:
                        wr.write_batch(batch)
            return converted

    def close(self) -> None:
        self._reader = None
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None

    def num_batches(self) -> int:
        return self._open().num_record_batches

    def lengths(self, b: int) -> np.ndarray:
        col = self._open().get_batch(b).column("input_ids")
        return np.diff(col.offsets.to_numpy()).astype(np.int32)

    def batch(self, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        rb = self._open().get_batch(b)
        ids, mask = rb.column("input_ids"), rb.column("loss_mask")
        return (ids.offsets.to_numpy(), ids.values.to_numpy(zero_copy_only=False),
                mask.offsets.to_numpy(), mask.values.to_numpy(zero_copy_only=False))


class _InlineSource:
    """Samples given inline as dicts ``{"input_ids": [...], "loss_mask": [...]}`` (one batch)."""

    url = "<inline>"

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []

    def add(self, item: dict) -> None:
        self.ids.append(np.asarray(item["input_ids"], dtype=np.int64).reshape(-1))
        mask = item.get("loss_mask")
        self.masks.append(np.ones(len(self.ids[-1]), np.uint8) if mask is None
                          else np.asarray(mask).astype(np.uint8).reshape(-1))

    def num_batches(self) -> int:
        return 1

    def close(self) -> None:
        pass

    def lengths(self, b: int) -> np.ndarray:
        return np.array([len(x) for x in self.ids], dtype=np.int32)

    def batch(self, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        offs = np.concatenate([[0], np.cumsum([len(x) for x in self.ids])]).astype(np.int64)
        moffs = np.concatenate([[0], np.cumsum([len(x) for x in self.masks])]).astype(np.int64)
        cat = lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dt)  # noqa: E731
        return offs, cat(self.ids, np.int64), moffs, cat(self.masks, np.uint8)


class _TmpDir:
    def __init__(self) -> None:
        self._path: str | None = None

    def path(self) -> str:
        if self._path is None:
            self._path = tempfile.mkdtemp(prefix="dflash-pack-")
        return self._path

    def cleanup(self) -> None:
        if self._path is not None:
            shutil.rmtree(self._path, ignore_errors=True)
            self._path = None


@dataclass
class SampleIndex:
    """Length and location of every sample, in input order."""

    lengths: np.ndarray   # int32 [N]
    source: np.ndarray    # int32 [N] index into sources
    batch: np.ndarray     # int32 [N] record batch in the source
    row: np.ndarray       # int32 [N] row in the record batch
    sources: list
    empty: int = 0        # zero-length samples left out
    _tmp: Any = None
    max_open: int = 64    # shards kept memory-mapped at once
    _open_lru: Any = None

    @classmethod
    def build(cls, items: Iterable[Any]) -> "SampleIndex":
        """Read every shard's ``input_ids`` offsets once; accept inline sample dicts too."""
        tmp = _TmpDir()
        sources: list = []
        inline: _InlineSource | None = None
        for item in items:
            if isinstance(item, dict) and ("shard" in item or "path" in item) and "input_ids" not in item:
                sources.append(_ArrowShard(str(item.get("shard") or item["path"]), tmp))
            elif isinstance(item, dict) and "input_ids" in item:
                if inline is None:
                    inline = _InlineSource()
                    sources.append(inline)
                inline.add(item)
            else:
                raise SampleError(f"pack: unexpected input item {str(item)[:120]!r} (want a shard "
                                "descriptor {'shard': path, ...} or a sample {'input_ids': [...]})")
        parts: list[tuple[np.ndarray, ...]] = []
        for s, src in enumerate(sources):
            try:
                for b in range(src.num_batches()):
                    lens = src.lengths(b)
                    n = len(lens)
                    parts.append((lens, np.full(n, s, np.int32), np.full(n, b, np.int32),
                                  np.arange(n, dtype=np.int32)))
            except SampleError:
                raise
            except Exception as exc:
                raise SampleError(f"cannot read shard {src.url}: {type(exc).__name__}: {exc}") from exc
            finally:
                src.close()
        if parts:
            lengths, source, batch, row = (np.concatenate(x) for x in zip(*parts))
        else:
            lengths, source, batch, row = (np.zeros(0, np.int32) for _ in range(4))
        keep = lengths > 0
        empty = int((~keep).sum())
        if empty:
            lengths, source, batch, row = lengths[keep], source[keep], batch[keep], row[keep]
        return cls(lengths, source, batch, row, sources, empty, tmp)

    def __len__(self) -> int:
        return len(self.lengths)

    def load(self, sample_ids: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Tokens and masks of ``sample_ids``, reading each record batch once."""
        out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        sample_ids = np.unique(np.asarray(sample_ids, dtype=np.int64))
        if len(sample_ids) == 0:
            return out
        key = self.source[sample_ids].astype(np.int64) << 32 | self.batch[sample_ids].astype(np.int64)
        order = np.argsort(key, kind="stable")
        sample_ids, key = sample_ids[order], key[order]
        bounds = np.flatnonzero(np.diff(key)) + 1
        for group in np.split(sample_ids, bounds):
            s, b = int(self.source[group[0]]), int(self.batch[group[0]])
            src = self.sources[s]
            if self._open_lru is None:
                self._open_lru = OrderedDict()
            self._open_lru[s] = None
            self._open_lru.move_to_end(s)
            while len(self._open_lru) > self.max_open:
                self.sources[self._open_lru.popitem(last=False)[0]].close()
            offs, vals, moffs, mvals = src.batch(b)
            for sid in group.tolist():
                r = int(self.row[sid])
                ids = np.array(vals[offs[r]:offs[r + 1]], dtype=np.int64)
                mask = np.array(mvals[moffs[r]:moffs[r + 1]], dtype=np.bool_)
                if len(mask) != len(ids):
                    raise SampleError(f"{src.url}: row {r} of batch {b} has {len(ids)} input_ids "
                                    f"but {len(mask)} loss_mask values")
                out[sid] = (ids, mask)
        return out

    def close(self) -> None:
        for src in self.sources:
            src.close()
        self._open_lru = None
        if self._tmp is not None:
            self._tmp.cleanup()
