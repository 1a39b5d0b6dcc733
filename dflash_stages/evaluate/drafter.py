"""The report of one drafter on token-id prompts: served τ, the lossless check, the n-gram
baseline, τ_sim and the train/serve gap. No files, no tokenizer: ``export.py`` loads those.

* τ — mean accepted drafts + 1 per cycle, its histogram, drafted vs accepted tokens (``spec_batch``:
  a batch of prompts per verify forward on dense targets, ``spec_decode`` one prompt at a time on
  hybrid ones; KV cache, features captured by hooks during that forward);
* the lossless check — every output against the target's plain greedy decode (HF ``generate``),
  judged at the first differing token: a near tie within the dtype's tolerance is reported, a wider
  gap fails the stage / the command (``runs``);
* τ_ngram — the training-free prompt-lookup baseline through the same loop;
* the n-gram split — both drafters' cycles split by whether the n-gram drafter has a match where
  they start (``runs.ngram_split``): whether a drafter loses on text it could copy or on new text;
* τ_sim — the same drafter on the same prompts + its served outputs, teacher-forced through the
  training code (``drafter_loss``); ``gap = (τ_sim − τ) / τ_sim``, flagged when |gap| > 10%:
  the signature of something that differs between training and serving (docs/drafter.md, 'Pitfalls').
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from dflash_stages.generate.prompts import read_records

Progress = Callable[[str, int, int, float | None], None]
"""``progress(phase, done, total, tau_so_far)``: where an evaluation is (see :func:`evaluate_drafter`);
``dflash-pipe evaluate`` prints it, since on a CPU each phase takes minutes, and the evaluate stage
logs each phase's start and end."""


def progress_line(phase: str, done: int, total: int, tau: float | None) -> str:
    """One :data:`Progress` report as text: ``DFlash: 32/64 prompts, τ so far 2.41``."""
    return f"{phase}: {done}/{total} prompts" + (f", τ so far {tau:.2f}" if tau is not None else "")


GAP_THRESHOLD = 0.10


class EvaluationError(RuntimeError):
    """A problem with the inputs of an evaluation (no target, no prompts, mismatched shapes)."""


class LosslessError(RuntimeError):
    """Speculative decoding produced something other than the target's greedy decode."""


# --------------------------------------------------------------------------- metrics log

def read_metrics(path: str | None) -> list[dict[str, Any]]:
    """Records of a training ``metrics.jsonl`` (missing file or None: [])."""
    if not path:
        return []
    try:
        return read_records(path)
    except (FileNotFoundError, OSError, json.JSONDecodeError):
        return []


def training_summary(records: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Steps, final loss / τ_sim, and training time/tokens where the log records them (one
    record per line, as ``dflash_core.items.METRICS_RECORD`` declares; older logs may lack fields)."""
    recs = [r for r in records if "step" in r]
    if not recs:
        return None
    last = recs[-1]
    out: dict[str, Any] = {"steps": int(last["step"]), "records": len(recs),
                           "loss": last.get("loss"), "acc": last.get("acc"),
                           "tau_sim_train": last.get("tau_sim"), "tau_serve_train": last.get("tau_serve")}
    val = [r for r in recs if r.get("val_tau_serve") is not None]
    if val:  # train validation_share
        out.update(last_epoch_validation(recs) or {"tau_serve_val": val[-1]["val_tau_serve"]},
                   acc_val=val[-1].get("val_acc"))
    if "elapsed_s" in last:
        out["train_time_s"] = float(last["elapsed_s"])
    if "tokens" in last:
        out["train_tokens"] = int(last["tokens"])
    tps = [float(r["tokens_per_s"]) for r in recs if r.get("tokens_per_s")]
    if tps:
        out["tokens_per_s_mean"] = sum(tps) / len(tps)
    return out


def last_epoch_validation(records: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """``tau_serve_val`` pooled over the cycles of every window of the last epoch (each validation
    document is walked once an epoch), with their count ``val_cycles``: one window's walk covers a
    few documents, too few to read a served τ from. None where the records lack ``epoch`` or
    ``val_cycles`` (older logs, or rows without the pack stage's plan)."""
    end = records[-1].get("epoch")
    if end is None:
        return None
    last = [r for r in records if r.get("val_cycles") and r.get("epoch") is not None and r["epoch"] > end - 1]
    cycles = sum(int(r["val_cycles"]) for r in last)
    if not cycles:
        return None
    return {"tau_serve_val": sum(r["val_tau_serve"] * r["val_cycles"] for r in last) / cycles, "val_cycles": cycles}


# --------------------------------------------------------------------------- evaluation

def _finite(x: float | None) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def compute_gap(tau: float, tau_sim: float | None, threshold: float = GAP_THRESHOLD) -> tuple[float | None, bool]:
    """(gap = (τ_sim − τ) / τ_sim, flagged = |gap| > threshold); (None, False) without τ_sim."""
    if not _finite(tau_sim) or not _finite(tau) or tau_sim <= 0:
        return None, False
    gap = (tau_sim - tau) / tau_sim
    return gap, abs(gap) > threshold


NO_TAU_SIM = {"tau_sim": None, "tau_sim_all": None, "tau_serve_all": None, "sim_loss": None, "sim_acc": None,
              "tau_ref": None}


@dataclass
class _Decoding:
    """What every drafter of one report is decoded and checked with: the target, the prompts and
    the target's own greedy outputs for them (the lossless reference)."""

    target: Any
    prompts: Sequence[Sequence[int]]
    refs: list[list[int]]
    block_size: int
    max_new_tokens: int
    eos: set[int]
    batch_size: int
    tie_tolerance: float

    def decode(self, drafter: Any, layer_ids: Sequence[int] | None, batch_drafter: Any = None,
               progress: Any = None) -> Any:
        from dflash_stages.evaluate.runs import decode_all

        return decode_all(self.target, self.prompts, drafter, self.block_size, self.max_new_tokens, layer_ids,
                          self.eos, self.batch_size, batch_drafter, progress)

    def check(self, run: Any, who: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(mismatches, near ties) of a run's outputs against the greedy reference."""
        from dflash_stages.evaluate.runs import check_outputs

        return check_outputs(self.target, self.prompts, self.refs, run.tokens, who, self.tie_tolerance)


@dataclass
class Baseline:
    """What a report needs that no drafter changes: the target's greedy reference and the n-gram
    drafter's run through the same loop, with its check against the reference. Every checkpoint of
    a run is served on the same prompts, and these two decodes cost about as much as the drafter's
    own: the evaluate stage makes them once a run (``early_baseline``: at its first checkpoint,
    while training goes on). Reports copy what they take of it."""

    target: Any
    """The model it was decoded with: a report reuses it only with this very object."""
    key: tuple
    """The rest of what it depends on (:func:`baseline_key`)."""
    refs: list[list[int]]
    ref_s: float | None
    """Seconds of the reference decode; None where it was read from a ``reference_dir``."""
    step: int | None = None
    """The checkpoint it was made at (the stage sets it)."""
    ngram: Any = None
    """The n-gram drafter's ``DecodeRun`` (None without the baseline)."""
    ngram_summary: dict[str, Any] | None = None
    ngram_s: float | None = None
    ngram_issues: tuple[list[dict[str, Any]], list[dict[str, Any]]] = field(default_factory=lambda: ([], []))
    """(mismatches, near ties) of the n-gram run against the reference."""

    def fits(self, target: Any, key: tuple) -> bool:
        return self.target is target and self.key == key


def baseline_key(target_name: str, target: Any, prompts: Sequence[Sequence[int]], block_size: int,
                 max_new_tokens: int, eos: set[int], pad_id: int, batch_size: int, tie_tolerance: float,
                 with_ngram: bool, reference_dir: str | None) -> tuple:
    dtype = str(next(target.parameters()).dtype)
    return (target_name, dtype, tuple(map(tuple, prompts)), block_size, max_new_tokens,
            tuple(sorted(eos)), pad_id, batch_size, tie_tolerance, with_ngram, reference_dir)


def prepare_baseline(target: Any, prompts: Sequence[Sequence[int]], block_size: int, max_new_tokens: int = 128,
                     eos_token_id: Iterable[int] | int | None = None, *, baseline: bool = True,
                     batch_size: int = 16, tie_tolerance: float | None = None, pad_id: int = 0,
                     reference_dir: str | None = None, target_name: str = "target",
                     progress: Progress | None = None) -> Baseline:
    """The :class:`Baseline` of drafters of ``block_size`` on ``prompts`` (the n-gram drafter proposes
    as many tokens as they do); the arguments are :func:`evaluate_drafter`'s."""
    from dflash_model.target.spec_decode import eos_set, ngram_drafter
    from dflash_stages.evaluate import runs

    eos = eos_set(eos_token_id)
    tol = tie_tolerance if tie_tolerance is not None else runs.tie_tolerance(target)
    key = baseline_key(target_name, target, prompts, block_size, max_new_tokens, eos, pad_id, batch_size, tol,
                       baseline, reference_dir)
    refs, ref_s = _reference(target, prompts, max_new_tokens, eos, pad_id, batch_size, reference_dir, target_name,
                             progress)
    out = Baseline(target, key, refs, ref_s)
    if baseline:
        dec = _Decoding(target, prompts, refs, block_size, max_new_tokens, eos, batch_size, tol)
        out.ngram = dec.decode(ngram_drafter(), None, progress=_batch_progress(progress, "n-gram", len(prompts)))
        out.ngram_summary = out.ngram.summary(block_size)
        out.ngram_s = out.ngram_summary.pop("seconds")
        out.ngram_issues = dec.check(out.ngram, "ngram")
    return out


def evaluate_drafter(target: Any, drafter: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int = 128,
                     eos_token_id: Iterable[int] | int | None = None, *, baseline: bool = True,
                     with_tau_sim: bool = True, gap_threshold: float = GAP_THRESHOLD, batch_size: int = 16,
                     tie_tolerance: float | None = None, pad_id: int = 0, progress: Progress | None = None,
                     reference_dir: str | None = None, target_name: str = "target",
                     prepared: Baseline | None = None) -> dict[str, Any]:
    """The report of one drafter module on token-id prompts (no files, no tokenizer).

    ``target``: HF causal LM (eval mode); ``drafter``: a DFlashDrafter (as loaded from an export);
    ``tie_tolerance``: relative logit gap of a tolerated near tie (default: ``runs.tie_tolerance``, by
    dtype and FP8 layers);
    ``progress(phase, done, total, tau_so_far)`` as each of its decodes starts (0 done) and after each
    batch: phases ``greedy reference``, ``n-gram`` and ``DFlash`` (``tau_so_far``: None but for the
    drafters', whose τ pools their cycles so far);
    ``reference_dir``: where greedy references are shared with other evaluations (``reference.py``),
    one per ``target_name`` (as its files are now), the target's dtype, the prompts and ``max_new_tokens``;
    ``prepared``: a :class:`Baseline` made before, used where it fits this report.

    In order: the target's greedy reference and the n-gram baseline (:func:`prepare_baseline`), the
    served drafter (τ, throughput), τ_sim, then the verdict (gap, lossless check); ``timing`` has the
    seconds of each part. ``timing.baseline_reused``: the first two came from ``prepared``, made
    before this report (``baseline_step``: at that checkpoint); their seconds and rates are from then.
    """
    from dflash_model.target.capture import embeddings_and_head
    from dflash_model.target.spec_batch import dflash_batch_drafter
    from dflash_model.target.spec_decode import eos_set, dflash_drafter
    from dflash_stages.evaluate import runs

    B = drafter.block_size
    layer_ids = list(drafter.config.target_layer_ids)
    embed, head = embeddings_and_head(target)
    _check_shapes(target, drafter, embed)
    eos = eos_set(eos_token_id)
    tol = tie_tolerance if tie_tolerance is not None else runs.tie_tolerance(target)
    key = baseline_key(target_name, target, prompts, B, max_new_tokens, eos, pad_id, batch_size, tol, baseline,
                       reference_dir)
    reused = prepared is not None and prepared.fits(target, key)
    base = prepared if reused else prepare_baseline(
        target, prompts, B, max_new_tokens, eos, baseline=baseline, batch_size=batch_size, tie_tolerance=tol,
        pad_id=pad_id, reference_dir=reference_dir, target_name=target_name, progress=progress)
    dec = _Decoding(target, prompts, base.refs, B, max_new_tokens, eos, batch_size, tol)
    timing: dict[str, Any] = {"greedy_s": round(base.ref_s, 3) if base.ref_s is not None else None,
                              "baseline_reused": reused, "baseline_step": base.step if reused else None}

    run = dec.decode(dflash_drafter(drafter, embed, head), layer_ids, dflash_batch_drafter(drafter, embed, head),
                     _batch_progress(progress, "DFlash", len(prompts)))
    report: dict[str, Any] = {"block_size": B, "target_layer_ids": layer_ids, "num_prompts": len(prompts),
                              "max_new_tokens": max_new_tokens, "fp8_layers": runs.fp8_layers(target),
                              "reference_dir": reference_dir,
                              **_served_summary(run, dec, base.ref_s, timing)}
    per_prompt = [_prompt_row(i, p, res, B) for i, (p, res) in enumerate(zip(prompts, run.results))]
    mismatches, ties = dec.check(run, "dflash")

    report["ngram"] = report["tau_ngram"] = report["vs_ngram"] = None
    if baseline:
        report["ngram"] = copy.deepcopy(base.ngram_summary)
        report["tau_ngram"] = report["ngram"]["tau"]
        timing["ngram_s"] = base.ngram_s
        ngram_mismatches, ngram_ties = copy.deepcopy(base.ngram_issues)
        mismatches, ties = mismatches + ngram_mismatches, ties + ngram_ties
        for row, res in zip(per_prompt, base.ngram.results):
            row["tau_ngram"] = res.tau
        report["vs_ngram"] = runs.pooled_difference(run, base.ngram)
    report["ngram_split"] = runs.ngram_split(prompts, {"dflash": run, "ngram": base.ngram})

    t0 = time.perf_counter()
    if with_tau_sim:
        clock = {"features": 0.0}
        if progress is not None:
            progress("τ_sim", 0, len(prompts), None)
        report.update(_tau_sim(drafter, target, prompts, run.results, base.refs, per_prompt, embed, head, layer_ids,
                               max_new_tokens, clock))
        if progress is not None:
            progress("τ_sim", len(prompts), len(prompts), None)
        timing["tau_sim_features_s"] = round(clock["features"], 3)
    else:
        report.update(NO_TAU_SIM)
    timing["tau_sim_s"] = round(time.perf_counter() - t0, 3)

    report.update(_verdict(report["tau"], report["tau_sim"], gap_threshold, mismatches, ties, per_prompt, tol))
    report.update({"per_prompt": per_prompt, "timing": timing, "warnings": []})
    add_warnings(report)
    return report


def _reference(target: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: set[int], pad_id: int,
               batch_size: int, reference_dir: str | None, target_name: str, progress: Progress | None = None
               ) -> tuple[list[list[int]], float | None]:
    """The greedy reference and the seconds its decode took (None: read from ``reference_dir``)."""
    from dflash_stages.evaluate import runs

    def decode() -> tuple[list[list[int]], float]:
        def advance(done: int) -> None:
            if progress is not None:
                progress("greedy reference", done, len(prompts), None)

        advance(0)
        return runs.reference_decode(target, prompts, max_new_tokens, eos, pad_id, batch_size, advance)

    if reference_dir is None:
        return decode()
    from dflash_stages.evaluate.reference import reference_key, shared_reference, target_fingerprint

    dtype = str(next(target.parameters()).dtype).replace("torch.", "")
    key = reference_key(target_fingerprint(target_name), dtype, prompts, max_new_tokens)
    return shared_reference(reference_dir, key, target_name, decode)


def _batch_progress(progress: Progress | None, phase: str, total: int) -> Callable[[list[Any]], None]:
    """``decode_all``'s callback (results so far) as ``progress(phase, done, total, tau_so_far)``,
    called once at 0 here: the phase has begun."""
    def advance(results: list[Any]) -> None:
        if progress is not None:
            accepted = [a for r in results for a in r.accepted]
            progress(phase, len(results), total, (sum(accepted) + len(accepted)) / len(accepted) if accepted else None)
    advance([])
    return advance


def _served_summary(run: Any, dec: _Decoding, ref_s: float | None, timing: dict[str, Any]) -> dict[str, Any]:
    """The served drafter's cycles (``DecodeRun.summary``), its rate beside plain greedy decoding's
    under ``throughput``; its seconds go to ``timing``."""
    summary = run.summary(dec.block_size)
    greedy_tokens = sum(map(len, dec.refs))
    summary["throughput"] = {"greedy_tokens_per_s": round(greedy_tokens / ref_s, 1) if ref_s else None,
                             "spec_tokens_per_s": summary.pop("tokens_per_s"), "batch_size": dec.batch_size}
    timing["spec_s"] = summary.pop("seconds")
    timing["spec_draft_s"], timing["spec_verify_s"] = (round(run.phases[p], 3) for p in ("draft", "verify"))
    return summary


def _verdict(tau: float, tau_sim: float | None, gap_threshold: float, mismatches: list[dict[str, Any]],
             ties: list[dict[str, Any]], per_prompt: list[dict[str, Any]], tol: float) -> dict[str, Any]:
    """The train/serve gap and the lossless check (every drafter's mismatches and near ties); marks
    each prompt's row ``lossless``. ``identical`` counts the prompts whose DFlash output is the
    greedy reference."""
    bad = {m["prompt"] for m in mismatches}
    for row in per_prompt:
        row["lossless"] = row["index"] not in bad
    gap, flag = compute_gap(tau, tau_sim, gap_threshold)
    differing = {e["prompt"] for e in mismatches + ties if e["drafter"] == "dflash"}
    return {"gap": gap, "gap_flag": flag, "gap_threshold": gap_threshold, "lossless": not mismatches,
            "mismatches": mismatches, "near_ties": ties, "tie_tolerance": tol,
            "identical": len(per_prompt) - len(differing)}


def _prompt_row(i: int, prompt: Sequence[int], res: Any, B: int) -> dict[str, Any]:
    from dflash_model.target.spec_decode import tau_histogram

    return {"index": i, "prompt_tokens": len(prompt), "generated": len(res.tokens), "tau": res.tau,
            "cycles": res.cycles, "drafted": sum(res.drafted), "accepted": sum(res.accepted),
            "tau_histogram": tau_histogram(res.accepted, B)}


def _tau_sim(drafter: Any, target: Any, prompts: Sequence[Sequence[int]], results: Sequence[Any],
             refs: Sequence[Sequence[int]], per_prompt: list[dict[str, Any]], embed: Any, head: Any,
             layer_ids: list[int], max_new_tokens: int, clock: dict[str, float]) -> dict[str, Any]:
    """τ_sim teacher-forced on each prompt + the drafter's served output, in one pass: at every
    anchor (the trainer's view, with loss and accuracy) and, read from it, at the served full
    blocks' anchors (the gap's basis). ``clock["features"]`` gains the seconds of the target's
    forwards that make the texts' features, their GPU work included (the rest is the drafter's).

    The served output, not the greedy reference: the anchors are positions in it, and in bf16 it
    leaves the reference at near ties, after which the reference is another text. Two drafters
    served on the same prompts are thus scored on different texts (one may fall into a loop that
    the other's text never reaches), so ``tau_ref`` is also measured: the cycles a lossless decode
    of the greedy reference itself would make (:func:`cycles_on_text`). Evaluations that share one
    reference (``reference_dir``) score their drafters on one text, prompt by prompt; each decoding
    its own may not (bf16 near ties)."""
    from dflash_model.target.spec_decode import (cycles_on_text, packed_features, served_tau, teacher_forced_tau,
                                                 timed)
    from dflash_stages.evaluate.runs import sync

    own_ref = [list(res.tokens) != list(ref) for res, ref in zip(results, refs)]  # a text of its own
    texts = []  # each prompt's served text, then its reference where that differs
    for prompt, res, ref, own in zip(prompts, results, refs, own_ref):
        texts += [list(prompt) + list(res.tokens)] + ([list(prompt) + list(ref)] if own else [])
    made = packed_features(target, texts, layer_ids)  # one packed row of texts at a time, in order

    def tau_on(prompt: Sequence[int], completion: Sequence[int]) -> dict[str, Any]:
        with timed(clock, "features"):
            _, features = next(made)
            sync(target)
        return teacher_forced_tau(drafter, target, prompt, completion, embed, head, layer_ids, features)

    at, every, on_ref = [], [], []
    for row, prompt, res, ref, own in zip(per_prompt, prompts, results, refs, own_ref):
        sim_all = tau_on(prompt, res.tokens)
        sim_ref = tau_on(prompt, ref) if own else sim_all
        cycles = cycles_on_text(sim_ref["anchor_tau"], len(prompt), len(prompt) + max_new_tokens, drafter.block_size)
        row["tau_ref"] = served_tau(cycles)
        on_ref.extend(cycles)
        served = [sim_all["anchor_tau"][a] for a, f in zip(res.anchors, res.full) if f and a in sim_all["anchor_tau"]]
        sim = {"tau_sim": sum(served) / len(served) if served else float("nan"), "n_blocks": len(served)}
        row.update(tau_sim=sim["tau_sim"], tau_sim_all=sim_all["tau_sim"], tau_serve_all=sim_all["tau_serve"],
                   sim_loss=sim_all["loss"])
        at.append(sim)
        every.append(sim_all)

    def weighted(sims: list[dict[str, Any]], key: str) -> float | None:
        n = sum(s["n_blocks"] for s in sims)
        return sum(s[key] * s["n_blocks"] for s in sims if s["n_blocks"]) / n if n else None

    def harmonic(sims: list[dict[str, Any]]) -> float | None:  # pools tau_serve: blocks over the sum of 1/τ
        n = sum(s["n_blocks"] for s in sims)
        return n / sum(s["n_blocks"] / s["tau_serve"] for s in sims if s["n_blocks"]) if n else None

    return {"tau_sim": weighted(at, "tau_sim"), "tau_sim_all": weighted(every, "tau_sim"),
            "tau_serve_all": harmonic(every), "sim_loss": weighted(every, "loss"), "sim_acc": weighted(every, "acc"),
            "tau_ref": served_tau(on_ref) if on_ref else None}


def add_warnings(report: dict[str, Any]) -> None:
    """Warning lines for a flagged train/serve gap, a drafter not clearly ahead of n-gram and a
    lossless failure (idempotent)."""
    w: list[str] = []
    if report.get("gap_flag"):
        w.append(f"TRAIN/SERVE GAP: tau_sim {report['tau_sim']:.2f} vs served tau {report['tau']:.2f} "
                 f"({report['gap'] * 100:+.0f}% > {report['gap_threshold'] * 100:.0f}%): training and serving "
                 "differ (context incl. anchor? shifted labels? layer ids ±1? template/thinking? RoPE?)")
    train = (report.get("training") or {}).get("tau_sim_train")
    gap_t, flag_t = compute_gap(report["tau"], train, report.get("gap_threshold", GAP_THRESHOLD))
    report["gap_train"] = gap_t
    report["gap_train_flag"] = flag_t
    if flag_t:
        w.append(f"tau_sim logged in training ({train:.2f}, training data) vs served tau {report['tau']:.2f} "
                 f"({gap_t * 100:+.0f}%)")
    val = (report.get("training") or {}).get("tau_serve_val")
    report["gap_val"] = (val - report["tau"]) / report["tau"] if _finite(val) and report["tau"] > 0 else None
    if report["gap_val"] is not None and abs(report["gap_val"]) > report.get("gap_threshold", GAP_THRESHOLD):
        w.append(f"val_tau_serve, the trainer's walk over its validation documents ({val:.2f}), vs served tau "
                 f"{report['tau']:.2f} ({report['gap_val'] * 100:+.0f}% of it): the walk reads the training "
                 "records' text, the served tau the target's greedy text (sampled records read lower), on other "
                 "prompts")
    vs = report.get("vs_ngram")
    if vs and vs["diff"] < 2 * vs["se"]:
        w.append(f"DFlash does not clearly beat n-gram on these {vs['n']} prompts: served tau {vs['diff']:+.2f} "
                 f"± {vs['se']:.2f} against n-gram's (the difference ± its standard error over prompts; "
                 f"{vs['wins']} prompts won, {vs['losses']} lost), so another sample of prompts may rank the two "
                 "otherwise")
    if not report.get("lossless", True):
        m = report["mismatches"][0]
        w.append(f"NOT LOSSLESS: {len(report['mismatches'])} output(s) differ from the target's greedy decode "
                 f"(first: prompt {m['prompt']}, {m['drafter']}, token {m['index']}, logit gap "
                 f"{m.get('logit_gap', '-')} > tolerance {m.get('tolerance', '-')})")
    if report.get("near_ties"):
        w.append(f"{len(report['near_ties'])} output(s) left the greedy decode at a near tie (logit gap within "
                 f"{report['tie_tolerance']:g} relative: {report.get('dtype', 'low precision')}"
                 f"{' and FP8 activation' if report.get('fp8_layers') else ''} rounding, not "
                 "a failure); identical outputs are not compared past that token")
    report["warnings"] = w


def _check_shapes(target: Any, drafter: Any, embed: Any) -> None:
    from dflash_model.target.layers import decoder_layers

    cfg = drafter.config
    problems = []
    if embed.shape[0] != cfg.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} vs the target's {embed.shape[0]} embedding rows")
    if embed.shape[1] != cfg.hidden_size:
        problems.append(f"hidden_size {cfg.hidden_size} vs the target's {embed.shape[1]}")
    n = len(decoder_layers(target))
    if cfg.num_target_layers != n:
        problems.append(f"num_target_layers {cfg.num_target_layers} vs the target's {n} layers")
    if problems:
        raise EvaluationError("the export was not trained for this target: " + "; ".join(problems))
