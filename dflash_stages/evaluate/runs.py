"""The measurements behind an evaluate report: decode every prompt with a drafter, summarize the
cycles (also split by whether the n-gram drafter has a match where they start), and check each
output against the target's own greedy decode.

The check and bf16. A batched verify forward and a one-token decode add the same numbers in another
order; in bf16 that can turn a near-tie between the target's two best tokens the other way, and from
there the outputs differ without anything being wrong. So a divergence is judged where it starts:
the target scores the common prefix once more, and if the two tokens' logits lie within
``tie_tolerance`` of each other (relative to the larger logit), it is a near tie, reported but not a
failure; anything wider is a real mismatch. In fp32 the tolerance is tight enough that any logic
error (a wrong token accepted, a stale cache row) still fails.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from dflash_model.target.spec_decode import (NGRAM_MAX_N, DecodeResult, Drafter, ngram_match, served_tau,
                                             speculative_decode, tau_histogram)

TIE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
"""Relative logit gap under which a divergence counts as a near tie, by the target's dtype."""
FP8_TIE_TOLERANCE = 2 ** -3
"""The least tolerance for a target whose linear layers round their activations to e4m3
(``FP8BlockLinear``), whatever its dtype. A verify block and a one-token decode that differ in the
last bit can round an activation to the other neighbouring e4m3 value, up to 1/8 away (3 mantissa
bits), and the layers after it carry that on. The value is a measured choice sized by that step,
which bounds an activation's rounding, not a logit's, so a deeper model may need more
(``--tie-tolerance``); what was measured, and that a loop accepting a wrong draft still fails at
it, is in docs/evaluate.md and tests/target/test_fp8_target.py."""


def fp8_layers(target: torch.nn.Module) -> int:
    """How many of the target's linear layers are FP8 (``FP8BlockLinear``)."""
    from dflash_model.target.fp8 import FP8BlockLinear

    return sum(isinstance(m, FP8BlockLinear) for m in target.modules())


def tie_tolerance(target: torch.nn.Module) -> float:
    """The default near-tie tolerance for ``target``: by its dtype, and at least
    ``FP8_TIE_TOLERANCE`` when it has FP8 linear layers."""
    tol = TIE_TOLERANCE.get(next(target.parameters()).dtype, 1e-4)
    return max(tol, FP8_TIE_TOLERANCE) if fp8_layers(target) else tol


@dataclass
class DecodeRun:
    """One drafter over all prompts."""

    results: list[DecodeResult]
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    """Of ``seconds``, those spent drafting (``draft``) and in the target's forwards (``verify``);
    the rest is the loop's own work on the host."""

    @property
    def tokens(self) -> list[list[int]]:
        return [r.tokens for r in self.results]

    def summary(self, block_size: int) -> dict[str, Any]:
        """τ over cycles with a whole block of draft budget (the last cycles before max_new_tokens are
        cut short and would bias short outputs down; ``tau_all`` counts every cycle), histogram, totals."""
        acc = [a for r in self.results for a in r.accepted]
        full = [a for r in self.results for a in r.full_accepted]
        drafted = sum(sum(r.drafted) for r in self.results)
        generated = sum(len(r.tokens) for r in self.results)
        return {"tau": served_tau((t, f) for r in self.results for t, f in zip(r.taus, r.full)),
                "tau_all": mean_tau(acc),
                "full_cycles": len(full), "cycles": len(acc), "drafted": drafted, "accepted": sum(acc),
                "acceptance_rate": sum(acc) / drafted if drafted else None,
                "tau_histogram": tau_histogram(acc, block_size), "generated_tokens": generated,
                "seconds": round(self.seconds, 3),
                "tokens_per_s": round(generated / self.seconds, 1) if self.seconds else None}


def mean_tau(accepted: Sequence[int]) -> float:
    return (sum(accepted) + len(accepted)) / len(accepted) if accepted else float("nan")


def cycle_match_lengths(prompt: Sequence[int], result: DecodeResult) -> list[int]:
    """Per cycle of ``result``: the length of the suffix the n-gram drafter finds earlier in the text at
    the cycle's start (prompt + output up to its last verified token, the context it drafts from);
    0 where it finds none. A property of the text, so it splits any drafter's cycles."""
    text = list(prompt) + list(result.tokens)
    return [m[0] if (m := ngram_match(text[:a + 1])) else 0 for a in result.anchors]


def ngram_split(prompts: Sequence[Sequence[int]], runs: Mapping[str, DecodeRun | None]) -> dict[str, Any]:
    """Each run's cycles split by whether the n-gram drafter has a match at their start: where a drafter
    gains or loses against n-gram, on text it could copy (``match``, and by suffix length under
    ``match_length``) or on new text (``no_match``). Per class and run (None for a run not made):
    ``cycles``, ``tokens`` (their τ summed: accepted + 1 each), ``tau`` = tokens / cycles and ``share``
    = tokens / all the run's cycle tokens; over both classes these recombine to the run's ``tau_all``."""
    cycles = {name: _cycle_taus(prompts, run) if run is not None else None for name, run in runs.items()}

    def part(keep: Callable[[int], bool]) -> dict[str, Any]:
        return {name: _class_stats(c, keep) if c is not None else None for name, c in cycles.items()}

    return {"match": part(lambda n: n > 0), "no_match": part(lambda n: n == 0),
            "match_length": {str(k): part(lambda n, k=k: n == k) for k in range(NGRAM_MAX_N, 0, -1)}}


def pooled_difference(a: DecodeRun, b: DecodeRun) -> dict[str, Any] | None:
    """``a``'s served τ minus ``b``'s, as :meth:`DecodeRun.summary` pools them (every counted cycle of
    every prompt), and how sure that difference is: a report's prompts are a sample of those a
    drafter will serve, and another sample moves the difference by about ``se``, its standard error
    over prompts (a ratio estimator's, linearized: each prompt's counted tokens less τ times its
    counted cycles, over the mean cycles a prompt). ``n`` prompts; ``wins`` / ``losses``: the
    prompts where ``a``'s own τ (:attr:`DecodeResult.tau`, the report's per-prompt figure) is above
    / below ``b``'s. None with fewer than two prompts or without cycles."""
    parts_a, parts_b = _counted(a), _counted(b)
    n = len(parts_a)
    cycles_a, cycles_b = sum(c for _, c in parts_a), sum(c for _, c in parts_b)
    if n < 2 or len(parts_b) != n or not cycles_a or not cycles_b:
        return None
    tau_a, tau_b = sum(t for t, _ in parts_a) / cycles_a, sum(t for t, _ in parts_b) / cycles_b
    z = [(t - tau_a * c) / (cycles_a / n) - (u - tau_b * d) / (cycles_b / n)
         for (t, c), (u, d) in zip(parts_a, parts_b)]
    own = [(x.tau, y.tau) for x, y in zip(a.results, b.results) if not (math.isnan(x.tau) or math.isnan(y.tau))]
    return {"diff": tau_a - tau_b, "se": math.sqrt(sum(x * x for x in z) / (n * (n - 1))), "n": n,
            "wins": sum(x > y for x, y in own), "losses": sum(x < y for x, y in own)}


def _counted(run: DecodeRun) -> list[tuple[int, int]]:
    """Per prompt: (τ summed, cycles) over the cycles the run's pooled τ counts (``served_pool``'s
    rule over the whole run: those with a whole block of draft budget, all where none had one)."""
    whole = any(any(r.full) for r in run.results)
    kept = [[t for t, f in zip(r.taus, r.full) if f or not whole] for r in run.results]
    return [(sum(k), len(k)) for k in kept]


def _cycle_taus(prompts: Sequence[Sequence[int]], run: DecodeRun) -> list[tuple[int, int]]:
    """(n-gram match length at its start, τ) of every cycle of ``run``."""
    return [(n, a + 1) for p, r in zip(prompts, run.results) for n, a in zip(cycle_match_lengths(p, r), r.accepted)]


def _class_stats(cycles: list[tuple[int, int]], keep: Callable[[int], bool]) -> dict[str, Any]:
    """cycles, tokens, tau and share of the cycles whose match length ``keep`` selects."""
    taus = [t for n, t in cycles if keep(n)]
    total = sum(t for _, t in cycles)
    return {"cycles": len(taus), "tokens": sum(taus), "tau": sum(taus) / len(taus) if taus else None,
            "share": sum(taus) / total if total else None}


def decode_all(target: Any, prompts: Sequence[Sequence[int]], drafter: Drafter, block_size: int,
               max_new_tokens: int, layer_ids: Sequence[int] | None, eos: set[int], batch_size: int,
               batch_drafter: Callable | None = None,
               progress: Callable[[list[DecodeResult]], None] | None = None) -> DecodeRun:
    """Speculative decoding of every prompt: ``batch_size`` prompts per target forward on dense
    targets (``batch_drafter`` drafts a batch at once, else ``drafter`` one by one), one by one on
    hybrid targets. ``progress(results so far)`` after each batch."""
    from dflash_model.target.spec_batch import one_by_one, speculative_decode_batch, supports_batch

    t0 = time.perf_counter()
    results: list[DecodeResult] = []
    clock = {"draft": 0.0, "verify": 0.0}
    if supports_batch(target):
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i:i + batch_size]
            results += speculative_decode_batch(target, chunk, batch_drafter or one_by_one(drafter), block_size,
                                                max_new_tokens, layer_ids, eos, clock=clock)
            if progress:
                progress(results)
    else:
        for p in prompts:
            results.append(speculative_decode(target, p, drafter, block_size, max_new_tokens, layer_ids, eos,
                                              clock=clock))
            if progress:
                progress(results)
    sync(target)
    return DecodeRun(results, time.perf_counter() - t0, clock)


def reference_decode(target: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: set[int],
                     pad_id: int, batch_size: int, progress: Callable[[int], None] | None = None
                     ) -> tuple[list[list[int]], float]:
    """The target's plain greedy decode (batched on dense targets), and its seconds.
    ``progress(prompts done)`` after each batch."""
    from dflash_model.target.spec_batch import supports_batch

    step = batch_size if supports_batch(target) else 1
    t0 = time.perf_counter()
    out: list[list[int]] = []
    for i in range(0, len(prompts), step):
        out += hf_greedy(target, prompts[i:i + step], max_new_tokens, eos, pad_id)
        if progress:
            progress(len(out))
    sync(target)
    return out, time.perf_counter() - t0


@torch.no_grad()
def hf_greedy(target: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: set[int],
              pad_id: int) -> list[list[int]]:
    """HF ``generate``'s greedy decode of the left-padded ``prompts``, each cut after its first end
    token. The reference is code we did not write, so a bug that our decode loops (the generate
    stage's, the speculative ones) share cannot hide in the check."""
    from dflash_model.target.generate import end_of, left_pad

    dev = next(target.parameters()).device
    ids, mask = left_pad(prompts, pad_id)
    width = ids.shape[1]
    out = target.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new_tokens,
                          eos_token_id=sorted(eos), pad_token_id=pad_id, do_sample=False, temperature=None,
                          top_p=None, top_k=None)
    return [row[:end_of(row, eos)] for row in out[:, width:].tolist()]


@torch.no_grad()
def check_outputs(target: Any, prompts: Sequence[Sequence[int]], refs: Sequence[Sequence[int]],
                  outputs: Sequence[Sequence[int]], who: str, tie_tolerance: float
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(mismatches, near_ties) of ``outputs`` against ``refs``, judged at the first differing token."""
    from dflash_model.target.spec_decode import first_mismatch

    dev = next(target.parameters()).device
    mismatches, ties = [], []
    for i, (prompt, ref, got) in enumerate(zip(prompts, refs, outputs)):
        at = first_mismatch(ref, got)
        if at is None:
            continue
        entry = {"prompt": i, "drafter": who, "index": at, "expected": list(ref[at:at + 8]),
                 "got": list(got[at:at + 8])}
        if at < len(ref) and at < len(got):
            ids = torch.tensor([list(prompt) + list(ref[:at])], device=dev)
            logits = target(input_ids=ids).logits[0, -1].float()
            a, b = float(logits[ref[at]]), float(logits[got[at]])
            entry["logit_gap"] = round(abs(a - b), 5)
            entry["tolerance"] = round(tie_tolerance * max(1.0, abs(a), abs(b)), 5)
            if entry["logit_gap"] <= entry["tolerance"]:
                ties.append(entry)
                continue
        mismatches.append(entry)  # a wide gap, or one output ended where the other went on
    return mismatches, ties


def sync(model: Any) -> None:
    """Waits for the GPU work queued on ``model``'s device, so that a clock read next counts it."""
    dev = next(model.parameters()).device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
