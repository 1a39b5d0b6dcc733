"""The drafter's configuration, read from the target's HF config (object or plain dict).

Draft layers copy the target's layer shapes and RoPE exactly (a different RoPE silently collapses
acceptance), so everything here is taken from the target, never guessed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dflash_model.drafter.layers import default_target_layer_ids, validate_target_layer_ids

FULL = "full_attention"
SLIDING = "sliding_attention"
ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor")  # copied as present


def config_dict(config: Any) -> dict[str, Any]:
    """A plain dict of an HF config (object or mapping); multimodal configs give their text_config."""
    if isinstance(config, Mapping):
        d = dict(config)
    elif hasattr(config, "to_dict"):
        d = config.to_dict()
    else:
        d = dict(vars(config))
    text = d.get("text_config")
    if "hidden_size" not in d and text is not None:
        return config_dict(text)
    return d


def default_gamma(block_size: int) -> float:
    """Loss decay γ: round((B + 5) / 3), which gives the paper's 7 (B=16), 5 (B=10), 4 (B=8)."""
    return float(round((block_size + 5) / 3))


def pick_mask_token_id(vocab_size: int, used: int | Iterable[int]) -> int:
    """First embedding row that is no real token (151669 for Qwen3: 151936 rows, 151669 tokens).

    ``used`` is ``len(tokenizer)`` (ids 0..n-1 are used) or the set of used ids. Where every row is
    a real token this raises: pass a special token id that never occurs in training inputs instead.
    """
    if isinstance(used, int):
        if used < vocab_size:
            return used
    else:
        taken = set(int(i) for i in used)
        for i in range(vocab_size):
            if i not in taken:
                return i
    raise ValueError(
        f"every one of the {vocab_size} embedding rows is a real token; pass mask_token_id= a special "
        "token id that never occurs in training inputs")


@dataclass
class DrafterConfig:
    """Everything needed to build, run and export a drafter (field names follow HF/z-lab)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    vocab_size: int
    num_target_layers: int
    num_layers: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    layer_types: list[str]
    sliding_window: int | None
    rope: dict[str, Any] = field(default_factory=dict)  # the target's ROPE_KEYS fields, verbatim

    @classmethod
    def from_target(cls, target_config: Any, *, num_layers: int = 5, block_size: int = 16,
                    target_layer_ids: Sequence[int] | None = None, mask_token_id: int,
                    layer_types: Sequence[str] | None = None) -> "DrafterConfig":
        """Read layer shapes and RoPE from the target's config.

        ``target_layer_ids`` defaults to ``default_target_layer_ids(L, num_layers)`` (z-lab's rule: as
        many feature layers as draft layers). ``layer_types`` defaults to the target's pattern over
        the first ``num_layers`` layers, with every non-sliding type (full, linear, ...) as full.
        """
        d = config_dict(target_config)
        L = int(d["num_hidden_layers"])
        ids = (default_target_layer_ids(L, num_layers) if target_layer_ids is None
               else validate_target_layer_ids(target_layer_ids, L))
        window = d.get("sliding_window")
        if layer_types is None:
            tl = d.get("layer_types") or [FULL] * L
            layer_types = [SLIDING if tl[i % len(tl)] == SLIDING and window else FULL for i in range(num_layers)]
        heads = int(d["num_attention_heads"])
        cfg = cls(
            hidden_size=int(d["hidden_size"]), intermediate_size=int(d["intermediate_size"]),
            num_attention_heads=heads, num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), hidden_act=d.get("hidden_act", "silu"),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            vocab_size=int(d["vocab_size"]), num_target_layers=L, num_layers=int(num_layers),
            block_size=int(block_size), target_layer_ids=ids, mask_token_id=int(mask_token_id),
            layer_types=list(layer_types), sliding_window=int(window) if window else None,
            rope={k: d[k] for k in ROPE_KEYS if d.get(k) is not None},
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Fail early on shapes the drafter cannot build."""
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = set(self.layer_types) - {FULL, SLIDING}
        if bad:
            raise ValueError(f"unsupported draft layer types {sorted(bad)}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need sliding_window")
        if self.block_size < 2:
            raise ValueError("block_size must be >= 2")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside the embedding table [0, {self.vocab_size})")

    def rope_parameters(self, layer_type: str) -> dict[str, Any]:
        """Normalized RoPE parameters {rope_type, rope_theta, ...} for one layer type (v4 or v5 fields)."""
        p = self.rope.get("rope_parameters")
        if isinstance(p, Mapping) and isinstance(p.get(layer_type), Mapping):
            p = p[layer_type]  # transformers 5: nested per layer type
        if p is None:
            p = dict(self.rope.get("rope_scaling") or {})
        p = dict(p)
        p.setdefault("rope_theta", self.rope.get("rope_theta", 10000.0))
        p["rope_type"] = p.get("rope_type", p.get("type", "default"))
        if "partial_rotary_factor" in self.rope:
            p.setdefault("partial_rotary_factor", self.rope["partial_rotary_factor"])
        if p["rope_type"] in ("llama3", "yarn"):
            p.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        return p

    def to_export_dict(self) -> dict[str, Any]:
        """config.json of the z-lab served format (docs/drafter.md, 'Served format'), field for field."""
        out: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id,
                              "target_layer_ids": list(self.target_layer_ids),
                              "block_size": self.block_size},
            "num_target_layers": self.num_target_layers,
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
        }
        out.update(self.served_rope())
        out.update({
            "max_position_embeddings": self.max_position_embeddings,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "use_sliding_window": SLIDING in self.layer_types,  # Qwen3Config drops the window without it
            "attention_bias": False,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "dtype": "bfloat16",
        })
        return out

    def served_rope(self) -> dict[str, Any]:
        """The drafter's RoPE as config.json fields that transformers 4.x and 5.x both read.

        5.x reads ``rope_parameters`` (with ``rope_scaling`` taking precedence, so both are the
        same); 4.x reads ``rope_theta`` and ``rope_scaling`` and, without ``rope_theta``, silently
        uses base 10,000. The served Qwen3 layer has one RoPE, so draft layer types with different
        RoPE cannot be exported.
        """
        kinds = {lt: self.rope_parameters(lt) for lt in dict.fromkeys(self.layer_types)}
        p = next(iter(kinds.values()))
        if any(q != p for q in kinds.values()):
            raise ValueError(f"draft layer types with different RoPE cannot be served as one Qwen3 model: {kinds}")
        p = {k: v for k, v in p.items() if k != "type"}  # "type": the 4.x alias of rope_type
        scaling = {k: v for k, v in p.items() if k not in ("rope_theta", "partial_rotary_factor")}
        out = {"rope_theta": p["rope_theta"], "rope_scaling": None if p["rope_type"] == "default" else scaling,
               "rope_parameters": p}
        if "partial_rotary_factor" in p:
            out["partial_rotary_factor"] = p["partial_rotary_factor"]
        return out

    @classmethod
    def from_export_dict(cls, d: Mapping[str, Any]) -> "DrafterConfig":
        """Inverse of ``to_export_dict`` (extra keys such as ``dflash_pipe`` are ignored)."""
        dc = d["dflash_config"]
        rope = ({"rope_parameters": d["rope_parameters"]} if isinstance(d.get("rope_parameters"), Mapping)
                else {k: d[k] for k in ROPE_KEYS if d.get(k) is not None})  # our exports: rope_parameters has it all
        cfg = cls(
            hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_attention_heads=d["num_attention_heads"], num_key_value_heads=d["num_key_value_heads"],
            head_dim=d["head_dim"], rms_norm_eps=d["rms_norm_eps"], hidden_act=d.get("hidden_act", "silu"),
            max_position_embeddings=d["max_position_embeddings"], vocab_size=d["vocab_size"],
            num_target_layers=d["num_target_layers"], num_layers=d["num_hidden_layers"],
            block_size=dc.get("block_size", d.get("block_size")), target_layer_ids=list(dc["target_layer_ids"]),
            mask_token_id=dc["mask_token_id"],
            layer_types=list(d.get("layer_types") or [FULL] * d["num_hidden_layers"]),
            sliding_window=d.get("sliding_window"), rope=rope,
        )
        cfg.validate()
        return cfg

