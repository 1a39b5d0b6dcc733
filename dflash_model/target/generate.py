"""Batched completion of token-id prompts with the target's own forward, and how busy it keeps the GPU.

One decode step runs every row in flight through the target at once; on a small target a step
costs about the same whatever the batch holds (launching each layer's kernels dominates), so the
rows in flight set the tokens per second. HF ``generate`` keeps every row of a batch until its
longest is done: finished rows ride along, and the batch's tail runs with few rows left. Here, on
targets whose cache is plain KV (:class:`transformers.DynamicLayer` in every layer, which becomes a
:class:`~dflash_model.target.decode_kv.RoomyLayer`: a step writes its column in place):

* finished rows leave the cache once they are a quarter of the rows in flight, and
* their places are refilled from the prompts still waiting, so the batch stays full to the end
  (continuous batching). A newcomer's prompt is prefilled on its own and its KV rows are placed
  beside the others, left-padded to the same width; positions are given per row, so a row's slot
  in the cache does not matter. Columns that have become padding in every row are cut off.

With ``max_batch_tokens`` prompts join only while rows × (longest prompt in flight +
``max_new_tokens``) stays within it, not up to a row count alone: a step's cost is mostly the host
launching kernels, so short prompts decoded many at a time make more tokens a second in the memory
that long ones need. It is an admission rule, not a hard bound on the cache: finished rows ride
along until a quarter of the rows have finished, which widens it, and each layer's buffers keep
:data:`~dflash_model.target.decode_kv.ROOM` spare columns.

Other caches (a hybrid's linear-attention state has no row selection) decode in fixed batches in
which finished rows stay, masked. Either way each row is its prompt's own decode: greedy outputs
equal the one-prompt greedy decode. Sampling draws from one generator seeded by ``seed``, so a call
makes the same completions whenever it runs (a resumed run equals an uninterrupted one).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Collection, Sequence

import torch
from transformers.cache_utils import DynamicLayer

from dflash_model.target.decode_kv import RoomyLayer
from dflash_model.target.spec_decode import forward_kwargs, new_cache

DROP_SHARE = 0.25
"""Finished rows leave (and are replaced) once they are this share of the rows in flight: each drop
copies the cache, so it is batched rather than done for every row."""


@dataclass
class Completion:
    ids: list[int]
    """Generated ids, the end-of-turn token included when the model stopped by itself."""
    finish: str
    """``stop`` (an end-of-turn token) or ``length`` (max_new_tokens reached)."""


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


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) [len(prompts), longest], each prompt at the right end of its row: a
    batch that decodes appends at the same column in every row."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def _decode_cache(model: Any) -> Any:
    """A new cache for ``model``; where every layer is plain growing KV, each is a
    :class:`~dflash_model.target.decode_kv.RoomyLayer` (the step's column written in place)."""
    cache = new_cache(model)
    if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [RoomyLayer() for _ in cache.layers]
    return cache


def _plain_kv(cache: Any) -> bool:
    """Whether every layer of ``cache`` is plain growing KV, which rows can leave and join."""
    return bool(cache.layers) and all(isinstance(layer, RoomyLayer) for layer in cache.layers)


def _pad_left(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return x
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class _Flight:
    """The rows in flight: one KV cache, its key mask, and per row its prompt, next position and
    how many tokens it has made."""

    def __init__(self, model: Any, pad_id: int) -> None:
        self.model, self.pad_id = model, pad_id
        self.dev = next(model.parameters()).device
        self.cache_arg, self.takes_cache_position = forward_kwargs(model)
        self._empty()

    def _empty(self) -> None:
        self.cache = _decode_cache(self.model)
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.dev)
        self.pos = torch.zeros((0, 1), dtype=torch.long, device=self.dev)
        self.rows = torch.zeros(0, dtype=torch.long, device=self.dev)
        self.made = torch.zeros(0, dtype=torch.long, device=self.dev)
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.dev)  # each row's prompt length
        self.longest = 0  # the longest prompt in flight

    def __len__(self) -> int:
        return len(self.rows)

    def _forward(self, cache: Any, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, **kw: Any) -> torch.Tensor:
        if self.takes_cache_position:
            start = cache.get_seq_length()
            kw["cache_position"] = torch.arange(start, start + ids.shape[1], device=self.dev)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         **{self.cache_arg: cache}, **kw)
        return out.logits[:, -1]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of each row's next token after ``tokens`` (one per row)."""
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        self.pos = self.pos + 1
        return self._forward(self.cache, tokens[:, None], self.mask, self.pos)

    def admit(self, prompts: Sequence[Sequence[int]], rows: Sequence[int]) -> torch.Tensor:
        """Prefill ``prompts`` (left-padded among themselves) and add them to the flight; returns
        the logits of their first tokens."""
        ids, mask = (t.to(self.dev) for t in left_pad(prompts, self.pad_id))
        width = ids.shape[1]
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        fresh = _decode_cache(self.model)
        logits = self._forward(fresh, ids, mask, pos, logits_to_keep=1)
        if len(self) == 0:
            self.cache, self.mask = fresh, mask
        else:  # side by side, the narrower left-padded: padded columns are masked, so zeros do
            grow_old, grow_new = max(0, width - self.mask.shape[1]), max(0, self.mask.shape[1] - width)
            for old, new in zip(self.cache.layers, fresh.layers, strict=True):
                old.adopt(torch.cat([_pad_left(old.keys, grow_old, 2), _pad_left(new.keys, grow_new, 2)]),
                          torch.cat([_pad_left(old.values, grow_old, 2), _pad_left(new.values, grow_new, 2)]))
            self.mask = torch.cat([_pad_left(self.mask, grow_old, 1), _pad_left(mask, grow_new, 1)])
        self.pos = torch.cat([self.pos, pos[:, -1:]])
        self.rows = torch.cat([self.rows, torch.tensor(list(rows), dtype=torch.long, device=self.dev)])
        self.made = torch.cat([self.made, torch.zeros(len(rows), dtype=torch.long, device=self.dev)])
        self.lengths = torch.cat([self.lengths, mask.sum(1)])
        self.longest = max(self.longest, max(len(p) for p in prompts))
        return logits

    def keep(self, keep: torch.Tensor) -> None:
        """Only the rows ``keep`` stay (all of them leave, on caches other than plain KV); columns
        that are padding in all of them are cut off."""
        if len(keep) == 0:
            self._empty()
            return
        self.mask, self.pos, self.rows, self.made = self.mask[keep], self.pos[keep], self.rows[keep], self.made[keep]
        self.lengths = self.lengths[keep]
        self.longest = int(self.lengths.max())
        first = int(self.mask.any(0).nonzero()[0])
        for layer in self.cache.layers:
            layer.adopt(layer.keys[keep, :, first:], layer.values[keep, :, first:])
        self.mask = self.mask[:, first:]


@torch.no_grad()
def complete(model: Any, prompts: Sequence[Sequence[int]], *, batch_size: int, max_new_tokens: int,
             eos: Sequence[int], pad_id: int, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, progress: Callable[[int, int], None] | None = None,
             max_batch_tokens: int | None = None) -> list[Completion]:
    """The completion of each prompt (greedy when ``temperature`` is 0), at most ``batch_size`` rows
    in flight and, with ``max_batch_tokens``, prompts admitted only while rows × (longest prompt +
    ``max_new_tokens``) stays within it (one row always runs). Rows join in the
    order given: the caller sorts by length, so that rows side by side need little padding.
    ``progress(rows, tokens)`` is told each time finished rows leave."""
    if not prompts:
        return []
    flight = _Flight(model, pad_id)
    dev = flight.dev

    def joiners(start: int) -> range:
        """The waiting prompts from ``start`` that fit beside the rows in flight."""
        stop, longest = start, flight.longest
        while stop < len(prompts) and len(flight) + stop - start < batch_size:
            wider = max(longest, len(prompts[stop]))
            if (max_batch_tokens is not None and len(flight) + stop - start > 0
                    and (len(flight) + stop - start + 1) * (wider + max_new_tokens) > max_batch_tokens):
                break
            stop, longest = stop + 1, wider
        return range(start, stop)

    def room() -> int:
        """How many rows the flight holds at its longest prompt: where refilling is measured from."""
        if max_batch_tokens is None:
            return batch_size
        return max(1, min(batch_size, max_batch_tokens // (flight.longest + max_new_tokens)))

    gen = torch.Generator(device=dev).manual_seed(seed) if temperature > 0 else None
    stopping = {int(e) for e in eos}
    stop = torch.tensor(sorted(stopping), dtype=torch.long, device=dev)
    # one column more than a row can fill: rows that are done (masked riders) write their pad there
    out = torch.full((len(prompts), max_new_tokens + 1), pad_id, dtype=torch.long, device=dev)
    joining = joiners(0)
    logits = flight.admit([prompts[i] for i in joining], joining)
    joined = joining.stop
    refill = _plain_kv(flight.cache)
    done = torch.zeros(joined, dtype=torch.bool, device=dev)
    while len(flight):
        tok = torch.where(done, pad_id, pick(logits, temperature, top_p, gen))
        out[flight.rows, torch.where(done, max_new_tokens, flight.made)] = tok
        flight.made += ~done
        done |= torch.isin(tok, stop) | (flight.made >= max_new_tokens)
        finished = int(done.sum())  # the one host sync of a step
        if finished == len(done) or (refill and finished >= DROP_SHARE * len(done)):
            keep = (~done).nonzero().squeeze(1)
            if progress is not None:
                progress(finished, int(flight.made[done].sum()))
            flight.keep(keep)
            tok, done = tok[keep], done[keep]
        logits = flight.step(tok) if len(flight) else None
        if joined < len(prompts) and (len(flight) == 0 or (refill and len(flight) <= (1 - DROP_SHARE) * room())):
            joining = joiners(joined)
            if not joining:  # the newcomers are wider than the free room: wait for more rows to leave
                continue
            first = flight.admit([prompts[i] for i in joining], joining)
            logits = first if logits is None else torch.cat([logits, first])
            done = torch.cat([done, torch.zeros(len(joining), dtype=torch.bool, device=dev)])
            joined = joining.stop
    result = []
    for row in out[:, :max_new_tokens].tolist():
        n = end_of(row, stopping)
        result.append(Completion(row[:n], "stop") if n is not None else Completion(row, "length"))
    return result


def end_of(tokens: Sequence[int], eos: Collection[int]) -> int | None:
    """Length of ``tokens`` up to and including the first end token; None when there is none."""
    return next((i + 1 for i, t in enumerate(tokens) if t in eos), None)


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
