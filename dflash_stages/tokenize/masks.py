"""tokenize:chat_template — render, tokenize and mask a batch of lines (runs in the worker processes).

The supervised span of assistant turn ``i`` (``docs/tokenize.md`` states the rule for users):

1. ``T`` = the whole conversation rendered by the template (``add_generation_prompt=False``), and
   ``P_i`` = the messages before turn ``i`` rendered with ``add_generation_prompt=True`` — what the
   server would hand the model before it generated the turn. Both are tokenized in one batch with
   the fast tokenizer (``add_special_tokens=False``), as ``apply_chat_template`` would.
2. Start: if ``tok(P_i)`` is a token prefix of ``tok(T)``, the turn starts right after it. If not,
   the template rewrote the context in the full conversation (Qwen3 drops the empty think block of
   earlier turns with thinking off, or earlier reasoning): the start is where ``tok(T)`` leaves
   the generation prompt (common prefix, when it ends inside the generation prompt), else the end of
   the generation prompt's header found after the previous turn.
3. End: the first end-of-turn token at or after the start (inclusive). The end-of-turn token is the
   special token the template puts right after an assistant message (``<|im_end|>`` for ChatML);
   what follows it (ChatML's newline) is template formatting the model never samples.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dflash_stages.tokenize.records import RecordError, excerpt, normalize, parse_line

_WORKERS: dict[str, "Worker"] = {}
_TOKENIZERS: dict[str, Any] = {}
HIST_BINS: tuple[tuple[int, int | None], ...] = (
    (0, 0), (1, 7), (8, 31), (32, 127), (128, 511), (512, 2047), (2048, None))


def hist_label(lo: int, hi: int | None) -> str:
    return f"{lo}+" if hi is None else (str(lo) if lo == hi else f"{lo}-{hi}")


def hist_index(n: int) -> int:
    for i, (lo, hi) in enumerate(HIST_BINS):
        if hi is None or n <= hi:
            return i
    return len(HIST_BINS) - 1


def load_tokenizer(name: str) -> Any:
    """An HF tokenizer by path or hub name; ``smollm2`` is the bundled SmolLM2 GGUF (loaded by
    its own helper, which serializes GGUF loads with the extract stage's in this process)."""
    if name == "smollm2":
        from dflash_model.target.smollm2 import load_smollm2_tokenizer

        return load_smollm2_tokenizer()
    from dflash_model.target.compat import auto_tokenizer

    return auto_tokenizer(name)


@dataclass
class BatchResult:
    """What a worker returns for one batch (numpy buffers keep the pickle small)."""

    ids: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    lines: np.ndarray
    records: int = 0
    quarantine: list[dict] = field(default_factory=list)
    filtered: dict[str, int] = field(default_factory=dict)
    hist: list[int] = field(default_factory=lambda: [0] * len(HIST_BINS))
    counters: dict[str, int] = field(default_factory=dict)

    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n


class Worker:
    """A loaded tokenizer + the facts about its template that every record needs."""

    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.tok = _TOKENIZERS.get(cfg["tokenizer"])
        if self.tok is None:
            self.tok = _TOKENIZERS[cfg["tokenizer"]] = load_tokenizer(cfg["tokenizer"])
        kwargs = dict(cfg.get("chat_template_kwargs") or {})
        source = kwargs.get("chat_template") or self.tok.chat_template
        if isinstance(source, dict):
            source = source.get("default") or next(iter(source.values()), None)
        if not source:
            raise ValueError(f"tokenizer {cfg['tokenizer']!r} has no chat template "
                             "(pass one as chat_template_kwargs.chat_template)")
        self.kwargs = {**kwargs, "enable_thinking": bool(cfg["thinking"])}
        self.reasoning_field = "reasoning_content" in source
        specials = {t.content for t in self.tok.added_tokens_decoder.values() if t.special}
        specials.update(s for s in (self.tok.all_special_tokens or []) if s)
        self.specials = tuple(sorted(specials, key=len, reverse=True))
        backend = getattr(self.tok, "backend_tokenizer", None)
        self._encode_batch = None
        if backend is not None:
            self._encode_batch = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
        self.fast = None
        if os.environ.get("DFLASH_TOKENIZE_FAST", "1") != "0" and backend is not None:
            from dflash_stages.tokenize.fast import fast_encoder_for

            self.fast = fast_encoder_for(self.tok)
        self._probe()

    def render(self, messages: list, tools: Any, gen: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                            add_generation_prompt=gen, **self.kwargs)

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text, as ``tok(text, add_special_tokens=False)`` gives them."""
        if not texts:
            return []
        if self.fast is not None:
            out = self._encode_fast(texts)
            if out is not None:
                return out
        return self._encode_rust(texts)

    def _encode_fast(self, texts: list[str]) -> list[np.ndarray] | None:
        fast = [self.fast.encode(t) for t in texts]
        todo = [i for i, ids in enumerate(fast) if ids is None]
        done = [i for i, ids in enumerate(fast) if ids is not None]
        if done:   # check one text per batch (a non-ASCII one if any) against the Rust tokenizer
            check = next((i for i in done if not texts[i].isascii()), done[0])
            if self._encode_rust([texts[check]])[0].tolist() != fast[check]:
                import logging

                logging.getLogger("dflash_pipe.stage.tokenize").warning(
                    "tokenize: the fast encoder disagrees with the tokenizer on a text; "
                    "using the tokenizer itself from now on")
                self.fast = None
                return None
        out = [np.array(ids, dtype=np.int32) if ids is not None else None for ids in fast]
        for i, ids in zip(todo, self._encode_rust([texts[i] for i in todo])):
            out[i] = ids
        return out  # type: ignore[return-value]

    def _encode_rust(self, texts: list[str]) -> list[np.ndarray]:
        if not texts:
            return []
        if self._encode_batch is not None:
            encs = self._encode_batch(texts, add_special_tokens=False)
            return [np.array(e.ids, dtype=np.int32) for e in encs]
        out = self.tok(texts, add_special_tokens=False)["input_ids"]
        return [np.array(ids, dtype=np.int32) for ids in out]

    def _probe(self) -> None:
        """The end-of-turn token and generation-prompt tokens, from a two-message probe."""
        conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        if self.reasoning_field:
            conv[1]["reasoning_content"] = ""
        prompt = self.render(conv[:1], None, True)
        plain = self.render(conv[:1], None, False)
        full = self.render(conv, None, False)
        self.gen_prompt = self.encode([prompt[len(plain):]])[0] if prompt.startswith(plain) else \
            np.zeros(0, np.int32)
        tail = full[full.rfind("Hello") + len("Hello"):].rstrip() if "Hello" in full else ""
        self.eot = next((s for s in self.specials if tail.startswith(s)), None)
        self.eot_id = None
        if self.eot is not None:
            ids = self.encode([self.eot])[0]
            self.eot_id = int(ids[0]) if len(ids) == 1 else None

    # -- spans ---------------------------------------------------------------------------------

    def spans(self, ids: np.ndarray, prompts: list[np.ndarray], counters: BatchResult
              ) -> list[tuple[int, int]]:
        """Token spans ``[start, end)`` of the assistant turns in ``ids`` (see module doc)."""
        out = []
        cursor = 0
        gp = self.gen_prompt
        for k, p in enumerate(prompts):
            last = k == len(prompts) - 1
            n = len(p)
            m = min(n, len(ids))
            diff = np.flatnonzero(ids[:m] != p[:m])
            common = int(diff[0]) if diff.size else m
            if common == n and n >= cursor:
                start = n
            else:
                counters.count("rewritten_turns")
                if common >= cursor and common >= n - len(gp):
                    start = common
                else:
                    start = self._find_header(ids, cursor)
                    if start is None:
                        raise RecordError("template_mismatch",
                                          f"assistant turn {k + 1}: generation prompt not found")
            if self.eot_id is not None:
                hits = np.flatnonzero(ids[start:] == self.eot_id)
                if not hits.size:
                    raise RecordError("template_mismatch",
                                      f"assistant turn {k + 1}: no end-of-turn token")
                end = start + int(hits[0]) + 1
            elif last:
                end = len(ids)
            else:
                raise RecordError("template_mismatch",
                                  f"assistant turn {k + 1}: template has no end-of-turn token")
            if end <= start:
                raise RecordError("template_mismatch", f"assistant turn {k + 1}: empty span")
            out.append((start, end))
            cursor = end
        return out

    def _find_header(self, ids: np.ndarray, cursor: int) -> int | None:
        gp = self.gen_prompt
        h = min(2, len(gp))
        if h == 0:
            return None
        for j in np.flatnonzero(ids[cursor:] == gp[0]):
            j = cursor + int(j)
            if np.array_equal(ids[j:j + h], gp[:h]):
                seg = ids[j:j + len(gp)]
                diff = np.flatnonzero(seg != gp[:len(seg)])
                return j + (int(diff[0]) if diff.size else len(seg))
        return None


def get_worker(cfg: dict) -> Worker:
    kwargs = sorted((cfg.get("chat_template_kwargs") or {}).items())
    key = repr((cfg["tokenizer"], cfg["thinking"], kwargs))
    worker = _WORKERS.get(key)
    if worker is None:
        worker = _WORKERS[key] = Worker(cfg)
    return worker


def init_process(threads: int) -> None:
    """Spawned worker start-up: bound the tokenizer's thread pool before it is created."""
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, threads)))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")


def process_batch(cfg: dict, source: str, entries: list[tuple[int, bytes | None, int]]) -> BatchResult:
    """Lines ``(line_no, raw bytes | None if too large, size)`` of one file → samples + reports.

    Rendering is per record (Python), tokenizing is one batch for all of them (Rust), then each
    record's spans, mask and filters; a record that fails any step is quarantined, not raised."""
    w = get_worker(cfg)
    res = BatchResult(np.zeros(0, np.int32), np.zeros(0, np.int8), np.zeros(0, np.int32),
                      np.zeros(0, np.int32), records=len(entries))
    todo, texts = _render_batch(w, cfg, source, entries, res)
    _pack(res, _mask_batch(w, cfg, source, todo, w.encode(texts), res))
    return res


def _quarantine(res: BatchResult, source: str, line: int, raw: bytes, err: RecordError) -> None:
    """Report a rejected record with its place and an excerpt, so that it can be found and fixed."""
    res.quarantine.append({"file": source, "line": line, "reason": err.reason,
                           "detail": err.detail, "excerpt": excerpt(raw)})


def _render_batch(w: Worker, cfg: dict, source: str, entries: list[tuple[int, bytes | None, int]],
                  res: BatchResult) -> tuple[list[tuple[int, bytes, int]], list[str]]:
    """Render every record, collecting the texts so that they are tokenized in one batch.

    Returns ``(line, raw, n_turns)`` per rendered record and, per record in the same order, its
    full conversation followed by the ``n_turns`` generation prompts."""
    todo = []
    texts: list[str] = []
    for line, raw, size in entries:
        if raw is None or size > cfg["max_record_bytes"]:
            _quarantine(res, source, line, raw or b"", RecordError(
                "record_too_large", f"{size} bytes > max_record_bytes {cfg['max_record_bytes']}"))
            continue
        try:
            rendered, n_turns, dropped = _render_record(w, cfg, line, raw, res)
        except RecordError as e:
            _quarantine(res, source, line, raw, e)
            continue
        if dropped:
            res.count("reasoning_dropped")
        res.count("assistant_turns", n_turns)
        todo.append((line, raw, n_turns))
        texts.extend(rendered)
    return todo, texts


def _render_record(w: Worker, cfg: dict, line: int, raw: bytes, res: BatchResult
                   ) -> tuple[list[str], int, bool]:
    """Parse, normalize and render one record: the whole conversation, then the generation prompt
    before each assistant turn (the module doc says why both). Returns ``(texts, n_turns,
    reasoning dropped)``; raises ``RecordError`` for a record the template cannot take."""
    record, bom = parse_line(raw, first_line=line == 1)
    if bom:
        res.count("bom_stripped")
    messages, tools, dropped = normalize(record, thinking=cfg["thinking"],
                                         reasoning_field=w.reasoning_field, specials=w.specials)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    try:
        rendered = [w.render(messages, tools, False)]
        rendered += [w.render(messages[:i], tools, True) for i in turns]
    except Exception as e:  # jinja errors, raise_exception(), bad tool schemas …
        raise RecordError("template_error", f"{type(e).__name__}: {e}"[:300]) from None
    for text in rendered:   # JSON escapes can smuggle in lone surrogates
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RecordError("invalid_utf8", f"lone surrogate {e.object[e.start]!r} "
                                                  "(a \\ud8xx escape)") from None
    return rendered, len(turns), dropped


def _mask_batch(w: Worker, cfg: dict, source: str, todo: list[tuple[int, bytes, int]],
                encoded: list[np.ndarray], res: BatchResult
                ) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Match each record's tokens with its prompts' to find the assistant spans; the kept samples
    as ``(line, ids, mask)``. A record whose spans cannot be found is quarantined."""
    kept = []
    pos = 0
    for line, raw, n_turns in todo:
        ids, prompts = encoded[pos], encoded[pos + 1: pos + 1 + n_turns]
        pos += 1 + n_turns
        try:
            spans = w.spans(ids, prompts, res)
        except RecordError as e:
            _quarantine(res, source, line, raw, e)
            continue
        sample = _sample(cfg, ids, spans, res)
        if sample is not None:
            kept.append((line, *sample))
    return kept


def _sample(cfg: dict, ids: np.ndarray, spans: list[tuple[int, int]], res: BatchResult
            ) -> tuple[np.ndarray, np.ndarray] | None:
    """The loss mask of ``spans``, then the length and loss-token filters: ``(ids, mask)``, or None
    for a filtered sample (counted in ``res.filtered``; the histogram counts it either way)."""
    mask = np.zeros(len(ids), np.int8)
    for s, e in spans:
        mask[s:e] = 1
    if len(ids) > cfg["max_len"]:
        if cfg["overflow"] == "drop":
            res.filtered["too_long"] = res.filtered.get("too_long", 0) + 1
            res.hist[hist_index(int(mask.sum()))] += 1
            return None
        ids, mask = ids[: cfg["max_len"]], mask[: cfg["max_len"]]
        res.count("truncated")
    n_loss = int(mask.sum())
    res.hist[hist_index(n_loss)] += 1
    if n_loss < cfg["min_loss_tokens"]:
        res.filtered["min_loss_tokens"] = res.filtered.get("min_loss_tokens", 0) + 1
        return None
    return ids, mask


def _pack(res: BatchResult, kept: list[tuple[int, np.ndarray, np.ndarray]]) -> None:
    """Concatenate the kept samples into ``res``'s flat buffers (one pickle-friendly array each)."""
    if kept:
        res.ids = np.concatenate([ids for _, ids, _ in kept])
        res.mask = np.concatenate([mask for _, _, mask in kept])
        res.lengths = np.array([len(ids) for _, ids, _ in kept], np.int32)
        res.lines = np.array([line for line, _, _ in kept], np.int32)
