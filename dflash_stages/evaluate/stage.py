"""evaluate:spec_decode — serve each selected checkpoint's export for real and report its τ
(``export.evaluate_export``); the ``dflash-pipe evaluate`` command is ``cli.py``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

from dflash_core.items import CHECKPOINT, EVAL_REPORT, of_kind
from dflash_core.paths import PATH_FIELD
from dflash_core.stage import Stage, StageContext
from dflash_model.fast.settings import DtypeName
from dflash_stages.evaluate.drafter import (GAP_THRESHOLD, Baseline, EvaluationError, LosslessError, Progress,
                                            progress_line)
from dflash_stages.evaluate.export import evaluate_export, export_baseline


@dataclass
class EvaluateConfig:
    every: int = field(default=1, metadata={
        "help": "Evaluate every N-th checkpoint (and always the final one)."})
    prompts: str | None = field(default=None, metadata={
        **PATH_FIELD, "help": "JSONL of records (docs/tokenize.md, 'Input records'); default: the held-out set "
                              "recorded in the export."})
    num_prompts: int = field(default=16, metadata={"help": "Prompts used (the first N of the file)."})
    max_new_tokens: int = field(default=128, metadata={"help": "Tokens generated per prompt."})
    target: str | None = field(default=None, metadata={
        "help": "Target model (path, hub name, smollm2); default: the one recorded in the export."})
    device: str | None = field(default=None, metadata={
        "help": "Device of target and drafter; default: the stage's device."})
    dtype: DtypeName = field(default="auto", metadata={
        "help": "Target/drafter dtype: auto (bf16 on CUDA, fp32 on CPU), bfloat16, float16, float32."})
    gap_threshold: float = field(default=GAP_THRESHOLD, metadata={
        "help": "Flag |τ_sim − τ| / τ_sim above this."})
    fail_on_gap: bool = field(default=False, metadata={
        "help": "Also fail the stage when the train/serve gap is flagged (a lossless failure always "
                "fails)."})
    baseline: bool = field(default=True, metadata={
        "help": "Also measure the n-gram (prompt lookup) baseline."})
    batch_size: int = field(default=16, metadata={
        "help": "Prompts decoded together (one target forward per cycle for all of them; dense "
                "targets)."})
    tie_tolerance: float | None = field(default=None, metadata={
        "help": "Relative logit gap of a near tie the lossless check tolerates; default by dtype "
                "(fp32 1e-4, bf16 5e-2)."})
    early_baseline: bool = field(default=True, metadata={
        "help": "Load the target and decode what no drafter changes (the greedy reference, the n-gram "
                "baseline) at the first checkpoint, evaluated or not, while training goes on; every "
                "evaluation then reuses them. False: at the first evaluated checkpoint (the target's "
                "memory is taken then)."})

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
    inputs = {"checkpoints": CHECKPOINT}
    output = EVAL_REPORT
    default_link = "stream"
    default_executor = "thread"
    needs_torch = True

    @classmethod
    def owes_after_training(cls, config: EvaluateConfig, work_dir: str, step: int) -> bool:
        """The final checkpoint is always evaluated: owed while its report is missing."""
        return not os.path.exists(os.path.join(work_dir, _report_dir(step), "report.json"))

    def run(self, inputs: Mapping[str, Iterable[Any]], ctx: StageContext) -> Iterator[Any]:
        cfg: EvaluateConfig = self.config
        device = cfg.device or ctx.device or "cpu"
        targets: dict[str, tuple[Any, Any]] = {}
        prepared: Baseline | None = None
        seen = 0
        for item in of_kind(inputs["checkpoints"], CHECKPOINT, ctx.stage, ctx.upstream("checkpoints")):
            seen += 1
            chosen = item.get("final") or seen % cfg.every == 0
            if not (chosen or (cfg.early_baseline and prepared is None)):
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
                prepared = None  # made with the target let go
                targets[ref] = load_target(str(ref), device=device, dtype=cfg.dtype)
            common = dict(target=ref, prompts=cfg.prompts, num_prompts=cfg.num_prompts,
                          max_new_tokens=cfg.max_new_tokens, device=device, dtype=cfg.dtype,
                          loaded_target=targets[ref], baseline=cfg.baseline, batch_size=cfg.batch_size,
                          tie_tolerance=cfg.tie_tolerance)
            if prepared is None:
                ctx.progress(0, unit="checkpoints")
                ctx.logger.info("evaluate: the greedy reference and n-gram baseline, at step %s", item.get("step"))
                try:
                    prepared = export_baseline(export, progress=_phase_log(ctx, item.get("step")), **common)
                    prepared.step = item.get("step")
                except Exception as exc:  # at a checkpoint it may not evaluate: say which and why
                    raise EvaluationError(f"the greedy reference and n-gram baseline at step {item.get('step')} "
                                          f"({export}): {type(exc).__name__}: {exc}") from exc
            if ctx.should_stop():
                return
            if not chosen:
                continue
            step = item.get("step")
            out_dir = os.path.join(ctx.work_dir, _report_dir(step))
            ctx.progress(0, unit="checkpoints")
            report = evaluate_export(export, out_dir=out_dir, gap_threshold=cfg.gap_threshold, prepared=prepared,
                                     progress=_phase_log(ctx, step), **common)
            report["step"] = step if step is not None else report.get("step")
            report["final"] = bool(item.get("final"))
            summary = {k: _round(report.get(k)) for k in ("tau", "tau_ngram", "tau_sim", "tau_ref", "gap")}
            summary.update(gap_flag=report["gap_flag"], lossless=report["lossless"], step=report["step"],
                           report=(report.get("files") or {}).get("json"))
            ctx.summary.update(summary)
            ctx.emit({"type": "metrics", "step": report["step"], "eval_tau": report["tau"],
                      "eval_tau_ngram": report["tau_ngram"], "eval_tau_sim": report["tau_sim"],
                      "eval_tau_ref": report["tau_ref"], "eval_gap_flag": report["gap_flag"]})
            for line in report["warnings"]:
                ctx.logger.warning("step %s: %s", report["step"], line)
            ctx.progress(1, unit="checkpoints")
            yield {"kind": EVAL_REPORT.kind, **report}
            if not report["lossless"]:
                raise LosslessError(report["warnings"][-1])
            if cfg.fail_on_gap and report["gap_flag"]:
                raise EvaluationError(report["warnings"][0])

    @classmethod
    def report(cls, summary: dict[str, Any]) -> Any:
        from dflash_stages.evaluate.report import summary_table

        return summary_table(summary) if summary.get("tau") is not None else None


def _phase_log(ctx: StageContext, step: int | None) -> Progress:
    """Logs each phase of an evaluation as it starts and ends: the one after the last step runs for
    a minute or more on a GPU job, and its display would otherwise show nothing meanwhile."""
    def log(phase: str, done: int, total: int, tau: float | None) -> None:
        if done in (0, total):
            ctx.logger.info("evaluate: step %s: %s", step, progress_line(phase, done, total, tau))
    return log


def _report_dir(step: int | None) -> str:
    return f"step-{int(step):07d}" if step is not None else "eval"


def _read_meta(export: str) -> dict[str, Any] | None:
    from dflash_model.drafter import read_export_config

    try:
        return read_export_config(export).get("dflash_pipe")
    except (FileNotFoundError, OSError, json.JSONDecodeError):
        return None


def _round(x: Any) -> Any:
    return round(x, 3) if isinstance(x, float) and not math.isnan(x) else x
