"""generate:hf — the target's own completions of prompts, in the records tokenize reads.

A drafter learns to predict the *target's* next tokens; trained on someone else's responses it learns
a distribution it will never be asked to draft. This stage regenerates the responses with the target
(the step the production job ran by hand): prompts in, one record per prompt out (or ``samples``
records, each sampled with its own seed and named ``<id>#<seed>``)::

    {"id", "messages": [...prompt, {"role": "assistant", "content": completion}], "finish", "source", "line"}

* Prompts are tokenize's input records (docs/tokenize.md; ``messages``, ShareGPT
  ``conversations``, or ``prompt``): the conversation before the last assistant turn
  (:func:`dflash_stages.generate.prompts.record_messages`), rendered with the chat template's
  generation prompt (``thinking`` for Qwen templates).
* Records without a usable prompt (undecodable, empty, unknown format, longer than
  ``max_prompt_tokens``, a template error) are skipped, written to ``skipped.jsonl`` with the reason
  and counted in the summary; they never stop the run.
* The prompts are sorted by length (longest first, ties in file order) and cut into shards of
  ``shard_records``, so that the rows decoded side by side have nearly one length: they are
  left-padded to the longest, whatever the shard and batch sizes.
  Each shard is written to ``cache_dir`` by temp-file + rename, its records longest prompt first
  (``source`` and ``line`` give each one's place in the input). A shard on disk is never generated
  again, so a killed run loses at most the shard it was working on. Sampling is seeded per shard
  (and sample), so a resumed run writes what an uninterrupted one would have. Each sample of a
  shard is a file of its own.
* The backend is the target's HF forward in a batched decode loop
  (:func:`dflash_model.target.generate.complete`: offline, any causal LM ``load_target`` loads);
  another engine is another ``generate:`` implementation.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Mapping

from dflash_core.devices import torch_device
from dflash_core.items import FILE_ITEM
from dflash_core.stage import Stage, StageContext
from dflash_model.fast.settings import DtypeName
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
    model: str = field(default="smollm2", metadata={
        "help": "Target model: path, hub name, smollm2 or random:…."})
    max_new_tokens: int = field(default=512, metadata={
        "help": "Longest completion; longer ones are cut (finish: length)."})
    max_prompt_tokens: int = field(default=2048, metadata={
        "help": "Longer prompts are skipped (over_length)."})
    batch_size: int = field(default=64, metadata={
        "help": "Most rows in flight at once (finished ones are replaced by waiting prompts of "
                "similar length)."})
    max_batch_tokens: int | None = field(default=None, metadata={
        "help": "Prompts join the rows in flight only while rows x (longest prompt + max_new_tokens) "
                "stays within this many cache positions (the cache runs somewhat wider: finished rows "
                "ride along until dropped, buffers keep spare columns). A decode step costs about the "
                "same whatever the rows, so short prompts decoded many at a time (up to batch_size) "
                "make more tokens a second in the memory long ones need. None: batch_size alone "
                "bounds the rows."})
    shard_records: int = field(default=512, metadata={
        "help": "Prompts per output shard: the most a killed run loses."})
    temperature: float = field(default=0.0, metadata={
        "help": "0: greedy; above 0: sampling (top_p, seed)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass (when sampling)."})
    seed: int = field(default=0, metadata={
        "help": "Seed of the sampling (sample k of a prompt uses seed + k)."})
    samples: int = field(default=1, metadata={
        "help": "Completions per prompt, each a record of its own; above 1 they must be sampled "
                "(temperature > 0; SpecForge regenerates at 0.7, top_p 0.95). Sample k is "
                "drawn with seed seed + k (what a one-sample run with that seed writes) and named "
                "<id>#<seed + k>."})
    thinking: bool | None = field(default=None, metadata={
        "help": "enable_thinking for templates that read it (Qwen3/3.5/3.6); None: the template's "
                "default."})
    limit: int | None = field(default=None, metadata={"help": "Use the first N usable prompts only."})
    dtype: DtypeName = field(default="auto", metadata={
        "help": "Target dtype: auto (bf16 on CUDA, fp32 on CPU), bfloat16, float16, float32."})
    attention: str = field(default="sdpa_grouped", metadata={
        "help": "The target's attention: sdpa_grouped (SDPA; a decode step reads the grouped K/V "
                "heads as they are, dflash_model.target.decode_kv) or any transformers name "
                "(sdpa, eager)."})

    def __post_init__(self) -> None:
        if min(self.max_new_tokens, self.max_prompt_tokens, self.batch_size, self.shard_records) < 1:
            raise ValueError("max_new_tokens, max_prompt_tokens, batch_size and shard_records must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        check_samples(self.samples, self.temperature)
        if self.limit is not None and self.limit < 1:
            raise ValueError("limit must be >= 1")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1 (or null)")


def check_samples(samples: int, temperature: float) -> None:
    """Several completions of a prompt are worth having only if they differ: greedy ones would not."""
    if samples < 1:
        raise ValueError("samples must be >= 1")
    if samples > 1 and temperature <= 0:
        raise ValueError("samples > 1 needs sampling: set temperature > 0 (e.g. 0.7, top_p 0.95)")


def sample_numbers(seed: int | None, samples: int) -> list[int | None]:
    """The number each completion of a prompt is named by: its seed (``seed + k``; ``k`` unseeded),
    or None for a lone completion, which keeps the prompt's own id."""
    return [None] if samples == 1 else [(seed or 0) + k for k in range(samples)]


def as_sample(record: dict, number: int | None) -> dict:
    """``record`` as the completion ``number`` of its prompt (:func:`sample_numbers`): a distinct id
    (``<id>#<number>``) and a ``sample`` field, so that tokenize, pack and train take each one as a
    record of its own and a resumed run finds it by name; None leaves the record as it is."""
    return record if number is None else {**record, "id": f"{record['id']}#{number}", "sample": number}


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
    inputs = {"files": FILE_ITEM}
    output = FILE_ITEM
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
        items = file_items(inputs["files"], ctx.stage, ctx.upstream("files"))
        device = ctx.device or "cpu"
        model, tok = load_target(cfg.model, device=device, dtype=cfg.dtype, attn_implementation=cfg.attention)
        skipped: dict[str, int] = {}
        with open(os.path.join(ctx.work_dir, "skipped.jsonl"), "w", encoding="utf-8") as skip_file:
            prompts = sorted(read_prompts(items, lambda msgs: _prompt_ids(tok, msgs, cfg), cfg.limit, skipped,
                                          skip_file), key=lambda p: -len(p.ids))
        # every param, batch_size too: it sets the sampling seeds and the padding
        shard_dir = os.path.join(ctx.cache_dir, shard_key(self.version, sample_params(asdict(cfg)), items))
        os.makedirs(shard_dir, exist_ok=True)
        eos = sorted(eos_ids(model, tok))
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
        stats = {"prompts": len(prompts), "skipped": skipped, "records_out": 0, "generated_tokens": 0,
                 "finish_stop": 0, "finish_length": 0, "shards": 0, "resumed_shards": 0,
                 "generate_s": 0.0, "tokens_per_s": None, "gpu_busy": None}
        ctx.summary.update(stats)
        ctx.logger.info("generate: %d prompts (%d skipped) -> %s", len(prompts), sum(skipped.values()), shard_dir)
        total, unit = len(prompts) * cfg.samples, "prompts" if cfg.samples == 1 else "completions"
        ctx.progress(0, total=total, unit=unit)
        busy_samples: list[int] = []

        def told(rows: int, tokens: int) -> None:  # rows of the shard being generated have finished
            ctx.progress(rows, total=total, unit=unit, tokens=tokens)

        S, position = cfg.shard_records, 0
        # each sample of a shard's prompts is a file of its own, in turn
        for k, number in itertools.product(range(0, len(prompts), S), sample_numbers(cfg.seed, cfg.samples)):
            if ctx.should_stop():
                return
            path = os.path.join(shard_dir, shard_file(k // S, number))
            shard = prompts[k:k + S]
            position += len(shard)
            resumed = os.path.exists(path)
            if resumed:
                stats["resumed_shards"] += 1
                records = [json.loads(x) for x in open(path, encoding="utf-8")]
            else:
                t0 = time.perf_counter()
                with GpuBusy(torch_device(device)) as busy:
                    records = self._generate_shard(model, shard, cfg, eos, pad, k // S, number, tok, told)
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
                ctx.progress(0, total=total, unit=unit, start=position)
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
                        shard_no: int, number: int | None, tok: Any,
                        progress: Callable[[int, int], None]) -> list[dict]:
        """Records of one shard (sorted by prompt length), in order, ``batch_size`` rows in flight;
        ``number`` is the sample's seed (:func:`sample_numbers`), None for a lone completion."""
        from dflash_model.target.generate import complete

        seed = cfg.seed if number is None else number
        done = complete(model, [p.ids for p in shard], batch_size=cfg.batch_size, max_new_tokens=cfg.max_new_tokens,
                        eos=eos, pad_id=pad, temperature=cfg.temperature, top_p=cfg.top_p,
                        seed=seed * 1_000_003 + shard_no, progress=progress, max_batch_tokens=cfg.max_batch_tokens)
        out = []
        for p, c in zip(shard, done):
            text = tok.decode(c.ids[:-1] if c.finish == "stop" else c.ids, skip_special_tokens=False)
            out.append(as_sample({"id": p.id, "messages": p.messages + [{"role": "assistant", "content": text}],
                                  "finish": c.finish, "tokens": len(c.ids), "source": p.source, "line": p.line},
                                 number))
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


def sample_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """The params a shard file's records depend on. Never ``samples``: each sample is a file of its
    own, named by its seed (:func:`shard_file`), and a lone completion's key stays what it was before
    samples existed. Not a seeded ``seed`` either when there are several samples: a run of more
    samples, or from another base seed, then finds the files of those it shares with a run before.
    ``max_batch_tokens`` only when set: unset, the key is what it was before it existed."""
    several = params.get("samples", 1) > 1 and params.get("seed") is not None
    return {k: v for k, v in params.items() if k != "samples" and not (several and k == "seed")
            and not (k == "max_batch_tokens" and v is None)}


def shard_file(shard: int, number: int | None, suffix: str = "") -> str:
    """A shard's file name: ``shard-00003.jsonl`` for lone completions, ``shard-00003.s7.jsonl`` for
    the sample of seed 7 (``suffix`` before ``.jsonl``: the journal of a shard not yet whole)."""
    return f"shard-{shard:05d}{'' if number is None else f'.s{number}'}{suffix}.jsonl"


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
