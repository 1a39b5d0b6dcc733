"""Hybrid targets under a transformers older than they need (``compat.HYBRID``): refused up front
with the version named, whichever way they are given. This file runs under the newest transformers
(where such a target loads) and under the lowest supported one (where it is refused:
``tests/test_transformers_floor.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_model.target import compat
from dflash_model.target.load import load_target
from dflash_model.target.smollm2 import SMOLLM2_INSTALL_HINT, is_smollm2_available
from dflash_model.target.spec_cache import linear_state_layers
from dflash_model.target.spec_decode import new_cache
from tests.transformers_versions import needs_hybrid

REAL_CONFIG = Path(__file__).parents[1] / "stages" / "data" / "qwen3_6_27b_config.json"
TINY_HYBRID = {"model_type": "qwen3_5_text", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "linear_num_key_heads": 2,
               "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
               "linear_conv_kernel_dim": 4, "tie_word_embeddings": False}


def test_hybrid_configs_are_told_apart_from_dense_ones() -> None:
    real = json.loads(REAL_CONFIG.read_text())
    assert compat.hybrid_config(real)  # composite: the text part is qwen3_5_text
    assert compat.hybrid_config(TINY_HYBRID)
    assert compat.hybrid_config({"model_type": "some_hybrid", "layer_types": ["linear_attention", "full_attention"]})
    assert not compat.hybrid_config({"model_type": "qwen3", "layer_types": ["full_attention"] * 2})
    assert not compat.hybrid_config({"model_type": "llama"})


def _configs(tmp_path: Path) -> tuple[Path, Path]:
    """(a checkpoint directory with Qwen3.6-27B's config.json and nothing else, a tiny hybrid's
    config.json)."""
    (tmp_path / "config.json").write_text(REAL_CONFIG.read_text())
    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps(TINY_HYBRID))
    return tmp_path, tiny


@needs_hybrid
def test_a_hybrid_target_loads_from_its_version(tmp_path: Path) -> None:
    _, tiny = _configs(tmp_path)
    lm, _ = load_target(f"random:{tiny}", "cpu", "float32", "sdpa")
    assert len(linear_state_layers(new_cache(lm))) == 1


@pytest.mark.skipif(compat.installed_at_least(compat.HYBRID),
                    reason=f"transformers>={compat.HYBRID} runs hybrid targets")
def test_a_hybrid_target_is_refused_before_its_version(tmp_path: Path) -> None:
    """``random:`` with a preset or a config.json, and a checkpoint directory: refused before its
    tokenizer or weights are looked for (this one has neither)."""
    import transformers

    checkpoint, tiny = _configs(tmp_path)
    for ref in ("random:qwen3.6-27b", f"random:{tiny}", str(checkpoint)):
        with pytest.raises(compat.TransformersTooOld) as err:
            load_target(ref, "cpu", "float32", "sdpa")
        need = f"transformers>={compat.HYBRID}"
        assert str(err.value) == (f"{ref} is a hybrid (linear-attention) target: it needs {need}, "
                                  f"{transformers.__version__} is installed (pip install '{need}')")


@pytest.mark.skipif(not compat.installed_at_least("5.25.0"),
                    reason="transformers before 5.25 leaves hub kernels off unless asked")
@pytest.mark.skipif(not is_smollm2_available(), reason=f"SmolLM2 weights not installed; {SMOLLM2_INSTALL_HINT}")
def test_targets_load_without_hub_kernels(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """From 5.25 transformers kernelizes every ``from_pretrained`` model by default with code the
    ``kernels`` package fetches from the hub; our loads turn that off (offline, and each target's
    own math on every machine): a saved model, the same saved as an FP8 checkpoint, and SmolLM2."""
    from dflash_model.target import fp8
    from tests.stages.online_fixtures import tiny_target

    saved = tiny_target(tmp_path_factory.getbasetemp())
    model, _ = load_target(str(saved), "cpu", "float32", "sdpa")
    fp8.save_fp8_checkpoint(model, tmp_path / "fp8")
    for ref in (str(saved), str(tmp_path / "fp8"), "smollm2"):
        lm, _ = load_target(ref, "cpu", "float32", "sdpa")
        assert lm.use_kernels is False, ref
