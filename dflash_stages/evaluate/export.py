"""Evaluating an exported drafter the way a server loads it: ``load_drafter`` reads config.json +
model.safetensors (nothing from the trainer's memory), then the target, the tokenizer and the
prompts recorded with the run (or given), then ``drafter.evaluate_drafter``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from dflash_stages.evaluate.drafter import (GAP_THRESHOLD, Baseline, EvaluationError, Progress, add_warnings,
                                            evaluate_drafter, prepare_baseline, read_metrics, training_summary)
from dflash_stages.generate.prompts import PromptError, build_prompts, eos_ids, read_records


def evaluate_export(export: str, *, target: str | None = None, prompts: str | Sequence[Sequence[int]] | None = None,
                    num_prompts: int | None = None, max_new_tokens: int = 128, device: str = "cpu",
                    dtype: str = "auto", out_dir: str | None = None, metrics: str | None = None,
                    loaded_target: tuple[Any, Any] | None = None, baseline: bool = True,
                    gap_threshold: float = GAP_THRESHOLD, plot: bool = True, progress: Progress | None = None,
                    batch_size: int = 16, tie_tolerance: float | None = None,
                    reference_dir: str | None = None, prepared: Baseline | None = None) -> dict[str, Any]:
    """Evaluate an export directory as a server would; writes report.json (+ PNG) to ``out_dir``.

    Defaults come from the export's ``config.json`` ``dflash_pipe`` metadata (target, tokenizer,
    thinking, heldout prompts, metrics log). ``prompts`` may be a JSONL path or token-id lists;
    ``loaded_target`` = an already loaded (model, tokenizer) to reuse. Does not raise on a lossless
    failure: check ``report["lossless"]``. ``reference_dir``: where greedy references are shared with
    other evaluations (``reference.py``). ``prepared``: the :class:`Baseline` of
    :func:`export_baseline` for an export of the same run, used where it fits this one.
    """
    from dflash_model.drafter import load_drafter

    t_start = time.perf_counter()
    s = _served(export, target, prompts, num_prompts, device, dtype, loaded_target)
    drafter = load_drafter(export, device=device, dtype=s.torch_dtype, attn_backend="sdpa")
    drafter.eval()
    report = evaluate_drafter(s.lm, drafter, s.prompt_ids, max_new_tokens, s.eos, baseline=baseline,
                              gap_threshold=gap_threshold, batch_size=batch_size, tie_tolerance=tie_tolerance,
                              pad_id=s.pad, progress=progress, reference_dir=reference_dir,
                              target_name=str(s.target_ref), prepared=prepared)
    metrics_path = metrics or s.meta.get("metrics")
    records = read_metrics(metrics_path)
    report.update({"export": str(export), "step": s.meta.get("step"), "target": s.target_ref,
                   "prompts": s.prompt_desc, "device": str(device), "dtype": str(s.torch_dtype).replace("torch.", ""),
                   "metrics_file": metrics_path if records else None,
                   "training": training_summary(records)})
    add_warnings(report)
    report["timing"]["total_s"] = round(time.perf_counter() - t_start, 3)
    if out_dir:
        from dflash_stages.evaluate.report import write_outputs

        report["files"] = write_outputs(report, out_dir, records if plot else None, plot=plot)
    return report


def export_baseline(export: str, *, target: str | None = None, prompts: str | Sequence[Sequence[int]] | None = None,
                    num_prompts: int | None = None, max_new_tokens: int = 128, device: str = "cpu",
                    dtype: str = "auto", loaded_target: tuple[Any, Any] | None = None, baseline: bool = True,
                    batch_size: int = 16, tie_tolerance: float | None = None,
                    reference_dir: str | None = None, progress: Progress | None = None) -> Baseline:
    """The greedy reference and n-gram run that :func:`evaluate_export` of this export, with these
    arguments, would make (``drafter.prepare_baseline``): the same for every export of a run, so it
    can be made at the run's first checkpoint and handed to each evaluation as ``prepared``."""
    from dflash_model.drafter import DrafterConfig

    s = _served(export, target, prompts, num_prompts, device, dtype, loaded_target)
    block_size = DrafterConfig.from_export_dict(s.config).block_size
    return prepare_baseline(s.lm, s.prompt_ids, block_size, max_new_tokens, s.eos, baseline=baseline,
                            batch_size=batch_size, tie_tolerance=tie_tolerance, pad_id=s.pad,
                            reference_dir=reference_dir, target_name=str(s.target_ref), progress=progress)


@dataclass
class _Served:
    """What an export is served with: its config and metadata, the target and its dtype, the
    prompts' token ids, the end-of-turn ids and the padding id."""

    config: dict[str, Any]
    meta: dict[str, Any]
    target_ref: str | None
    lm: Any
    torch_dtype: Any
    prompt_ids: list[list[int]]
    prompt_desc: str
    eos: set[int]
    pad: int


def _served(export: str, target: str | None, prompts: str | Sequence[Sequence[int]] | None,
            num_prompts: int | None, device: str, dtype: str, loaded_target: tuple[Any, Any] | None) -> _Served:
    from dflash_model.target.load import load_target, resolve_dtype

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
    prompt_ids, prompt_desc = _prompt_ids(export, prompts, num_prompts, meta, target_ref, tok)
    pad = getattr(tok, "pad_token_id", None)
    return _Served(cfg, meta, target_ref, lm, torch_dtype, prompt_ids, prompt_desc, eos_ids(lm, tok),
                   pad if pad is not None else 0)


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
    from dflash_stages.tokenize.masks import load_tokenizer

    return load_tokenizer(ref)
