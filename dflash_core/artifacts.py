"""Content-keyed artifacts of materialized stages, on any fsspec filesystem.

Layout: ``<run_dir>/artifacts/<stage>/<key>/`` holds the stage's own files (its ``work_dir``),
``items.jsonl`` (the items it yielded) and ``_manifest.json``. The manifest is written last
(and, on a local disk, by temp-file + rename), so an artifact without one is incomplete and is
never read: that is what makes writes atomic on object stores, which have no rename.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from typing import Any, Iterator

import fsspec
from fsspec.core import url_to_fs

MANIFEST = "_manifest.json"
ITEMS = "items.jsonl"


def artifact_key(impl: str, version: str, params: dict[str, Any],
                 upstream: dict[str, str]) -> str:
    """Key of an output: same implementation, semantic params and input digests -> same key."""
    blob = json.dumps({"impl": impl, "version": version, "params": params,
                       "upstream": upstream}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def join(base: str, *parts: str) -> str:
    """Join path parts onto a local path or URL."""
    return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts]])


class ItemsNotJSON(TypeError):
    """A materialized stage yielded something that cannot be stored as a JSON line."""


class ArtifactStore:
    """Reads and writes artifacts under one run directory (local path or URL)."""

    def __init__(self, run_dir: str, storage_options: dict[str, Any] | None = None) -> None:
        self.run_dir = run_dir
        self.fs, self._root = url_to_fs(run_dir, **(storage_options or {}))
        self.local = "file" in _protocols(self.fs)

    def dir(self, stage: str, key: str) -> str:
        return join(self.run_dir, "artifacts", stage, key)

    def _path(self, url: str) -> str:
        return url_to_fs(url)[1] if "://" in url else url

    def exists(self, stage: str, key: str) -> bool:
        return self.fs.exists(self._path(join(self.dir(stage, key), MANIFEST)))

    def manifest(self, stage: str, key: str) -> dict[str, Any] | None:
        path = self._path(join(self.dir(stage, key), MANIFEST))
        try:
            with self.fs.open(path, "rb") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None

    def writer(self, stage: str, key: str) -> "ArtifactWriter":
        target = self.dir(stage, key)
        path = self._path(target)
        if self.fs.exists(path):  # a partial artifact from an interrupted run
            self.fs.rm(path, recursive=True)
        if self.local:
            os.makedirs(path, exist_ok=True)
        return ArtifactWriter(self, stage, key, target)

    def items(self, stage: str, key: str) -> Iterator[Any]:
        """The items a complete artifact holds, in the order they were yielded."""
        if not self.exists(stage, key):
            raise FileNotFoundError(f"artifact {stage}/{key} is missing or incomplete")
        with self.fs.open(self._path(join(self.dir(stage, key), ITEMS)), "rt") as f:
            for line in f:
                yield json.loads(line)


class ArtifactWriter:
    """Collects one stage's items and commits the artifact (manifest last)."""

    def __init__(self, store: ArtifactStore, stage: str, key: str, target: str) -> None:
        self.store, self.stage, self.key, self.dir = store, stage, key, target
        self._hash = hashlib.sha256()
        self._lines: list[str] = []
        self.count = 0

    def add(self, item: Any) -> None:
        try:
            line = json.dumps(item, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise ItemsNotJSON(
                f"stage '{self.stage}' yields {type(item).__name__} items, which a materialized "
                f"link cannot store as JSON ({exc}); use 'link: stream' for its consumers, or "
                f"write the data as files in ctx.work_dir and yield their paths") from None
        self._lines.append(line)
        self._hash.update(line.encode() + b"\n")
        self.count += 1

    def commit(self, meta: dict[str, Any]) -> str:
        """Write items then the manifest; return the artifact's content digest."""
        fs = self.store.fs
        items_path = self.store._path(join(self.dir, ITEMS))
        with fs.open(items_path, "wt") as f:
            f.write("".join(line + "\n" for line in self._lines))
        digest = self._hash.hexdigest()[:20]
        manifest = {"stage": self.stage, "key": self.key, "digest": digest, "items": self.count,
                    "created": time.time(), **meta}
        _atomic_write(fs, self.store._path(join(self.dir, MANIFEST)),
                      json.dumps(manifest, indent=1, sort_keys=True, default=str).encode(), self.store.local)
        return digest


def _atomic_write(fs: Any, path: str, data: bytes, local: bool) -> None:
    if local:
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    else:  # object stores: a single PUT is atomic
        with fs.open(path, "wb") as f:
            f.write(data)


def write_bytes(url: str, data: bytes, storage_options: dict[str, Any] | None = None) -> None:
    """Atomically write a file at a local path or URL (``storage_options``: endpoint, keys)."""
    fs, path = url_to_fs(url, **(storage_options or {}))
    local = "file" in _protocols(fs)
    if local:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    _atomic_write(fs, path, data, local)


def write_json(url: str, data: Any, storage_options: dict[str, Any] | None = None) -> None:
    """Atomically write a JSON file at a local path or URL."""
    write_bytes(url, json.dumps(data, indent=1, sort_keys=True, default=str).encode(), storage_options)


def read_json(url: str) -> Any | None:
    try:
        with fsspec.open(url, "rt") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _protocols(fs: Any) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)
