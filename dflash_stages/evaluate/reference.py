"""Greedy references shared by several evaluations (``evaluate --reference DIR``).

Why: τ_ref scores each drafter on the target's greedy text so that drafters can be compared on one
text. But each evaluation decodes that text itself with HF ``generate``, and in bf16 the decode leaves
one text for another at near ties differently from one process to the next (docs/evaluate.md,
τ_ref). Evaluations that name one directory use the text the first of them decoded: one file per
target (its files as they are now), dtype, prompt set and length; the first evaluation to take a
file's lock decodes and writes it, the others wait for the lock, then read it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Sequence

from dflash_stages.evaluate.drafter import EvaluationError

Decode = Callable[[], tuple[list[list[int]], float]]
"""Decodes the reference: (one output per prompt, seconds)."""


def target_fingerprint(target: str) -> str:
    """``target`` as a reference depends on it: for a local directory its path and each file's name,
    size and modification time (a model written again there decodes another text), else the name
    itself (a preset or a hub name)."""
    path = Path(target).expanduser()
    if not path.is_dir():
        return target
    files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in path.iterdir() if f.is_file())
    return json.dumps([str(path.resolve()), files])


def reference_key(target: str, dtype: str, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> str:
    """What a reference is the greedy decode of (``target`` as :func:`target_fingerprint` gives it)."""
    doc = json.dumps({"target": target, "dtype": dtype, "max_new_tokens": max_new_tokens,
                      "prompts": [list(map(int, p)) for p in prompts]}, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()


def shared_reference(directory: str | Path, key: str, target: str, decode: Decode
                     ) -> tuple[list[list[int]], float | None]:
    """The outputs of ``key``'s file in ``directory``, or ``decode()``'s, written there first
    (``target`` names the model in the file, for a reader). Returns (outputs, seconds): seconds is
    None when the outputs were read. A file that cannot be read or written is an EvaluationError."""
    import fcntl

    path = Path(directory) / f"{key[:24]}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if decode() raises
            if path.exists():
                doc = json.loads(path.read_text())
                if doc.get("key") != key or not isinstance(doc.get("outputs"), list):
                    raise ValueError("it holds no reference of this key")
                return doc["outputs"], None
            outputs, seconds = decode()
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "w") as f:
                json.dump({"key": key, "target": target, "seconds": round(seconds, 3), "outputs": outputs}, f)
                f.flush()
                os.fsync(f.fileno())  # whole on disk before it takes the name
            os.replace(tmp, path)
            return outputs, seconds
    except (OSError, ValueError) as exc:
        raise EvaluationError(f"shared greedy reference {path}: {exc}; remove it or name another "
                              "--reference directory") from exc
