"""Batched completion of token-id prompts with HF ``generate``, and how busy it keeps the GPU.

Prompts are left-padded into one batch (``generate`` appends to the right end of every row), so a
batch should hold prompts of similar length: the caller sorts them. Sampling draws from a generator
seeded per batch, so a batch's output does not depend on what ran before it (a resumed run makes the
same completions as an uninterrupted one).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass
class Completion:
    ids: list[int]
    """Generated ids, the end-of-turn token included when the model stopped by itself."""
    finish: str
    """``stop`` (an end-of-turn token) or ``length`` (max_new_tokens reached)."""


@torch.no_grad()
def complete(model: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos: Sequence[int],
             pad_id: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> list[Completion]:
    """One ``generate`` call over ``prompts`` (greedy when ``temperature`` is 0)."""
    dev = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    kw: dict[str, Any] = {"max_new_tokens": max_new_tokens, "eos_token_id": list(eos), "pad_token_id": pad_id}
    if temperature > 0:
        kw.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    else:
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), **kw)
    stop = set(int(e) for e in eos)
    result = []
    for row in out[:, width:].tolist():
        n = next((i + 1 for i, t in enumerate(row) if t in stop), None)
        result.append(Completion(row[:n], "stop") if n is not None else Completion(row, "length"))
    return result


class GpuBusy:
    """The GPU's own utilization (NVML: share of time a kernel ran), sampled in a thread while open.

    ``share`` is None where NVML cannot be read (CPU, no ``pynvml``)."""

    def __init__(self, device: torch.device, every_s: float = 0.2) -> None:
        self.device, self.every_s = device, every_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "GpuBusy":
        if self.device.type == "cuda" and self._read() is not None:
            self._thread = threading.Thread(target=self._loop, name="gpu-busy", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _read(self) -> int | None:
        try:
            return int(torch.cuda.utilization(self.device))
        except Exception:  # no NVML bindings, or a device NVML does not know
            return None

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            value = self._read()
            if value is not None:
                self.samples.append(value)

    @property
    def share(self) -> float | None:
        return sum(self.samples) / len(self.samples) / 100 if self.samples else None
