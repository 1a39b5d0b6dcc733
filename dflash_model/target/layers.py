"""Finding the decoder layers of any HF causal LM (vision-language ones included), by shape.

Layer ids count from here: id t is the output of ``decoder_layers(model)[t]``. Feature capture,
linear-attention patching and the target's compile all start from this list.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def text_config(config: Any) -> Any:
    """The language model's config: a composite (vision-language) config's ``text_config``,
    any other config itself."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of any HF causal LM, found by shape rather than by name:
    the ModuleList of identical blocks whose length is the (text) config's ``num_hidden_layers``,
    looked for in the decoder first — a vision tower's blocks can be as many or more."""
    n = getattr(text_config(getattr(model, "config", None)), "num_hidden_layers", None)
    for root in (base_model(model), model):
        best: nn.ModuleList | None = None
        for _, module in root.named_modules():
            if isinstance(module, nn.ModuleList) and len(module) > 0:
                if len({type(m) for m in module}) != 1:
                    continue
                if n is not None and len(module) != n:
                    continue
                if best is None or len(module) > len(best):
                    best = module
        if best is not None:
            return best
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def base_model(model: nn.Module) -> nn.Module:
    """The transformer without its LM head (``model.model`` for most HF causal LMs)."""
    getter = getattr(model, "get_decoder", None)
    if callable(getter):
        try:
            return getter()
        except (AttributeError, NotImplementedError):
            pass
    return getattr(model, getattr(model, "base_model_prefix", "model"), model)
