"""What differs across the supported transformers versions (4.57.1 and later), in one place.

4.57.1 is the floor because it is what z-lab's reference loader pins, so a user serving our exports
may have nothing newer; the cache layers our decoding uses (``DynamicLayer``, ``is_initialized``)
are there since 4.57.0. Hybrid targets (linear-attention layers: Qwen3.5 / 3.6) need more: speculative
decoding rolls their state back through their cache layers' ``LinearAttentionCacheLayerMixin``
conv and recurrent state dicts, a layout transformers has since 5.14 (the model code came in 5.2,
the mixin in 5.5 with one state tensor each). An older transformers would fail on them deep inside,
on an unknown model type or a missing class or attribute; :func:`check_target_config` says so up
front instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

HYBRID = "5.14.0"
"""The oldest transformers that runs hybrid targets (their linear-attention state in dicts per layer)."""

NO_HUB_KERNELS: dict[str, Any] = {"use_kernels": False}
"""``from_pretrained`` keywords for every model we load. transformers 5.25 turned hub kernels on by
default (``kernels`` swaps layers for code fetched from the Hugging Face hub at run time); we load
offline, and the features must be the model's own math on every machine. 4.57.1 takes the keyword too."""


class TransformersTooOld(RuntimeError):
    """A model needs a newer transformers than the one installed."""


def installed_at_least(version: str) -> bool:
    """Whether the installed transformers is ``version`` or newer."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version(version)


def hybrid_config(config: Mapping[str, Any]) -> bool:
    """Whether a config.json's content describes a model with linear-attention layers: a Qwen3.5 /
    3.6 one (``qwen3_5*``, whether or not it lists its layer types) or any listing such layers."""
    for part in (config, config.get("text_config") or {}):
        if str(part.get("model_type", "")).startswith("qwen3_5"):
            return True
        if "linear_attention" in (part.get("layer_types") or ()):
            return True
    return False


def check_target_config(config: Mapping[str, Any], name: str) -> None:
    """Raise :class:`TransformersTooOld` when ``config`` (a config.json's content) is a hybrid
    target and the installed transformers is older than :data:`HYBRID`."""
    if hybrid_config(config) and not installed_at_least(HYBRID):
        import transformers

        raise TransformersTooOld(f"{name} is a hybrid (linear-attention) target: it needs transformers>={HYBRID}, "
                                 f"{transformers.__version__} is installed (pip install 'transformers>={HYBRID}')")


def check_checkpoint(name: str) -> None:
    """:func:`check_target_config` on the config.json of a directory or hub name."""
    from transformers import PretrainedConfig

    config, _ = PretrainedConfig.get_config_dict(name)
    check_target_config(config, name)


def auto_tokenizer(name: str, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained(name, **kwargs)``; a tokenizer saved by transformers 5 as its
    generic tokenizer.json class (``TokenizersBackend``, Qwen3.5 / 3.6) loads under 4.x as that
    class's equivalent there, ``PreTrainedTokenizerFast`` (4.x knows no ``TokenizersBackend``)."""
    import transformers
    from transformers import AutoTokenizer

    if not hasattr(transformers, "TokenizersBackend"):
        from transformers.models.auto.tokenization_auto import get_tokenizer_config

        if get_tokenizer_config(name, **kwargs).get("tokenizer_class") == "TokenizersBackend":
            return transformers.PreTrainedTokenizerFast.from_pretrained(name, **kwargs)
    return AutoTokenizer.from_pretrained(name, **kwargs)
