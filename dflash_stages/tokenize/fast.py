"""tokenize:chat_template — an exact, faster encoder for byte-level BPE tokenizers of the GPT-4 family.

For long texts the fast tokenizer's time goes to its Oniguruma pre-tokenizer and to per-token
allocations, not to BPE (whose per-word cache is small). For tokenizers built exactly like
Qwen2/2.5/3/3.5/3.6 (NFC, a ``Split`` regex from :data:`PATTERNS`, byte-level mapping, plain BPE, added
tokens without strip/normalize flags) this encoder does the same steps in Python with a large
word cache, calling the tokenizer's own BPE model for each new word:

1. split on the added tokens (longest first at each position, as the added vocabulary does);
2. NFC-normalize each piece (a no-op check for normalized text);
3. pre-tokenize with the same regex, its ``\\p{L}``, ``\\p{M}``, ``\\p{N}`` and ``\\s`` spelled out as
   explicit classes (Unicode general categories L*/M*/N*, and the White_Space property);
4. map each pre-token's UTF-8 bytes to the byte-level alphabet and BPE it (cached).

Texts with characters this Python's Unicode database does not know (or lone surrogates) go to the
Rust tokenizer. :class:`FastEncoder` is only built when the tokenizer matches; the caller
(``tokenize_masks``) also checks one text per batch against the Rust tokenizer and drops the
fast path for good on any difference, so a mismatch can cost speed, never correctness.
"""

from __future__ import annotations

import json
import re
import sys
import unicodedata
from typing import Any

_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5/3.6: combining marks (\p{M}) join letter runs instead of splitting them off
_QWEN3_5 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
            r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# the same patterns with {L} {M} {N} {WS} standing for explicit class contents
PATTERNS = {
    _QWEN2: r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n{L}{N}]?[{L}]+|[{N}]| ?[^{WS}{L}{N}]+[\r\n]*"
            r"|[{WS}]*[\r\n]+|[{WS}]+(?![^{WS}])|[{WS}]+",
    _QWEN3_5: r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n{L}{N}]?[{L}{M}]+|[{N}]| ?[^{WS}{L}{M}{N}]+[\r\n]*"
              r"|[{WS}]*[\r\n]+|[{WS}]+(?![^{WS}])|[{WS}]+",
}
# Unicode White_Space (what Oniguruma's \s matches)
_WHITE_SPACE = [(0x09, 0x0D), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680),
                (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F),
                (0x3000, 0x3000)]
_CLASSES: dict[str, Any] = {}
_MAX_WORD = 64
_CACHE_SIZE = 1 << 19


def _class(ranges: list[list[int]]) -> str:
    def esc(cp: int) -> str:
        return f"\\U{cp:08x}"
    return "".join(esc(a) if a == b else f"{esc(a)}-{esc(b)}" for a, b in ranges)


def _unicode_classes() -> dict[str, Any]:
    """Explicit regex classes from this Python's Unicode database (built once per process)."""
    if not _CLASSES:
        groups: dict[str, list[list[int]]] = {"L": [], "M": [], "N": [], "?": []}
        category = unicodedata.category
        for cp in range(sys.maxunicode + 1):
            c = category(chr(cp))
            key = c[0] if c[0] in "LMN" else ("?" if c in ("Cn", "Cs") else None)
            if key is None:
                continue
            ranges = groups[key]
            if ranges and ranges[-1][1] == cp - 1:
                ranges[-1][1] = cp
            else:
                ranges.append([cp, cp])
        _CLASSES["L"] = _class(groups["L"])
        _CLASSES["M"] = _class(groups["M"])
        _CLASSES["N"] = _class(groups["N"])
        _CLASSES["WS"] = _class([list(r) for r in _WHITE_SPACE])
        # unassigned in this Python (Cn) or surrogates: its tables may disagree with the tokenizer's
        _CLASSES["unknown"] = re.compile("[" + _class(groups["?"]) + "]")
    return _CLASSES


def _byte_alphabet() -> list[str]:
    """GPT-2's byte → printable character table (what the ByteLevel pre-tokenizer applies)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0x100))
    table = {b: b for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + n
            n += 1
    return [chr(table[b]) for b in range(256)]


def fast_encoder_for(tok: Any) -> "FastEncoder | None":
    """A :class:`FastEncoder` if ``tok`` is built the way it reproduces exactly, else None."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        norm = backend.normalizer
        if norm is not None and type(norm).__name__ != "NFC":
            return None
        pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer else {}
        model = backend.model
        if (type(model).__name__ != "BPE" or model.dropout or model.byte_fallback
                or model.continuing_subword_prefix or model.end_of_word_suffix):
            return None
        added = backend.get_added_tokens_decoder()
    except Exception:   # another tokenizers version or model type: use the tokenizer itself
        return None
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return None
    split, byte_level = steps
    if not (split.get("type") == "Split" and split.get("behavior") == "Isolated"
            and not split.get("invert") and (split.get("pattern") or {}).get("Regex") in PATTERNS):
        return None
    if not (byte_level.get("type") == "ByteLevel" and not byte_level.get("add_prefix_space")
            and not byte_level.get("use_regex")):
        return None
    if any(a.normalized or a.lstrip or a.rstrip or a.single_word for a in added.values()):
        return None
    return FastEncoder(backend, split["pattern"]["Regex"],
                       {a.content: i for i, a in added.items()}, norm is not None)


class FastEncoder:
    """``encode(text) -> list[int] | None`` (None: the text needs the Rust tokenizer)."""

    def __init__(self, backend: Any, pattern: str, added: dict[str, int], nfc: bool) -> None:
        self.model = backend.model
        self.pattern = PATTERNS[pattern]
        ws = _class([list(r) for r in _WHITE_SPACE if r[1] < 128])
        self.pre_ascii = re.compile(self.pattern.format(L="A-Za-z", M="", N="0-9", WS=ws))
        self._pre_unicode: Any = None
        self._unknown: Any = None
        self.added = added
        names = sorted(added, key=len, reverse=True)
        self.split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None
        self.nfc = nfc
        alphabet = _byte_alphabet()
        self.ascii = str.maketrans({chr(b): alphabet[b] for b in range(128)})
        self.latin1 = str.maketrans({chr(b): alphabet[b] for b in range(256)})
        self.cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int] | None:
        is_ascii = text.isascii()
        if not is_ascii:
            if self._pre_unicode is None:     # built on the first non-ASCII text (slow to build)
                cls = _unicode_classes()
                self._pre_unicode = re.compile(self.pattern.format(
                    L=cls["L"], M=cls["M"], N=cls["N"], WS=cls["WS"]))
                self._unknown = cls["unknown"]
            if self._unknown.search(text):
                return None
        out: list[int] = []
        pieces = self.split.split(text) if self.split is not None else [text]
        for k, piece in enumerate(pieces):
            if k & 1:
                out.append(self.added[piece])
                continue
            if not piece:
                continue
            if not is_ascii and self.nfc and not unicodedata.is_normalized("NFC", piece):
                piece = unicodedata.normalize("NFC", piece)
            self._words(piece, out, is_ascii)
        return out

    def _words(self, piece: str, out: list[int], is_ascii: bool) -> None:
        cache = self.cache
        extend = out.extend
        pre = self.pre_ascii if is_ascii else self._pre_unicode
        for word in pre.findall(piece):
            ids = cache.get(word)
            if ids is None:
                if is_ascii or word.isascii():
                    mapped = word.translate(self.ascii)
                else:
                    mapped = word.encode("utf-8").decode("latin-1").translate(self.latin1)
                ids = [t.id for t in self.model.tokenize(mapped)]
                if len(word) <= _MAX_WORD:
                    if len(cache) >= _CACHE_SIZE:
                        cache.clear()
                    cache[word] = ids
            extend(ids)
