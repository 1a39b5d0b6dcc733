"""evaluate:spec_decode — serve an exported drafter for real and measure its acceptance length τ.

For every (selected) checkpoint the export directory is loaded the way a server loads it
(``load_drafter``: config.json + model.safetensors, nothing from the trainer's memory), the target
runs greedy speculative decoding with it (``spec_decode.speculative_decode``: KV cache, one verify
forward per block, features captured by hooks during that forward), and the report holds:

* τ — mean accepted drafts + 1 per cycle, its histogram, drafted vs accepted tokens;
* the lossless check — every output equal, token for token, to the target's plain greedy decode
  (a mismatch fails the stage / the command);
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

GAP_THRESHOLD = 0.10


class EvaluationError(RuntimeError):
    """A problem with the inputs of an evaluation (no target, no prompts, mismatched shapes)."""


class LosslessError(RuntimeError):
    """Speculative decoding produced something other than the target's greedy decode."""


# --------------------------------------------------------------------------- prompts

def record_messages(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conversation a server would be handed for a DESIGN §6 record: ``messages`` up to (not
    including) the last assistant message, or the ``prompt`` (a string = one user message)."""
    if "messages" in record:
        msgs = list(record["messages"])
        last = max((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), default=None)
        msgs = msgs[:last] if last is not None else msgs
    elif "prompt" in record:
        p = record["prompt"]
        msgs = [{"role": "user", "content": p}] if isinstance(p, str) else list(p)
        if isinstance(p, str) and record.get("system") is not None:
            msgs.insert(0, {"role": "system", "content": record["system"]})
    else:
        raise EvaluationError(f"record has neither 'messages' nor 'prompt': keys {sorted(record)[:8]}")
    if not msgs:
        raise EvaluationError("record has no prompt messages")
    return [{k: v for k, v in m.items() if k in ("role", "content", "tool_calls", "name")} for m in msgs]


def read_records(path: str, limit: int | None = None) -> list[dict[str, Any]]:
    """JSONL records (blank lines skipped), at most ``limit``."""
    import fsspec

    out: list[dict[str, Any]] = []
    with fsspec.open(path, "r", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line))
                if limit is not None and len(out) >= limit:
                    break
    return out


def build_prompts(tokenizer: Any, records: Iterable[Mapping[str, Any]], thinking: bool | None = None,
                  chat_template_kwargs: Mapping[str, Any] | None = None) -> list[list[int]]:
    """Token ids of each record's prompt via the tokenizer's chat template (generation prompt on,
    ``enable_thinking`` as recorded), tokenized without extra special tokens like the tokenize stage."""
    kw = dict(chat_template_kwargs or {})
    if thinking is not None:
        kw.setdefault("enable_thinking", bool(thinking))
    prompts = []
    for rec in records:
        text = tokenizer.apply_chat_template(record_messages(rec), tokenize=False,
                                             add_generation_prompt=True, **kw)
        prompts.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return prompts


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """End-of-generation ids: the tokenizer's eos plus the model's generation config eos."""
    ids: set[int] = set()
    for src in (getattr(tokenizer, "eos_token_id", None),
                getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if src is None:
            continue
        ids.update([int(src)] if isinstance(src, int) else [int(x) for x in src])
    return ids


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
                           "tau_sim_train": last.get("tau_sim")}
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

def _mean_tau(accepted: int, cycles: int) -> float:
    return (accepted + cycles) / cycles if cycles else float("nan")


def _finite(x: float | None) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def compute_gap(tau: float, tau_sim: float | None, threshold: float = GAP_THRESHOLD) -> tuple[float | None, bool]:
    """(gap = (τ_sim − τ) / τ_sim, flagged = |gap| > threshold); (None, False) without τ_sim."""
    if not _finite(tau_sim) or not _finite(tau) or tau_sim <= 0:
        return None, False
    gap = (tau_sim - tau) / tau_sim
    return gap, abs(gap) > threshold


def evaluate_drafter(target: Any, drafter: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int = 128,
                     eos_token_id: Iterable[int] | int | None = None, *, baseline: bool = True,
                     with_tau_sim: bool = True, gap_threshold: float = GAP_THRESHOLD,
                     progress: Any = None) -> dict[str, Any]:
    """The report of one drafter module on token-id prompts (no files, no tokenizer).

    ``target``: HF causal LM (eval mode); ``drafter``: a DFlashDrafter (as loaded from an export).
    """
    from dflash_stages.spec_decode import (dflash_drafter, first_mismatch, greedy_decode, ngram_drafter,
                                           speculative_decode, tau_histogram, teacher_forced_tau)
    from dflash_stages.target import embeddings_and_head

    B = drafter.block_size
    layer_ids = list(drafter.config.target_layer_ids)
    embed, head = embeddings_and_head(target)
    _check_shapes(target, drafter, embed)
    draft_fn = dflash_drafter(drafter, embed, head)
    per_prompt, mismatches = [], []
    tot = {"full_accepted": 0, "full_cycles": 0, "ng_full_accepted": 0, "ng_full_cycles": 0, "drafted": 0,
           "accepted": 0, "cycles": 0, "generated": 0, "ng_drafted": 0, "ng_accepted": 0, "ng_cycles": 0,
           "sim_blocks": 0, "sim_tau_sum": 0.0, "all_blocks": 0, "all_tau_sum": 0.0, "sim_loss_sum": 0.0,
           "sim_acc_sum": 0.0}
    hist = [0] * (B + 1)
    hist_ng = [0] * (B + 1)
    timing = {"greedy_s": 0.0, "spec_s": 0.0, "ngram_s": 0.0, "tau_sim_s": 0.0}
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        ref = greedy_decode(target, prompt, max_new_tokens, eos_token_id)
        t1 = time.perf_counter()
        res = speculative_decode(target, prompt, draft_fn, B, max_new_tokens, layer_ids, eos_token_id)
        t2 = time.perf_counter()
        timing["greedy_s"] += t1 - t0
        timing["spec_s"] += t2 - t1
        fa = [a for a, f in zip(res.accepted, res.full) if f]
        row: dict[str, Any] = {"index": i, "prompt_tokens": len(prompt), "generated": len(ref),
                               "tau": _mean_tau(sum(fa), len(fa)) if fa else res.mean_tau, "cycles": res.cycles,
                               "drafted": sum(res.drafted), "accepted": sum(res.accepted),
                               "tau_histogram": tau_histogram(res.accepted, B)}
        bad = first_mismatch(ref, res.tokens)
        row["lossless"] = bad is None
        if bad is not None:
            mismatches.append(_mismatch(i, "dflash", bad, ref, res.tokens))
        for k, v in zip(range(B + 1), row["tau_histogram"]):
            hist[k] += v
        tot["full_accepted"] += sum(fa)
        tot["full_cycles"] += len(fa)
        tot["drafted"] += row["drafted"]
        tot["accepted"] += row["accepted"]
        tot["cycles"] += res.cycles
        tot["generated"] += len(res.tokens)
        if baseline:
            t3 = time.perf_counter()
            ng = speculative_decode(target, prompt, ngram_drafter(), B, max_new_tokens, None, eos_token_id)
            timing["ngram_s"] += time.perf_counter() - t3
            nfa = [a for a, f in zip(ng.accepted, ng.full) if f]
            row["tau_ngram"] = _mean_tau(sum(nfa), len(nfa)) if nfa else ng.mean_tau
            tot["ng_full_accepted"] += sum(nfa)
            tot["ng_full_cycles"] += len(nfa)
            bad = first_mismatch(ref, ng.tokens)
            if bad is not None:
                row["lossless"] = False
                mismatches.append(_mismatch(i, "ngram", bad, ref, ng.tokens))
            for k, v in enumerate(tau_histogram(ng.accepted, B)):
                hist_ng[k] += v
            tot["ng_drafted"] += sum(ng.drafted)
            tot["ng_accepted"] += sum(ng.accepted)
            tot["ng_cycles"] += ng.cycles
        if with_tau_sim:
            t4 = time.perf_counter()
            full_anchors = [a for a, f in zip(res.anchors, res.full) if f]
            sim = teacher_forced_tau(drafter, target, prompt, ref, embed, head, layer_ids, anchors=full_anchors)
            sim_all = teacher_forced_tau(drafter, target, prompt, ref, embed, head, layer_ids)
            timing["tau_sim_s"] += time.perf_counter() - t4
            row["tau_sim"] = sim["tau_sim"]
            row["tau_sim_all"] = sim_all["tau_sim"]
            row["sim_loss"] = sim_all["loss"]
            if sim["n_blocks"]:
                n = sim["n_blocks"]
                tot["sim_blocks"] += n
                tot["sim_tau_sum"] += sim["tau_sim"] * n
            if sim_all["n_blocks"]:
                n = sim_all["n_blocks"]
                tot["all_blocks"] += n
                tot["all_tau_sum"] += sim_all["tau_sim"] * n
                tot["sim_loss_sum"] += sim_all["loss"] * n
                tot["sim_acc_sum"] += sim_all["acc"] * n
        per_prompt.append(row)
        if progress is not None:
            progress(row)
    # τ over cycles with a whole block of draft budget (the last cycles before max_new_tokens are
    # cut short and would bias short generations down); tau_all counts every cycle
    tau = (_mean_tau(tot["full_accepted"], tot["full_cycles"]) if tot["full_cycles"]
           else _mean_tau(tot["accepted"], tot["cycles"]))
    tau_ng = (_mean_tau(tot["ng_full_accepted"], tot["ng_full_cycles"]) if tot["ng_full_cycles"]
              else _mean_tau(tot["ng_accepted"], tot["ng_cycles"]))
    tau_sim = tot["sim_tau_sum"] / tot["sim_blocks"] if tot["sim_blocks"] else None
    gap, flag = compute_gap(tau, tau_sim, gap_threshold)
    report: dict[str, Any] = {
        "block_size": B, "target_layer_ids": layer_ids, "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "tau": tau, "tau_ngram": tau_ng if baseline else None,
        "tau_all": _mean_tau(tot["accepted"], tot["cycles"]), "full_cycles": tot["full_cycles"],
        "tau_sim": tau_sim,
        "tau_sim_all": tot["all_tau_sum"] / tot["all_blocks"] if tot["all_blocks"] else None,
        "sim_loss": tot["sim_loss_sum"] / tot["all_blocks"] if tot["all_blocks"] else None,
        "sim_acc": tot["sim_acc_sum"] / tot["all_blocks"] if tot["all_blocks"] else None,
        "gap": gap, "gap_flag": flag, "gap_threshold": gap_threshold,
        "lossless": not mismatches, "mismatches": mismatches,
        "tau_histogram": hist, "cycles": tot["cycles"], "drafted": tot["drafted"], "accepted": tot["accepted"],
        "acceptance_rate": tot["accepted"] / tot["drafted"] if tot["drafted"] else None,
        "generated_tokens": tot["generated"],
        "ngram": ({"tau": tau_ng, "tau_all": _mean_tau(tot["ng_accepted"], tot["ng_cycles"]), "tau_histogram": hist_ng,
                   "cycles": tot["ng_cycles"], "drafted": tot["ng_drafted"], "accepted": tot["ng_accepted"]}
                  if baseline else None),
        "per_prompt": per_prompt, "timing": {k: round(v, 3) for k, v in timing.items()},
        "warnings": [],
    }
    add_warnings(report)
    return report


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
                 f"(first: prompt {m['prompt']}, {m['drafter']}, token {m['index']})")
    report["warnings"] = w


def _mismatch(i: int, who: str, at: int, ref: Sequence[int], got: Sequence[int]) -> dict[str, Any]:
    return {"prompt": i, "drafter": who, "index": at,
            "expected": list(ref[at:at + 8]), "got": list(got[at:at + 8])}


def _check_shapes(target: Any, drafter: Any, embed: Any) -> None:
    from dflash_stages.target import decoder_layers

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
                    ) -> dict[str, Any]:
    """Evaluate an export directory as a server would; writes report.json (+ PNG) to ``out_dir``.

    Defaults come from the export's ``config.json`` ``dflash_pipe`` metadata (target, tokenizer,
    thinking, heldout prompts, metrics log). ``prompts`` may be a JSONL path or token-id lists;
    ``loaded_target`` = an already loaded (model, tokenizer) to reuse. Does not raise on a lossless
    failure: check ``report["lossless"]``.
    """
    from dflash_core.drafter import load_drafter, read_export_config
    from dflash_stages.target import load_target, resolve_dtype

    t_start = time.perf_counter()
    cfg = read_export_config(export)
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

    prompt_src = prompts if prompts is not None else meta.get("heldout")
    if prompt_src is None:
        raise EvaluationError(f"{export}: no held-out prompts recorded (dflash_pipe.heldout); pass --prompts")
    if isinstance(prompt_src, str):
        records = read_records(prompt_src, num_prompts)
        tokenizer = _tokenizer(meta, target_ref, tok)
        prompt_ids = build_prompts(tokenizer, records, meta.get("thinking"), meta.get("chat_template_kwargs"))
        prompt_desc = prompt_src
    else:
        prompt_ids = [list(p) for p in prompt_src][:num_prompts]
        prompt_desc = f"{len(prompt_ids)} token-id prompts"
    if not prompt_ids:
        raise EvaluationError(f"no prompts in {prompt_desc}")

    report = evaluate_drafter(lm, drafter, prompt_ids, max_new_tokens, eos_ids(lm, tok), baseline=baseline,
                              gap_threshold=gap_threshold, progress=progress)
    metrics_path = metrics or meta.get("metrics")
    records = read_metrics(metrics_path)
    report.update({"export": str(export), "step": meta.get("step"), "target": target_ref,
                   "prompts": prompt_desc, "device": str(device), "dtype": str(torch_dtype).replace("torch.", ""),
                   "metrics_file": metrics_path if records else None,
                   "training": training_summary(records)})
    add_warnings(report)
    report["timing"]["total_s"] = round(time.perf_counter() - t_start, 3)
    if out_dir:
        from dflash_stages.eval_report import write_outputs

        report["files"] = write_outputs(report, out_dir, records if plot else None, plot=plot)
    return report


def _tokenizer(meta: Mapping[str, Any], target_ref: str | None, tok: Any) -> Any:
    """The tokenizer recorded with the run if it differs from the target's, else the target's."""
    ref = meta.get("tokenizer")
    if not ref or ref == target_ref or tok is None:
        if tok is None:
            raise EvaluationError("the target came without a tokenizer: pass token-id prompts")
        return tok
    if ref == "smollm2":
        from dflash_stages.smollm2 import load_smollm2_tokenizer

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

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError("every must be >= 1")
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
                from dflash_stages.target import load_target

                targets.clear()
                targets[ref] = load_target(str(ref), device=device, dtype=cfg.dtype)
            step = item.get("step")
            out_dir = os.path.join(ctx.work_dir, f"step-{int(step):07d}" if step is not None else "eval")
            ctx.progress(0, unit="checkpoints")
            report = evaluate_export(export, target=ref, prompts=cfg.prompts, num_prompts=cfg.num_prompts,
                                     max_new_tokens=cfg.max_new_tokens, device=device, dtype=cfg.dtype,
                                     out_dir=out_dir, loaded_target=targets[ref], baseline=cfg.baseline,
                                     gap_threshold=cfg.gap_threshold)
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
        from dflash_stages.eval_report import summary_table

        return summary_table(summary) if summary.get("tau") is not None else None


def _read_meta(export: str) -> dict[str, Any] | None:
    from dflash_core.drafter import read_export_config

    try:
        return read_export_config(export).get("dflash_pipe")
    except (FileNotFoundError, OSError, json.JSONDecodeError):
        return None


def _round(x: Any) -> Any:
    return round(x, 3) if isinstance(x, float) and not math.isnan(x) else x
