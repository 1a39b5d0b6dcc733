"""The drafter train:dflash starts from: its attention shape and RoPE, its mask token, its weights.

Shape. Serving engines (vLLM, SGLang, z-lab's loader) build an exported drafter as plain Qwen3
layers from its config.json: heads, head_dim and a full-rotary RoPE at ``rope_theta``. A drafter
copied from a hybrid Qwen3.5/3.6 target's gated attention (24 q / 4 kv heads of 256, partial
rotary, mRoPE) cannot be written that way, so for that family the default is the drafter z-lab
published for it (``PUBLISHED``); dense targets keep their own attention layer, as z-lab's Qwen3
drafters do. ``drafter_shape`` / ``drafter_attention`` override the choice. The MLP is as wide as
the target's unless ``intermediate_size`` says otherwise (a width to sweep: docs/drafter.md).

Weights. Seeded random init, or ``init_from``: an existing export (say a published drafter, to
continue training it on your own data), whose architecture is then the one trained. An export
made for another target or another run shape is refused before anything is loaded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from dflash_core import StageContext
    from dflash_model.drafter import DFlashDrafter, DrafterConfig
    from dflash_stages.train.config import TrainConfig


@dataclass(frozen=True)
class PublishedDrafter:
    """A drafter shape published for a target family."""

    name: str
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    vocab_size: int
    """The embedding table ``mask_token_id`` belongs to (used only for targets with this vocab)."""
    mask_token_id: int


_QWEN3_5 = PublishedDrafter("z-lab's Qwen3.5-27B DFlash drafter", num_attention_heads=32,
                            num_key_value_heads=8, head_dim=128, rope_theta=1e7,
                            vocab_size=248320, mask_token_id=248070)  # <|audio_start|>
PUBLISHED: dict[str, PublishedDrafter] = {"qwen3_5": _QWEN3_5, "qwen3_5_text": _QWEN3_5}
"""Target ``model_type`` -> the published drafter of its family."""

INIT_CHECKS = {
    "hidden_size": "the target's", "vocab_size": "the target's",
    "num_target_layers": "the target's", "target_layer_ids": "extract's layers",
    "block_size": "train block_size", "num_layers": "train num_layers",
}
"""Fields an ``init_from`` export must share with this run, and where this run's value comes from."""


def drafter_config(header: dict[str, Any], cfg: TrainConfig) -> tuple[DrafterConfig, str]:
    """The drafter this run builds from extract's target header, and where its shape came from."""
    from dflash_model.drafter.config import DrafterConfig, config_dict, pick_mask_token_id

    target = config_dict(header["config"])
    published = PUBLISHED.get(str(target.get("model_type")))
    shape = cfg.drafter_shape
    if shape == "auto":
        shape = "published" if published else "target"
    if shape == "published" and published is None:
        raise ValueError(f"drafter_shape: published: no published drafter for model_type "
                         f"{target.get('model_type')!r} (known: {', '.join(sorted(PUBLISHED))}); "
                         "use target or auto")
    rows = int(header["embed_weight"].shape[0])
    mask, source = cfg.mask_token_id, "the target's attention layer"
    changes: dict[str, Any] = {}  # DrafterConfig fields replacing what from_target read
    if shape == "published":
        changes = {"num_attention_heads": published.num_attention_heads,
                   "num_key_value_heads": published.num_key_value_heads,
                   "head_dim": published.head_dim, "rope": {"rope_theta": published.rope_theta}}
        source = f"published ({published.name})"
        if mask is None and rows == published.vocab_size:
            mask = published.mask_token_id
    explicit = {k: v for k, v in dataclasses.asdict(cfg.drafter_attention).items()
                if v is not None} if cfg.drafter_attention else {}
    if explicit:
        theta = explicit.pop("rope_theta", None)
        changes.update(explicit)
        if theta is not None:
            changes["rope"] = {"rope_theta": float(theta)}
        source += " + drafter_attention"
    if cfg.intermediate_size is not None:
        changes["intermediate_size"] = cfg.intermediate_size
        source += " + intermediate_size"
    if mask is None:
        mask = pick_mask_token_id(rows, header["tokenizer_len"])
    base = DrafterConfig.from_target(target, num_layers=cfg.num_layers, block_size=cfg.block_size,
                                     target_layer_ids=header["target_layer_ids"], mask_token_id=mask)
    out = dataclasses.replace(base, **changes)
    out.validate()
    return out, source


def init_mismatches(exported: DrafterConfig, run: DrafterConfig, explicit: Mapping[str, int | None]) -> list[str]:
    """One line per field where an export does not fit this run (empty: it fits). ``explicit``: the
    train params that name a drafter field (``mask_token_id``, ``intermediate_size``), checked only
    where the run sets them; unset, the export's value is the one trained."""
    out = [f"{name}: {getattr(exported, name)} in the export, {getattr(run, name)} here ({where})"
           for name, where in INIT_CHECKS.items() if getattr(exported, name) != getattr(run, name)]
    out += [f"{name}: {getattr(exported, name)} in the export, {value} here (train {name})"
            for name, value in explicit.items() if value is not None and getattr(exported, name) != value]
    return out


def describe(c: DrafterConfig) -> str:
    """One line of the drafter's shape, for the log and the run summary."""
    from dflash_model.drafter.config import FULL

    rope = c.rope_parameters(FULL)
    rotary = float(rope.get("partial_rotary_factor", 1.0))
    return (f"{c.num_layers} layers, {c.num_attention_heads} q / {c.num_key_value_heads} kv heads "
            f"x {c.head_dim}, MLP {c.intermediate_size}, rope_theta {float(rope['rope_theta']):g}"
            f"{'' if rotary == 1.0 else f' (rotary {rotary:g})'}, mask token {c.mask_token_id}")


def build_drafter(header: dict[str, Any], cfg: TrainConfig, ctx: StageContext) -> DFlashDrafter:
    """The drafter to train, on the CPU in float32 (the caller moves it); logged and recorded in
    the run summary (``drafter``: the shape, ``drafter_source``: where it came from)."""
    import torch

    from dflash_model.drafter import DFlashDrafter, DrafterConfig, load_drafter, read_export_config

    run, source = drafter_config(header, cfg)
    if cfg.init_from:
        exported = DrafterConfig.from_export_dict(read_export_config(cfg.init_from))
        bad = init_mismatches(exported, run, {"mask_token_id": cfg.mask_token_id,
                                              "intermediate_size": cfg.intermediate_size})
        if bad:
            raise ValueError(f"init_from {cfg.init_from}: this drafter was made for another target "
                             f"or run shape: " + "; ".join(bad))
        model = load_drafter(cfg.init_from, dtype=torch.float32, attn_backend=cfg.attn_backend)
        source = f"init_from {cfg.init_from}"
    else:
        model = DFlashDrafter(run, attn_backend=cfg.attn_backend)
    shape = describe(model.config)
    ctx.logger.info("drafter: %s (%s)", shape, source)
    ctx.summary.update(drafter=shape, drafter_source=source)
    return model
