"""Batched completion of token-id prompts with the target's own forward, and how busy it keeps the GPU.

Prompts are left-padded into one batch (every row then appends at the same slot), so a batch should
hold prompts of similar length: the caller sorts them. Unlike HF ``generate``, rows that have
stopped leave the batch (their cache rows are dropped once they are a quarter of it): with most
completions of a batch ending at different lengths, finished rows would otherwise ride along to
the longest one, each step paying for their attention over the whole cache. Sampling draws from a
generator seeded per batch, so a batch's output does not depend on what ran before it (a resumed
run makes the same completions as an uninterrupted one).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from dflash_model.target import spec_cache
from dflash_model.target.spec_decode import forward_kwargs, new_cache

DROP_SHARE = 0.25
"""Finished rows leave the batch once they are this share of it (each drop copies the cache).
Linear-attention state (hybrid targets) has no row selection in transformers: there they stay."""


@dataclass
class Completion:
    ids: list[int]
    """Generated ids, the end-of-turn token included when the model stopped by itself."""
    finish: str
    """``stop`` (an end-of-turn token) or ``length`` (max_new_tokens reached)."""


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(dev), mask.to(dev)


def pick(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> torch.Tensor:
    """Next token of each row: argmax when ``temperature`` is 0, else a draw from the tempered
    distribution cut to its top-``top_p`` mass (the most likely token always stays)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1:
        return torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    p, order = probs.sort(dim=-1, descending=True)
    p = p * ((p.cumsum(-1) - p) < top_p)  # keep the tokens whose preceding mass is under top_p
    return order.gather(-1, torch.multinomial(p, 1, generator=gen)).squeeze(-1)


@torch.no_grad()
def complete(model: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos: Sequence[int],
             pad_id: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> list[Completion]:
    """The completion of each prompt (greedy when ``temperature`` is 0), one forward per new token."""
    dev = next(model.parameters()).device
    ids, mask = _left_pad(prompts, pad_id, dev)
    gen = torch.Generator(device=dev).manual_seed(seed) if temperature > 0 else None
    cache_arg, takes_cache_position = forward_kwargs(model)
    cache = new_cache(model)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    def forward(x: torch.Tensor, positions: torch.Tensor, **kw: Any) -> torch.Tensor:
        if takes_cache_position:
            start = cache.get_seq_length()
            kw["cache_position"] = torch.arange(start, start + x.shape[1], device=dev)
        out = model(input_ids=x, attention_mask=mask, position_ids=positions, use_cache=True,
                    **{cache_arg: cache}, **kw)
        return out.logits[:, -1]

    logits = forward(ids, pos, logits_to_keep=1)
    can_drop = not spec_cache.linear_state_layers(cache)
    pos = pos[:, -1:]
    out = torch.full((len(prompts), max_new_tokens), pad_id, dtype=torch.long, device=dev)
    rows = torch.arange(len(prompts), device=dev)  # the prompt of each cache row
    done = torch.zeros(len(prompts), dtype=torch.bool, device=dev)
    stop = torch.tensor(sorted(set(int(e) for e in eos)), dtype=torch.long, device=dev)
    for t in range(max_new_tokens):
        tok = torch.where(done, pad_id, pick(logits, temperature, top_p, gen))
        out[rows, t] = tok
        done |= torch.isin(tok, stop)
        finished = int(done.sum())  # the one host sync of a step
        if t == max_new_tokens - 1 or finished == len(done):
            break
        if can_drop and finished >= DROP_SHARE * len(done):
            keep = (~done).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            mask, pos, rows, done, tok = mask[keep], pos[keep], rows[keep], done[keep], tok[keep]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        pos = pos + 1
        logits = forward(tok[:, None], pos)
    stopping = set(stop.tolist())
    result = []
    for row in out.tolist():
        n = next((i + 1 for i, t in enumerate(row) if t in stopping), None)
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
