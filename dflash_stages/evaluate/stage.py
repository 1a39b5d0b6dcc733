"""evaluate:spec_decode — serve an exported drafter for real and measure its acceptance length τ.

For every (selected) checkpoint the export directory is loaded the way a server loads it
(``load_drafter``: config.json + model.safetensors, nothing from the trainer's memory), the target
runs greedy speculative decoding with it (``spec_batch``: a batch of prompts per verify forward on
dense targets, ``spec_decode`` one prompt at a time on hybrid ones; KV cache, features captured by
hooks during that forward), and the report holds:

* τ — mean accepted drafts + 1 per cycle, its histogram, drafted vs accepted tokens;
* the lossless check — every output against the target's plain greedy decode (HF ``generate``),
  judged at the first differing token: a near tie within the dtype's tolerance is reported, a wider
  gap fails the stage / the command (``eval_runs``);
* τ_ngram — the training-free prompt-lookup baseline through the same loop;
* τ_sim — the same drafter on the same prompts + greedy completions, teacher-forced through the
  training code (``drafter_loss``); ``gap = (τ_sim − τ) / τ_sim``, flagged when |gap| > 10%:
  the signature of something that differs between training and serving (DESIGN §7 pitfalls).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

from dflash_core.paths import PATH_FIELD
from dflash_core.stage import Stage, StageContext
from dflash_stages.generate.prompts import PromptError, build_prompts, eos_ids, read_records

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
    """Steps, final loss / τ_sim, and training time/tokens where the log records them."""
    recs = [r for r in records if "step" in r]
    if not recs:
        return None
    last = recs[-1]
    out: dict[str, Any] = {"steps": int(last["step"]), "records": len(recs),
                           "loss": last.get("loss"), "acc": last.get("acc"),
                           "tau_sim_train": last.get("tau_sim"), "tau_serve_train": last.get("tau_serve")}
    for key in ("elapsed_s", "train_time_s", "time_s", "wall_s"):
        if key in last:
            out["train_time_s"] = float(last[key])
            break
    for key in ("tokens", "tokens_seen", "train_tokens", "total_tokens"):
        if key in last:
            out["train_tokens"] = int(last[key])
            break
    tps = [float(r["tokens_per_s"]) for r in recs if r.get("tokens_per_s")]
    if tps:
        out["tokens_per_s_mean"] = sum(tps) / len(tps)
    return out


# --------------------------------------------------------------------------- evaluation

def _finite(x: float | None) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def compute_gap(tau: float, tau_sim: float | None, threshold: float = GAP_THRESHOLD) -> tuple[float | None, bool]:
    """(gap = (τ_sim − τ) / τ_sim, flagged = |gap| > threshold); (None, False) without τ_sim."""
    if not _finite(tau_sim) or not _finite(tau) or tau_sim <= 0:
        return None, False
    gap = (tau_sim - tau) / tau_sim
    return gap, abs(gap) > threshold


NO_TAU_SIM = {"tau_sim": None, "tau_sim_all": None, "tau_serve_all": None, "sim_loss": None, "sim_acc": None}


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


def evaluate_drafter(target: Any, drafter: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int = 128,
                     eos_token_id: Iterable[int] | int | None = None, *, baseline: bool = True,
                     with_tau_sim: bool = True, gap_threshold: float = GAP_THRESHOLD, batch_size: int = 16,
                     tie_tolerance: float | None = None, pad_id: int = 0, progress: Any = None) -> dict[str, Any]:
    """The report of one drafter module on token-id prompts (no files, no tokenizer).

    ``target``: HF causal LM (eval mode); ``drafter``: a DFlashDrafter (as loaded from an export);
    ``tie_tolerance``: relative logit gap of a tolerated near tie (default by dtype, ``TIE_TOLERANCE``);
    ``progress(done, total, tau_so_far)`` after each batch of the drafter's decodes.

    In order: the target's greedy reference, the served drafter (τ, throughput), the n-gram baseline,
    τ_sim, then the verdict (gap, lossless check); ``timing`` has the seconds of each part.
    """
    from dflash_stages.evaluate import runs
    from dflash_model.target.spec_batch import dflash_batch_drafter
    from dflash_model.target.spec_decode import eos_set, dflash_drafter
    from dflash_model.target.capture import embeddings_and_head

    B = drafter.block_size
    layer_ids = list(drafter.config.target_layer_ids)
    embed, head = embeddings_and_head(target)
    _check_shapes(target, drafter, embed)
    eos = eos_set(eos_token_id)
    tol = (tie_tolerance if tie_tolerance is not None
           else runs.TIE_TOLERANCE.get(next(target.parameters()).dtype, 1e-4))
    refs, ref_s = runs.reference_decode(target, prompts, max_new_tokens, eos, pad_id, batch_size)
    dec = _Decoding(target, prompts, refs, B, max_new_tokens, eos, batch_size, tol)
    timing: dict[str, Any] = {"greedy_s": round(ref_s, 3)}

    run = dec.decode(dflash_drafter(drafter, embed, head), layer_ids, dflash_batch_drafter(drafter, embed, head),
                     _batch_progress(progress, len(prompts)))
    report: dict[str, Any] = {"block_size": B, "target_layer_ids": layer_ids, "num_prompts": len(prompts),
                              "max_new_tokens": max_new_tokens, **_served_summary(run, dec, ref_s, timing)}
    per_prompt = [_prompt_row(i, p, res, B) for i, (p, res) in enumerate(zip(prompts, run.results))]
    mismatches, ties = dec.check(run, "dflash")

    report["ngram"] = None
    if baseline:
        report["ngram"], m, t = _ngram_baseline(dec, per_prompt, timing)
        mismatches, ties = mismatches + m, ties + t
    report["tau_ngram"] = report["ngram"]["tau"] if baseline else None

    t0 = time.perf_counter()
    report.update(_tau_sim(drafter, target, prompts, run.results, per_prompt, embed, head, layer_ids)
                  if with_tau_sim else NO_TAU_SIM)
    timing["tau_sim_s"] = round(time.perf_counter() - t0, 3)

    report.update(_verdict(report["tau"], report["tau_sim"], gap_threshold, mismatches, ties, per_prompt, tol))
    report.update({"per_prompt": per_prompt, "timing": timing, "warnings": []})
    add_warnings(report)
    return report


def _batch_progress(progress: Any, total: int) -> Any:
    """``decode_all``'s callback (results so far) as ``progress(done, total, tau_so_far)``."""
    def advance(results: list[Any]) -> None:
        if progress is not None:
            accepted = [a for r in results for a in r.accepted]
            progress(len(results), total, (sum(accepted) + len(accepted)) / len(accepted) if accepted else None)
    return advance


def _served_summary(run: Any, dec: _Decoding, ref_s: float, timing: dict[str, Any]) -> dict[str, Any]:
    """The served drafter's cycles (``DecodeRun.summary``), its rate beside plain greedy decoding's
    under ``throughput``; its seconds go to ``timing``."""
    summary = run.summary(dec.block_size)
    greedy_tokens = sum(map(len, dec.refs))
    summary["throughput"] = {"greedy_tokens_per_s": round(greedy_tokens / ref_s, 1) if ref_s else None,
                             "spec_tokens_per_s": summary.pop("tokens_per_s"), "batch_size": dec.batch_size}
    timing["spec_s"] = summary.pop("seconds")
    return summary


def _ngram_baseline(dec: _Decoding, per_prompt: list[dict[str, Any]], timing: dict[str, Any]
                    ) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """The training-free prompt-lookup drafter through the same loop: (its summary, mismatches,
    near ties); each prompt's row gets its ``tau_ngram``, ``timing`` its seconds."""
    from dflash_model.target.spec_decode import ngram_drafter

    ng = dec.decode(ngram_drafter(), None)
    summary = ng.summary(dec.block_size)
    timing["ngram_s"] = summary.pop("seconds")
    mismatches, ties = dec.check(ng, "ngram")
    for row, res in zip(per_prompt, ng.results):
        row["tau_ngram"] = res.tau
    return summary, mismatches, ties


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
             per_prompt: list[dict[str, Any]], embed: Any, head: Any, layer_ids: list[int]) -> dict[str, Any]:
    """τ_sim teacher-forced on each prompt + the drafter's served output: at the served full blocks'
    anchors (the gap's basis) and at every anchor (the trainer's view, with loss and accuracy).

    The served output, not the greedy reference: the anchors are positions in it, and in bf16 it
    leaves the reference at near ties, after which the reference is another text."""
    import torch

    from dflash_model.target.spec_decode import teacher_forced_tau
    from dflash_model.target.capture import FeatureCapture

    capture = FeatureCapture(target, layer_ids)
    dev = next(target.parameters()).device
    at, every = [], []
    for row, prompt, res in zip(per_prompt, prompts, results):
        anchors = [a for a, f in zip(res.anchors, res.full) if f]
        out = res.tokens
        feats = capture.capture(torch.tensor([list(prompt) + list(out)], device=dev))[0][0]  # one forward, two uses
        sim = teacher_forced_tau(drafter, target, prompt, out, embed, head, layer_ids, anchors=anchors, features=feats)
        sim_all = teacher_forced_tau(drafter, target, prompt, out, embed, head, layer_ids, features=feats)
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
            "tau_serve_all": harmonic(every), "sim_loss": weighted(every, "loss"), "sim_acc": weighted(every, "acc")}


def add_warnings(report: dict[str, Any]) -> None:
    """Warning lines for a flagged train/serve gap and a lossless failure (idempotent)."""
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
    if not report.get("lossless", True):
        m = report["mismatches"][0]
        w.append(f"NOT LOSSLESS: {len(report['mismatches'])} output(s) differ from the target's greedy decode "
                 f"(first: prompt {m['prompt']}, {m['drafter']}, token {m['index']}, logit gap "
                 f"{m.get('logit_gap', '-')} > tolerance {m.get('tolerance', '-')})")
    if report.get("near_ties"):
        w.append(f"{len(report['near_ties'])} output(s) left the greedy decode at a near tie (logit gap within "
                 f"{report['tie_tolerance']:g} relative: {report.get('dtype', 'low precision')} rounding, not "
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


def evaluate_export(export: str, *, target: str | None = None, prompts: str | Sequence[Sequence[int]] | None = None,
                    num_prompts: int | None = None, max_new_tokens: int = 128, device: str = "cpu",
                    dtype: str = "auto", out_dir: str | None = None, metrics: str | None = None,
                    loaded_target: tuple[Any, Any] | None = None, baseline: bool = True,
                    gap_threshold: float = GAP_THRESHOLD, plot: bool = True, progress: Any = None,
                    batch_size: int = 16, tie_tolerance: float | None = None) -> dict[str, Any]:
    """Evaluate an export directory as a server would; writes report.json (+ PNG) to ``out_dir``.

    Defaults come from the export's ``config.json`` ``dflash_pipe`` metadata (target, tokenizer,
    thinking, heldout prompts, metrics log). ``prompts`` may be a JSONL path or token-id lists;
    ``loaded_target`` = an already loaded (model, tokenizer) to reuse. Does not raise on a lossless
    failure: check ``report["lossless"]``.
    """
    from dflash_model.drafter import load_drafter
    from dflash_model.target.load import load_target, resolve_dtype

    t_start = time.perf_counter()
    cfg = _export_config(export)
    meta = dict(cfg.get("dflash_pipe") or {})
    target_ref = target or meta.get("target")
    if loaded_target is None:
        if not target_ref:
            raise EvaluationError(f"{export}: no target recorded in config.json (dflash_pipe.target); "
                                  "pass --target")
        loaded_target = load_target(str(target_ref), device=device, dtype=dtype)
    lm, tok = loaded_target
    torch_dtype = next(lm.parameters()).dtype if dtype == "auto" else resolve_dtype(dtype, device)
    drafter = load_drafter(export, device=device, dtype=torch_dtype, attn_backend="sdpa")
    drafter.eval()

    prompt_ids, prompt_desc = _prompt_ids(export, prompts, num_prompts, meta, target_ref, tok)
    pad = getattr(tok, "pad_token_id", None)
    report = evaluate_drafter(lm, drafter, prompt_ids, max_new_tokens, eos_ids(lm, tok), baseline=baseline,
                              gap_threshold=gap_threshold, batch_size=batch_size, tie_tolerance=tie_tolerance,
                              pad_id=pad if pad is not None else 0, progress=progress)
    metrics_path = metrics or meta.get("metrics")
    records = read_metrics(metrics_path)
    report.update({"export": str(export), "step": meta.get("step"), "target": target_ref,
                   "prompts": prompt_desc, "device": str(device), "dtype": str(torch_dtype).replace("torch.", ""),
                   "metrics_file": metrics_path if records else None,
                   "training": training_summary(records)})
    add_warnings(report)
    report["timing"]["total_s"] = round(time.perf_counter() - t_start, 3)
    if out_dir:
        from dflash_stages.evaluate.report import write_outputs

        report["files"] = write_outputs(report, out_dir, records if plot else None, plot=plot)
    return report


def _prompt_ids(export: str, prompts: str | Sequence[Sequence[int]] | None, num_prompts: int | None,
                meta: Mapping[str, Any], target_ref: str | None, tok: Any) -> tuple[list[list[int]], str]:
    """(token ids of each prompt, where they came from): ``prompts`` as a JSONL path (records put
    through the run's chat template and thinking setting) or token-id lists, else the held-out set
    recorded in the export."""
    prompt_src = prompts if prompts is not None else meta.get("heldout")
    if prompt_src is None:
        raise EvaluationError(f"{export}: no held-out prompts recorded (dflash_pipe.heldout); pass --prompts")
    if isinstance(prompt_src, str):
        records = read_records(prompt_src, num_prompts)
        tokenizer = _tokenizer(meta, target_ref, tok)
        try:
            prompt_ids = build_prompts(tokenizer, records, meta.get("thinking"), meta.get("chat_template_kwargs"))
        except PromptError as exc:
            raise EvaluationError(f"{prompt_src}: {exc}") from None
        prompt_desc = prompt_src
    else:
        prompt_ids = [list(p) for p in prompt_src][:num_prompts]
        prompt_desc = f"{len(prompt_ids)} token-id prompts"
    if not prompt_ids:
        raise EvaluationError(f"no prompts in {prompt_desc}")
    return prompt_ids, prompt_desc


def _export_config(export: str) -> dict[str, Any]:
    """The export's config.json, or an error that says what an export directory holds."""
    from dflash_model.drafter import read_export_config

    try:
        cfg = read_export_config(export)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, json.JSONDecodeError) as exc:
        cfg, why = None, f"{type(exc).__name__}: {exc}"
    else:
        why = f"its config.json has architectures {cfg.get('architectures')}"
    if cfg is None or "DFlashDraftModel" not in (cfg.get("architectures") or []):
        raise EvaluationError(
            f"{export} is not an exported drafter ({why}). An export directory holds config.json "
            "(architectures [DFlashDraftModel], dflash_config), model.safetensors and modeling_dflash.py; "
            "the checkpoint stage writes one per checkpoint at RUN_DIR/checkpoints/step-NNNNNNN/export "
            "(the run's summary prints the latest)")
    return cfg


def _tokenizer(meta: Mapping[str, Any], target_ref: str | None, tok: Any) -> Any:
    """The tokenizer recorded with the run if it differs from the target's, else the target's."""
    ref = meta.get("tokenizer")
    if not ref or ref == target_ref or tok is None:
        if tok is None:
            raise EvaluationError("the target came without a tokenizer: pass token-id prompts")
        return tok
    if ref == "smollm2":
        from dflash_model.target.smollm2 import load_smollm2_tokenizer

        return load_smollm2_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ref)


# --------------------------------------------------------------------------- the stage

@dataclass
class EvaluateConfig:
    every: int = 1
    """Evaluate every N-th checkpoint (and always the final one)."""
    prompts: str | None = field(default=None, metadata=PATH_FIELD)
    """JSONL of records (DESIGN §6); default: the held-out set recorded in the export."""
    num_prompts: int = 16
    """Prompts used (the first N of the file)."""
    max_new_tokens: int = 128
    """Tokens generated per prompt."""
    target: str | None = None
    """Target model (path, hub name, smollm2); default: the one recorded in the export."""
    device: str | None = None
    """Device of target and drafter; default: the stage's device."""
    dtype: str = "auto"
    """Target/drafter dtype: auto (bf16 on CUDA, fp32 on CPU), bfloat16, float16, float32."""
    gap_threshold: float = GAP_THRESHOLD
    """Flag |τ_sim − τ| / τ_sim above this."""
    fail_on_gap: bool = False
    """Also fail the stage when the train/serve gap is flagged (a lossless failure always fails)."""
    baseline: bool = True
    """Also measure the n-gram (prompt lookup) baseline."""
    batch_size: int = 16
    """Prompts decoded together (one target forward per cycle for all of them; dense targets)."""
    tie_tolerance: float | None = None
    """Relative logit gap of a near tie the lossless check tolerates; default by dtype (fp32 1e-4, bf16 5e-2)."""

    def __post_init__(self) -> None:
        if self.every < 1 or self.batch_size < 1:
            raise ValueError("every and batch_size must be >= 1")
        if self.tie_tolerance is not None and not 0 <= self.tie_tolerance < 1:
            raise ValueError("tie_tolerance must be in [0, 1)")
        if self.num_prompts < 1 or self.max_new_tokens < 1:
            raise ValueError("num_prompts and max_new_tokens must be >= 1")
        if not 0 < self.gap_threshold < 1:
            raise ValueError("gap_threshold must be in (0, 1)")


class SpecDecodeEvaluate(Stage):
    """Real greedy speculative decoding of each selected checkpoint's export → τ report."""

    kind = "evaluate"
    name = "spec_decode"
    preload = ("transformers:AutoTokenizer", "transformers:AutoModelForCausalLM")
    version = "1"
    Config = EvaluateConfig
    inputs = ("checkpoints",)
    default_link = "stream"
    default_executor = "thread"
    needs_torch = True

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        cfg: EvaluateConfig = self.config
        device = cfg.device or ctx.device or "cpu"
        targets: dict[str, tuple[Any, Any]] = {}
        seen = 0
        for item in inputs["checkpoints"]:
            if not isinstance(item, Mapping) or item.get("kind") != "checkpoint":
                continue
            seen += 1
            if not (item.get("final") or seen % cfg.every == 0):
                continue
            if ctx.should_stop():
                return
            export = str(item["export"])
            meta = (_read_meta(export) or {})
            ref = cfg.target or meta.get("target")
            if not ref:
                raise EvaluationError(f"{export}: no target in params or in the export's metadata")
            if ref not in targets:
                from dflash_model.target.load import load_target

                targets.clear()
                targets[ref] = load_target(str(ref), device=device, dtype=cfg.dtype)
            step = item.get("step")
            out_dir = os.path.join(ctx.work_dir, f"step-{int(step):07d}" if step is not None else "eval")
            ctx.progress(0, unit="checkpoints")
            report = evaluate_export(export, target=ref, prompts=cfg.prompts, num_prompts=cfg.num_prompts,
                                     max_new_tokens=cfg.max_new_tokens, device=device, dtype=cfg.dtype,
                                     out_dir=out_dir, loaded_target=targets[ref], baseline=cfg.baseline,
                                     gap_threshold=cfg.gap_threshold, batch_size=cfg.batch_size,
                                     tie_tolerance=cfg.tie_tolerance)
            report["step"] = step if step is not None else report.get("step")
            report["final"] = bool(item.get("final"))
            summary = {k: _round(report.get(k)) for k in ("tau", "tau_ngram", "tau_sim", "gap")}
            summary.update(gap_flag=report["gap_flag"], lossless=report["lossless"], step=report["step"],
                           report=(report.get("files") or {}).get("json"))
            ctx.summary.update(summary)
            ctx.emit({"type": "metrics", "step": report["step"], "eval_tau": report["tau"],
                      "eval_tau_ngram": report["tau_ngram"], "eval_tau_sim": report["tau_sim"],
                      "eval_gap_flag": report["gap_flag"]})
            for line in report["warnings"]:
                ctx.logger.warning("step %s: %s", report["step"], line)
            ctx.progress(1, unit="checkpoints")
            yield {"kind": "eval_report", **report}
            if not report["lossless"]:
                raise LosslessError(report["warnings"][-1])
            if cfg.fail_on_gap and report["gap_flag"]:
                raise EvaluationError(report["warnings"][0])

    @classmethod
    def report(cls, summary: dict[str, Any]) -> Any:
        from dflash_stages.evaluate.report import summary_table

        return summary_table(summary) if summary.get("tau") is not None else None


def _read_meta(export: str) -> dict[str, Any] | None:
    from dflash_model.drafter import read_export_config

    try:
        return read_export_config(export).get("dflash_pipe")
    except (FileNotFoundError, OSError, json.JSONDecodeError):
        return None


def _round(x: Any) -> Any:
    return round(x, 3) if isinstance(x, float) and not math.isnan(x) else x
