"""tokenize:chat_template — one JSONL line to a normalized conversation (pure Python, no heavy imports).

Accepted records (docs/tokenize.md, 'Input records')::

    {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str,
                   "reasoning_content"?: str, "tool_calls"?: [...], ...}, ...], "tools"?: [...]}
    {"prompt": str | messages, "completion" | "response": str | messages, "reasoning"?: str,
     "system"?: str, "tools"?: [...]}
    {"conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...]}   (ShareGPT)

Normalization (the same for every template):

* reasoning comes from ``reasoning_content`` (or ``reasoning``) of an assistant message, or from an
  inline ``<think>…</think>`` at the start of its content, split the way Qwen3's template splits it;
* messages after the last assistant turn are dropped (nothing after it is supervised);
* with ``thinking=False`` the reasoning is dropped (the model serves without it);
* templates that know ``reasoning_content`` get it as that field; for other templates it is put back
  inline as ``<think>\\n{reasoning}\\n</think>\\n\\n{content}`` (thinking on only).

A malformed record raises :class:`RecordError` with one of the :data:`QUARANTINE_REASONS` codes.
"""

from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
BOM = b"\xef\xbb\xbf"

QUARANTINE_REASONS: dict[str, str] = {
    "invalid_utf8": "the line is not valid UTF-8",
    "invalid_json": "the line is not valid JSON",
    "record_too_large": "the line is longer than max_record_bytes (not parsed)",
    "not_an_object": "the JSON value is not an object",
    "unknown_format": "neither 'messages', 'conversations' (ShareGPT) nor 'prompt' + 'completion'/'response'",
    "missing_completion": "'prompt' without a 'completion' or 'response'",
    "bad_messages": "'messages' (or a messages-valued prompt/completion) is not a non-empty list",
    "bad_message": "a message is not an object with a string 'role'",
    "unknown_role": "a message role other than system/user/assistant/tool",
    "bad_content": "a content/reasoning value of the wrong type",
    "bad_tool_calls": "'tool_calls' is not a list of objects, or 'tools' is not a list",
    "bad_reasoning": "conflicting reasoning (field and inline), or think tags inside reasoning",
    "unclosed_think": "content opens <think> and never closes it (truncated generation)",
    "no_assistant_turn": "no assistant message",
    "empty_assistant_turn": "an assistant message with no content, reasoning or tool calls",
    "special_token_in_content": "a message contains a special token string (e.g. <|im_end|>)",
    "template_error": "the chat template raised an error rendering the conversation",
    "template_mismatch": "an assistant turn could not be located in the rendered conversation",
}

FILTER_REASONS: dict[str, str] = {
    "too_long": "longer than max_len tokens (overflow: drop)",
    "min_loss_tokens": "fewer supervised tokens than min_loss_tokens",
}

_PASS_KEYS = ("name", "tool_call_id", "tool_calls", "id")

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "tool": "tool"}
"""ShareGPT ``from`` values and the chat roles they stand for (SpecForge and most public drafter
datasets store conversations this way)."""


class RecordError(Exception):
    """A malformed record: ``reason`` is a :data:`QUARANTINE_REASONS` code, ``detail`` says more."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def parse_line(raw: bytes, *, first_line: bool = False) -> tuple[dict, bool]:
    """JSON object of one line; returns ``(record, bom_stripped)``. A UTF-8 BOM is accepted only
    at the start of a file (``first_line``)."""
    bom = first_line and raw.startswith(BOM)
    if bom:
        raw = raw[len(BOM):]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecordError("invalid_utf8", f"byte {e.start}: {e.reason}") from None
    try:
        record = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise RecordError("invalid_json", str(e)[:200]) from None
    if not isinstance(record, dict):
        raise RecordError("not_an_object", f"got {type(record).__name__}")
    return record, bom


def _text(value: Any, where: str, *, none_ok: bool = False) -> str:
    """A content value as a string: str, None (if allowed) or a list of text parts."""
    if isinstance(value, str):
        return value
    if value is None and none_ok:
        return ""
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise RecordError("bad_content", f"{where}: expected a string, got {type(value).__name__}")


def _as_messages(value: Any, where: str) -> list:
    if not isinstance(value, list) or not value:
        raise RecordError("bad_messages", f"'{where}' must be a non-empty list of messages")
    return value


def to_messages(record: dict) -> tuple[list, Any]:
    """The record's raw message list and tools, from either accepted format."""
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RecordError("bad_tool_calls", "'tools' must be a list")
    if "messages" in record:
        return list(_as_messages(record["messages"], "messages")), tools
    if "conversations" in record:
        return sharegpt_messages(record["conversations"]), tools
    if "prompt" not in record:
        keys = ", ".join(sorted(map(str, record))[:8])
        raise RecordError("unknown_format", f"keys: {keys}" if keys else "empty object")
    prompt = record["prompt"]
    completion = record.get("completion", record.get("response"))
    if completion is None:
        raise RecordError("missing_completion", "no 'completion' or 'response'")
    if isinstance(prompt, str):
        messages: list = [{"role": "user", "content": prompt}]
        system = record.get("system")
        if system is not None:
            messages.insert(0, {"role": "system", "content": _text(system, "system")})
    else:
        messages = list(_as_messages(prompt, "prompt"))
    if isinstance(completion, list) and completion and all(isinstance(m, dict) and "role" in m
                                                           for m in completion):
        messages.extend(completion)
        if record.get("reasoning") is not None:
            raise RecordError("bad_reasoning", "'reasoning' with a messages-valued completion")
    else:
        turn = {"role": "assistant", "content": _text(completion, "completion")}
        if record.get("reasoning") is not None:
            turn["reasoning_content"] = _text(record["reasoning"], "reasoning")
        messages.append(turn)
    return messages, tools


def sharegpt_messages(turns: Any) -> list[dict]:
    """ShareGPT turns ``{"from", "value"}`` as chat messages ``{"role", "content"}``."""
    out = []
    for n, turn in enumerate(_as_messages(turns, "conversations")):
        if not isinstance(turn, dict) or not isinstance(turn.get("from"), str):
            raise RecordError("bad_message", f"turn {n} is not an object with a string 'from'")
        role = SHAREGPT_ROLES.get(turn["from"])
        if role is None:
            raise RecordError("unknown_role", f"turn {n}: from {turn['from'][:40]!r}")
        out.append({"role": role, "content": turn.get("value")})
    return out


def split_reasoning(content: str, reasoning: str | None) -> tuple[str, str]:
    """``(reasoning, answer)``: the field if given, else an inline ``<think>…</think>`` block,
    split exactly as Qwen3's chat template splits it."""
    if "</think>" in content:
        if reasoning and reasoning.strip():
            raise RecordError("bad_reasoning", "reasoning given both as a field and inline <think>")
        if content.count("</think>") > 1:
            raise RecordError("bad_reasoning", "more than one </think> in content")
        head, answer = content.split("</think>")
        return head.rstrip("\n").split("<think>")[-1].lstrip("\n"), answer.lstrip("\n")
    if "<think>" in content:
        raise RecordError("unclosed_think", "<think> without </think>")
    return reasoning or "", content


def normalize(record: dict, *, thinking: bool, reasoning_field: bool,
              specials: tuple[str, ...] = ()) -> tuple[list[dict], Any, bool]:
    """Checked, normalized messages for the template: ``(messages, tools, reasoning_dropped)``.

    ``reasoning_field``: the template reads ``reasoning_content`` (else reasoning goes inline).
    ``specials``: special-token strings that may not appear in any text.
    """
    raw, tools = to_messages(record)
    out: list[dict] = []
    last_assistant = -1
    dropped = False
    for n, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RecordError("bad_message", f"message {n} is not an object with a string 'role'")
        role = m["role"]
        if role not in ROLES:
            raise RecordError("unknown_role", f"message {n}: {role[:40]!r}")
        msg: dict[str, Any] = {"role": role}
        for key in _PASS_KEYS:
            if key in m and m[key] is not None:
                msg[key] = m[key]
        if role == "assistant":
            calls = m.get("tool_calls")
            if calls is not None and not (isinstance(calls, list)
                                          and all(isinstance(c, dict) for c in calls)):
                raise RecordError("bad_tool_calls", f"message {n}: 'tool_calls' must be a list of objects")
            content = _text(m.get("content"), f"message {n} content", none_ok=True)
            field = m.get("reasoning_content", m.get("reasoning"))
            field = None if field is None else _text(field, f"message {n} reasoning")
            if field and ("<think>" in field or "</think>" in field):
                raise RecordError("bad_reasoning", f"message {n}: think tags inside the reasoning field")
            reasoning, content = split_reasoning(content, field)
            if not content.strip() and not reasoning.strip() and not calls:
                raise RecordError("empty_assistant_turn", f"message {n}")
            if not thinking:
                dropped = dropped or bool(reasoning.strip())
                reasoning = ""
            if reasoning_field:
                msg["reasoning_content"] = reasoning
            elif reasoning:
                content = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}"
            msg["content"] = content
            last_assistant = n
        else:
            msg["content"] = _text(m.get("content"), f"message {n} content")
        _check_specials(msg, specials, n)
        out.append(msg)
    if last_assistant < 0:
        raise RecordError("no_assistant_turn", f"roles: {', '.join(m['role'] for m in out)[:80]}")
    return out[:last_assistant + 1], tools, dropped


def _check_specials(msg: dict, specials: tuple[str, ...], n: int) -> None:
    if not specials:
        return
    for key in ("content", "reasoning_content"):
        text = msg.get(key)
        if text and "<" in text:
            for s in specials:
                if s in text:
                    raise RecordError("special_token_in_content", f"message {n} {key} contains {s}")


def excerpt(raw: bytes, limit: int = 200) -> str:
    """The start of a line for the quarantine file (invalid bytes shown as U+FFFD)."""
    text = raw[: limit * 4].decode("utf-8", errors="replace")
    return text[:limit] + ("…" if len(text) > limit or len(raw) > limit * 4 else "")
