"""Prompts from input records (docs/tokenize.md, 'Input records'): what a server would be
handed, as the target's token ids.

Shared by ``generate`` (which completes them with the target) and ``evaluate`` (which decodes them
speculatively), so that both see a record's prompt exactly the same way.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping


class PromptError(ValueError):
    """A record without a usable prompt; ``reason`` is a short code counted in summaries."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def record_messages(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conversation before the record's last assistant turn: ``messages``, ShareGPT
    ``conversations``, or ``prompt`` (a string is one user message, with ``system`` if given)."""
    from dflash_stages.tokenize.records import RecordError, sharegpt_messages

    if "messages" in record or "conversations" in record:
        try:
            msgs = (list(record["messages"]) if "messages" in record
                    else sharegpt_messages(record["conversations"]))
        except (RecordError, TypeError) as exc:
            raise PromptError("bad_messages", str(exc)) from None
        last = max((i for i, m in enumerate(msgs) if isinstance(m, Mapping) and m.get("role") == "assistant"),
                   default=None)
        msgs = msgs[:last] if last is not None else msgs
    elif "prompt" in record:
        p = record["prompt"]
        msgs = [{"role": "user", "content": p}] if isinstance(p, str) else list(p)
        if isinstance(p, str) and record.get("system") is not None:
            msgs.insert(0, {"role": "system", "content": record["system"]})
    else:
        raise PromptError("unknown_format", f"neither 'messages', 'conversations' nor 'prompt': "
                                            f"keys {sorted(map(str, record))[:8]}")
    if not msgs or not all(isinstance(m, Mapping) for m in msgs):
        raise PromptError("empty", "no prompt messages")
    if not any(_has_text(m.get("content")) for m in msgs if m.get("role") != "system"):
        raise PromptError("empty", "no message with text besides the system prompt")
    return [{k: v for k, v in m.items() if k in ("role", "content", "tool_calls", "name")} for m in msgs]


def _has_text(content: Any) -> bool:
    """A content value with some text: a non-blank string, or text parts (as tokenize accepts)."""
    if isinstance(content, list):
        return any(isinstance(p, Mapping) and str(p.get("text", "")).strip() for p in content)
    return isinstance(content, str) and bool(content.strip())


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], thinking: bool | None = None,
                  chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of the chat template's generation prompt (``enable_thinking`` when given), without
    extra special tokens, like the tokenize stage renders the same conversation."""
    kw = dict(chat_template_kwargs or {})
    if thinking is not None:
        kw.setdefault("enable_thinking", bool(thinking))
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    except Exception as exc:  # the template's own errors (jinja raise_exception, bad roles)
        raise PromptError("template_error", str(exc)[:200]) from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_prompts(tokenizer: Any, records: Iterable[Mapping[str, Any]], thinking: bool | None = None,
                  chat_template_kwargs: Mapping[str, Any] | None = None) -> list[list[int]]:
    """Token ids of each record's prompt (:func:`record_messages` rendered by :func:`render_prompt`)."""
    return [render_prompt(tokenizer, record_messages(r), thinking, chat_template_kwargs) for r in records]


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


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """End-of-generation ids: the tokenizer's eos plus the model's generation config eos."""
    ids: set[int] = set()
    for src in (getattr(tokenizer, "eos_token_id", None),
                getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if src is None:
            continue
        ids.update([int(src)] if isinstance(src, int) else [int(x) for x in src])
    return ids
