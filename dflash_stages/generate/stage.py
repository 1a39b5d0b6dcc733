"""generate:hf — the target's own completions of prompts, in the records tokenize reads.

A drafter learns to predict the *target's* next tokens; trained on someone else's responses it learns
a distribution it will never be asked to draft. This stage regenerates the responses with the target
(the step the production job ran by hand): prompts in, one record per prompt out::

    {"id", "messages": [...prompt, {"role": "assistant", "content": completion}], "finish", "source", "line"}

* Prompts are DESIGN §6 records (``messages``, ShareGPT ``conversations``, or ``prompt``): the
  conversation before the last assistant turn (:func:`dflash_stages.generate.prompts.record_messages`), rendered
  with the chat template's generation prompt (``thinking`` for Qwen templates).
* Records without a usable prompt (undecodable, empty, unknown format, longer than
  ``max_prompt_tokens``, a template error) are skipped, written to ``skipped.jsonl`` with the reason
  and counted in the summary; they never stop the run.
* The prompts are sorted by length (longest first, ties in file order) and cut into shards of
  ``shard_records``, so that the rows decoded side by side have nearly one length: they are
  left-padded to the longest, whatever the shard and batch sizes.
  Each shard is written to ``cache_dir`` by temp-file + rename, its records longest prompt first
  (``source`` and ``line`` give each one's place in the input). A shard on disk is never generated
  again, so a killed run loses at most the shard it was working on. Sampling is seeded per shard, so
  a resumed run writes what an uninterrupted one would have.
* The backend is the target's HF forward in a batched decode loop
  (:func:`dflash_model.target.generate.complete`: offline, any causal LM ``load_target`` loads);
  another engine is another ``generate:`` implementation.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Mapping

from dflash_core.devices import torch_device
from dflash_core.stage import Stage, StageContext
from dflash_stages.generate.prompts import PromptError, record_messages, render_prompt

SKIP_REASONS = {
    "invalid_utf8": "the line is not valid UTF-8",
    "invalid_json": "the line is not valid JSON",
    "not_an_object": "the JSON value is not an object",
    "unknown_format": "neither 'messages', 'conversations' nor 'prompt'",
    "bad_messages": "'messages' / 'conversations' malformed",
    "empty": "no message with text besides the system prompt",
    "template_error": "the chat template raised an error on the prompt",
    "over_length": "the rendered prompt is longer than max_prompt_tokens",
}


@dataclass
class GenerateConfig:
    model: str = "smollm2"
    """Target model: path, hub name, ``smollm2`` or ``random:…``."""
    max_new_tokens: int = 512
    """Longest completion; longer ones are cut (``finish: length``)."""
    max_prompt_tokens: int = 2048
    """Longer prompts are skipped (``over_length``)."""
    batch_size: int = 64
    """Most rows in flight at once (finished ones are replaced by waiting prompts of similar length)."""
    shard_records: int = 512
    """Prompts per output shard: the most a killed run loses."""
    temperature: float = 0.0
    """0: greedy; above 0: sampling (``top_p``, ``seed``)."""
    top_p: float = 1.0
    seed: int = 0
    thinking: bool | None = None
    """``enable_thinking`` for templates that read it (Qwen3/3.5/3.6); None: the template's default."""
    limit: int | None = None
    """Use the first N usable prompts only."""
    dtype: str = "auto"
    """Target dtype: auto (bf16 on CUDA, fp32 on CPU), bfloat16, float16, float32."""
    attention: str = "sdpa_grouped"
    """The target's attention: ``sdpa_grouped`` (SDPA; a decode step reads the grouped K/V heads as
    they are, :mod:`dflash_model.target.decode_kv`) or any transformers name (``sdpa``, ``eager``)."""

    def __post_init__(self) -> None:
        if min(self.max_new_tokens, self.max_prompt_tokens, self.batch_size, self.shard_records) < 1:
            raise ValueError("max_new_tokens, max_prompt_tokens, batch_size and shard_records must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        if self.limit is not None and self.limit < 1:
            raise ValueError("limit must be >= 1")


@dataclass
class Prompt:
    """A usable prompt: its record's id and place in the input, its messages, and its token ids
    (empty where the stage does not render it)."""

    id: str
    source: str
    line: int
    messages: list[dict[str, Any]]
    ids: list[int]


class HFGenerate(Stage):
    """The target's completions of prompt records (HF ``generate``, batched, resumable)."""

    kind = "generate"
    name = "hf"
    preload = ("transformers:AutoTokenizer", "transformers:AutoModelForCausalLM")
    version = "2"
    Config = GenerateConfig
    inputs = ("files",)
    default_link = "materialize"
    default_executor = "thread"
    needs_torch = True

    def run(self, inputs: Mapping[str, Any], ctx: StageContext) -> Iterator[dict]:
        import torch

        from dflash_model.fast.settings import peak_gib
        from dflash_model.target.generate import GpuBusy
        from dflash_model.target.load import load_target
        from dflash_stages.generate.prompts import eos_ids
        from dflash_stages.tokenize.stage import file_items

        cfg: GenerateConfig = self.config
        items = file_items(inputs["files"])
        device = ctx.device or "cpu"
        model, tok = load_target(cfg.model, device=device, dtype=cfg.dtype, attn_implementation=cfg.attention)
        skipped: dict[str, int] = {}
        with open(os.path.join(ctx.work_dir, "skipped.jsonl"), "w", encoding="utf-8") as skip_file:
            prompts = sorted(read_prompts(items, lambda msgs: _prompt_ids(tok, msgs, cfg), cfg.limit, skipped,
                                          skip_file), key=lambda p: -len(p.ids))
        # every param, batch_size too: it sets the sampling seeds and the padding
        shard_dir = os.path.join(ctx.cache_dir, shard_key(self.version, asdict(cfg), items))
        os.makedirs(shard_dir, exist_ok=True)
        eos = sorted(eos_ids(model, tok))
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
        stats = {"prompts": len(prompts), "skipped": skipped, "records_out": 0, "generated_tokens": 0,
                 "finish_stop": 0, "finish_length": 0, "shards": 0, "resumed_shards": 0,
                 "generate_s": 0.0, "tokens_per_s": None, "gpu_busy": None}
        ctx.summary.update(stats)
        ctx.logger.info("generate: %d prompts (%d skipped) -> %s", len(prompts), sum(skipped.values()), shard_dir)
        ctx.progress(0, total=len(prompts), unit="prompts")
        busy_samples: list[int] = []

        def told(rows: int, tokens: int) -> None:  # rows of the shard being generated have finished
            ctx.progress(rows, total=len(prompts), unit="prompts", tokens=tokens)

        S = cfg.shard_records
        for k in range(0, len(prompts), S):
            if ctx.should_stop():
                return
            path = os.path.join(shard_dir, f"shard-{k // S:05d}.jsonl")
            shard = prompts[k:k + S]
            resumed = os.path.exists(path)
            if resumed:
                stats["resumed_shards"] += 1
                records = [json.loads(x) for x in open(path, encoding="utf-8")]
            else:
                t0 = time.perf_counter()
                with GpuBusy(torch_device(device)) as busy:
                    records = self._generate_shard(model, shard, cfg, eos, pad, k // S, tok, told)
                stats["generate_s"] += time.perf_counter() - t0
                busy_samples += busy.samples
                write_atomic(path, records)
                stats["generated_tokens"] += sum(r["tokens"] for r in records)
            for r in records:
                stats[f"finish_{r['finish']}"] += 1
            stats["records_out"] += len(records)
            stats["shards"] += 1
            if stats["generate_s"]:
                stats["tokens_per_s"] = round(stats["generated_tokens"] / stats["generate_s"], 1)
            if busy_samples:
                stats["gpu_busy"] = round(sum(busy_samples) / len(busy_samples) / 100, 3)
            ctx.summary.update(stats)
            if resumed:  # in the position, not the rate (a generated shard told its rows as they finished)
                ctx.progress(0, total=len(prompts), unit="prompts", start=k + len(shard))
            yield {"path": path, "source": f"generate/{os.path.basename(path)}", "records": len(records),
                   "size": os.path.getsize(path)}
        ctx.summary["peak_gib"] = peak_gib(device)
        if torch.device(device).type == "cuda":
            # the peak the stages after generate report (extract and train, side by side) is theirs
            del model
            torch.cuda.reset_peak_memory_stats(device)
        if not prompts:
            raise ValueError(f"generate: no usable prompt in {len(items)} file(s); skipped {skipped} "
                             f"(see {os.path.join(ctx.work_dir, 'skipped.jsonl')})")

    @staticmethod
    def _generate_shard(model: Any, shard: list[Prompt], cfg: GenerateConfig, eos: list[int], pad: int,
                        shard_no: int, tok: Any, progress: Callable[[int, int], None]) -> list[dict]:
        """Records of one shard (sorted by prompt length), in order, ``batch_size`` rows in flight."""
        from dflash_model.target.generate import complete

        done = complete(model, [p.ids for p in shard], batch_size=cfg.batch_size, max_new_tokens=cfg.max_new_tokens,
                        eos=eos, pad_id=pad, temperature=cfg.temperature, top_p=cfg.top_p,
                        seed=cfg.seed * 1_000_003 + shard_no, progress=progress)
        out = []
        for p, c in zip(shard, done):
            text = tok.decode(c.ids[:-1] if c.finish == "stop" else c.ids, skip_special_tokens=False)
            out.append({"id": p.id, "messages": p.messages + [{"role": "assistant", "content": text}],
                        "finish": c.finish, "tokens": len(c.ids), "source": p.source, "line": p.line})
        return out

    @classmethod
    def report(cls, summary: dict[str, Any]) -> Any:
        skipped = summary.get("skipped") or {}
        return (f"generate: {summary.get('records_out', 0)} completions of {summary.get('prompts', 0)} prompts "
                f"({summary.get('finish_length', 0)} cut at max_new_tokens), {summary.get('generated_tokens', 0)} "
                f"tokens at {summary.get('tokens_per_s')} tokens/s, GPU busy {summary.get('gpu_busy')}; "
                f"skipped {sum(skipped.values())} {dict(sorted(skipped.items()))}")


def read_prompts(items: list[dict], render: Callable[[list[dict[str, Any]]], list[int]], limit: int | None,
                 skipped: dict[str, int], skip_file: Any) -> Iterator[Prompt]:
    """Usable prompts of all files in order; every other record counted and logged by reason.
    ``render`` gives a prompt's token ids or raises :class:`PromptError` (a template error, too long)."""
    import fsspec

    n = 0
    for item in items:
        source = str(item.get("source") or item["path"])
        with fsspec.open(item["path"], "rb", compression="infer") as f:
            for line_no, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    record = _parse(raw, line_no == 1)
                    messages = record_messages(record)
                    ids = render(messages)
                except PromptError as exc:
                    skipped[exc.reason] = skipped.get(exc.reason, 0) + 1
                    skip_file.write(json.dumps({"file": source, "line": line_no, "reason": exc.reason,
                                                "detail": str(exc)[:300]}, ensure_ascii=False) + "\n")
                    continue
                yield Prompt(str(record.get("id", f"{source}:{line_no}")), source, line_no, messages, ids)
                n += 1
                if limit is not None and n >= limit:
                    return


def _prompt_ids(tok: Any, messages: list[dict[str, Any]], cfg: GenerateConfig) -> list[int]:
    ids = render_prompt(tok, messages, cfg.thinking)
    if len(ids) > cfg.max_prompt_tokens:
        raise PromptError("over_length", f"{len(ids)} > {cfg.max_prompt_tokens} tokens")
    return ids


def shard_key(version: str, params: Mapping[str, Any], items: list[dict]) -> str:
    """Shard folder name: what the completions depend on (the given params, the inputs), nothing else."""
    inputs = [(it.get("source") or it["path"], it.get("size"), it.get("etag")) for it in items]
    blob = json.dumps({"v": version, "params": params, "inputs": inputs}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _parse(raw: bytes, first_line: bool) -> dict:
    """The JSON object of one line, with tokenize's reasons for one that is not."""
    from dflash_stages.tokenize.records import RecordError, parse_line

    try:
        return parse_line(raw, first_line=first_line)[0]
    except RecordError as exc:
        raise PromptError(exc.reason, exc.detail) from None


def write_atomic(path: str, records: list[dict]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    os.replace(tmp, path)
