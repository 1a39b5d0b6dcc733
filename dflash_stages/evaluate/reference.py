"""One greedy reference shared by several evaluations (``evaluate --reference FILE``).

Why: τ_ref scores each drafter on the target's greedy text so that drafters can be compared on one
text. But each evaluation decodes that text itself with HF ``generate``, and in bf16 the decode leaves
one text for another at near ties differently from one process to the next (docs/benchmarks.md,
session 24: 18 of the n-gram drafter's 51 divergence points moved between two evaluations of one
run). Evaluations that name one file use the text the first of them decoded: the first one to take
the file's lock decodes and writes it; the others wait for the lock, then read it.
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


def reference_key(target: str, dtype: str, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> str:
    """What a reference is the greedy decode of; a file written for another key is refused, not reused."""
    doc = json.dumps({"target": target, "dtype": dtype, "max_new_tokens": max_new_tokens,
                      "prompts": [list(map(int, p)) for p in prompts]}, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()


def shared_reference(path: str | Path, key: str, target: str, decode: Decode
                     ) -> tuple[list[list[int]], float | None]:
    """The outputs held in ``path`` for ``key``, or ``decode()``'s, written there first (``target``
    names the model in the file, for the error a wrong file gets).

    Returns (outputs, seconds): seconds is None when the outputs were read. Raises EvaluationError
    when the file holds the reference of another target, dtype, prompt set or length."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if decode() raises
        if path.exists():
            doc = json.loads(path.read_text())
            if doc.get("key") != key:
                raise EvaluationError(
                    f"{path} holds the greedy reference of another target, dtype, prompt set or --max-new-tokens "
                    f"(written for {doc.get('target')!r}, {len(doc.get('outputs', []))} prompts); name another file")
            return doc["outputs"], None
        outputs, seconds = decode()
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"key": key, "target": target, "seconds": round(seconds, 3),
                                   "outputs": outputs}))
        os.replace(tmp, path)
        return outputs, seconds

