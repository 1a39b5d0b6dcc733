"""FP8 targets in the block-scaled format Qwen publishes (Qwen3-*-FP8, Qwen3.6-27B-FP8; DeepSeek-V3's).

The format: each quantized linear layer's ``weight`` is float8_e4m3fn, and ``weight_scale_inv`` holds
one float scale per 128×128 block of it (the weight is fp8 × its block's scale; blocks at the edges
may be partial); config.json has a ``quantization_config`` (``quant_method: fp8``, ``fmt: e4m3``,
``activation_scheme: dynamic``, ``weight_block_size: [128, 128]``, ``modules_to_not_convert``).
Activations are quantized at run time, per token in groups of 128 along the input dimension.

transformers runs this format through a kernel it downloads at run time, so we load it ourselves:
transformers builds the model and loads every tensor (a quantized weight is cast to the model's
dtype, which holds an e4m3 value exactly), then each linear layer the checkpoint stores quantized
becomes an :class:`FP8BlockLinear` holding the fp8 weight and its block scales. Everything else
stays as the checkpoint has it.

:func:`quantize_blocks` is our own quantizer of a weight to that format (scale = block amax / 448):
:func:`save_fp8_checkpoint` writes a model in the format and ``random:NAME-fp8`` presets build
random targets in it. docs/fp8_target.md says what is tested where.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from dflash_model.fast.compile_gate import compiled
from dflash_model.fast.settings import triton_installed
from dflash_model.target.compat import NO_HUB_KERNELS

FP8 = torch.float8_e4m3fn
BLOCK = 128
# cuBLASLt refuses a block-scaled product whose row count is no multiple of 4 (seen on an H200,
# torch 2.11, CUDA 13: 1-3, 17 and 999 rows refused, 4, 12, 100 and 1000 taken)
PRODUCT_ROWS = 4
SCALE_SUFFIX = "weight_scale_inv"
NOT_CONVERTED = ("lm_head", "embed_tokens", "in_proj_a", "in_proj_b", "model.visual", "mtp")
"""What Qwen's FP8 checkpoints keep unquantized among linear layers (the LM head; the Gated
DeltaNet's small ``in_proj_a`` / ``in_proj_b``; the vision tower; the MTP head), as
``modules_to_not_convert`` patterns; embeddings, norms and convolutions are not linear layers."""


def quantization_config(block: Sequence[int] = (BLOCK, BLOCK),
                        not_converted: Sequence[str] = NOT_CONVERTED) -> dict[str, Any]:
    """The ``quantization_config`` of config.json for this format."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [int(b) for b in block], "modules_to_not_convert": list(not_converted)}


def fp8_config(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The block-scaled FP8 ``quantization_config`` of a config.json's content (top level or its
    ``text_config``), or None when the checkpoint is not in that format. Other fp8 variants
    (static activations, per-tensor scales, another element format) are refused."""
    for part in (config, config.get("text_config") or {}):
        q = part.get("quantization_config")
        if q and q.get("quant_method") == "fp8":
            block = q.get("weight_block_size")
            if (q.get("fmt", "e4m3") != "e4m3" or q.get("activation_scheme", "dynamic") != "dynamic"
                    or not block or len(block) != 2):
                raise ValueError(f"only block-scaled e4m3 FP8 with dynamic activations is supported, "
                                 f"got quantization_config {q}")
            return dict(q)
    return None


def converted(name: str, not_converted: Iterable[str]) -> bool:
    """Whether the linear layer ``name`` is quantized under ``modules_to_not_convert`` patterns: a
    pattern keeps a module in bf16 when it matches the name from its start up to a dot (as a regex,
    so ``model.layers.*.mlp`` works) or is a dotted suffix of it (``lm_head``, ``in_proj_a``), as
    transformers reads them."""
    return not any(re.match(rf"(?:{p})(?:\.|$)", name) or name.endswith(f".{p}") for p in not_converted)


def _blocks(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t`` [N, K] zero-padded to whole blocks and viewed as [N/rows, rows, K/cols, cols]."""
    n, k = t.shape
    pad_n, pad_k = -n % rows, -k % cols
    if pad_n or pad_k:
        t = nn.functional.pad(t, (0, pad_k, 0, pad_n))
    return t.reshape((n + pad_n) // rows, rows, (k + pad_k) // cols, cols)


def scale_of(amax: torch.Tensor, dtype: torch.dtype = FP8) -> torch.Tensor:
    """amax / (``dtype``'s largest value: 448 for e4m3), with 1 for an all-zero block (which any
    scale represents exactly)."""
    return torch.where(amax > 0, amax / torch.finfo(dtype).max, torch.ones_like(amax))


def to_fp8(scaled: torch.Tensor, dtype: torch.dtype = FP8) -> torch.Tensor:
    """Round to ``dtype`` (nearest even), written row-major whatever ``scaled``'s layout; the clamp
    guards the rounding of x / scale just above the largest value, which the cast would turn into NaN."""
    top = torch.finfo(dtype).max
    return scaled.clamp(-top, top).to(dtype, memory_format=torch.contiguous_format)


def quantize_blocks(weight: torch.Tensor, block: Sequence[int] = (BLOCK, BLOCK)
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight [N, K], float32 scales [ceil(N/bn), ceil(K/bk)]): each block divided by its
    amax / 448 and rounded to e4m3, the published convention (``weight_scale_inv`` = amax / 448)."""
    n, k = weight.shape
    b = _blocks(weight.float(), *block)
    scale = scale_of(b.abs().amax(dim=(1, 3)))
    q = to_fp8(b / scale[:, None, :, None])
    return q.reshape(b.shape[0] * block[0], -1)[:n, :k].contiguous(), scale


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block: Sequence[int] = (BLOCK, BLOCK)
                      ) -> torch.Tensor:
    """The float32 weight an fp8 weight and its block scales stand for: each element times the
    scale of its block."""
    n, k = weight.shape
    full = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return weight.float() * full[:n, :k]


def quantize_groups(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: (fp8 x [..., K], float32 scales [..., ceil(K/group)]), each
    token's groups of ``group`` columns divided by their amax / 448 and rounded to e4m3."""
    k = x.shape[-1]
    pad = -k % group
    g = nn.functional.pad(x.float(), (0, pad)).unflatten(-1, (-1, group))
    scale = scale_of(g.abs().amax(dim=-1))
    q = to_fp8(g / scale[..., None]).flatten(-2)[..., :k]
    return q, scale


def dequantize_groups(x: torch.Tensor, scale: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    """The float32 activations fp8 ``x`` and its per-token group scales stand for."""
    return x.float() * scale.repeat_interleave(group, -1)[..., :x.shape[-1]]


FP8_COMPUTE_CAPABILITY = (8, 9)
"""The first CUDA compute capability with FP8 tensor cores (Ada; Hopper and Blackwell after it)."""


def fp8_product_available(device: torch.device) -> bool:
    """Whether ``device`` has FP8 tensor cores for ``torch._scaled_mm`` (CUDA, compute capability
    :data:`FP8_COMPUTE_CAPABILITY` or newer)."""
    if device.type != "cuda":
        return False
    props = torch.cuda.get_device_properties(device)  # constant-folded inside a compiled layer
    return (props.major, props.minor) >= FP8_COMPUTE_CAPABILITY


def _quantize_columns(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_groups` with the scales laid out column-major, as ``_scaled_mm``'s 1×128
    block scaling wants them."""
    q, scale = quantize_groups(x)
    return q, scale.t().contiguous().t()


@functools.cache
def _compiled_quantize() -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    return compiled(_quantize_columns, dynamic=True)


def _quantize_for_product(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_quantize_columns` as fused kernels rather than eight eager ops: traced into the graph
    of a compiled decoder layer that calls it (Inductor fuses it with the ops around it); else on
    CUDA the single-pass Triton kernel of ``fast.fp8_quant_triton`` (Inductor's kernels for this
    function alone are a reduction, a pointwise pass and copies); else compiled on its own."""
    if torch.compiler.is_compiling():
        return _quantize_columns(x)
    if x.is_cuda and triton_installed():
        from dflash_model.fast.fp8_quant_triton import quantize_columns

        return quantize_columns(x)
    return _compiled_quantize()(x)


class FP8BlockLinear(nn.Module):
    """A linear layer of a block-scaled FP8 checkpoint: ``weight`` float8_e4m3fn [out, in] and
    ``weight_scale_inv`` float32, one scale per ``block`` of the weight (names as in the checkpoint).

    The activation is quantized per token in groups of ``block[1]`` input columns (dynamic scale:
    amax / 448). With FP8 tensor cores the product is ``torch._scaled_mm`` on the fp8 operands
    and both block scales; elsewhere it is the reference the product approximates: the quantized
    activation and the weight dequantized, multiplied in float32 (CPU tests check this path), or in
    the activation's half precision for bf16 / fp16 activations (:meth:`reference_product`)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 block: Sequence[int] = (BLOCK, BLOCK)) -> None:
        super().__init__()
        if weight.dtype != FP8:
            raise TypeError(f"FP8BlockLinear takes a float8_e4m3fn weight, got {weight.dtype}")
        want = (-(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1]))
        if tuple(scale.shape) != want:
            raise ValueError(f"a [{weight.shape[0]}, {weight.shape[1]}] weight in {block[0]}x{block[1]} "
                             f"blocks has {want} scales, got {tuple(scale.shape)}")
        self.out_features, self.in_features = weight.shape
        self.block = (int(block[0]), int(block[1]))
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale.float(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        # a layer whose shape the block-scaled product cannot take always runs the reference math:
        # its weight is dequantized once here (moved with the model, never saved), not at every call
        self.register_buffer("dequantized", None if self.shape_fits_product() else self.dequantized_weight(),
                             persistent=False)

    @classmethod
    def quantized(cls, linear: nn.Linear, block: Sequence[int] = (BLOCK, BLOCK)) -> FP8BlockLinear:
        """``linear``'s weight quantized by :func:`quantize_blocks` (its bias kept as it is)."""
        weight, scale = quantize_blocks(linear.weight.detach(), block)
        return cls(weight, scale, linear.bias, block)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block={self.block}, bias={self.bias is not None}")

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight this layer stands for."""
        return dequantize_blocks(self.weight, self.weight_scale_inv, self.block)

    def shape_fits_product(self) -> bool:
        """128-wide groups and whole blocks on both operands, which block scaling in ``_scaled_mm``
        wants (SmolLM2's 576 and 1,536 columns are no multiple of 128)."""
        return self.block == (BLOCK, BLOCK) and self.in_features % BLOCK == 0 and self.out_features % BLOCK == 0

    def fp8_product_fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through :meth:`fp8_product`: FP8 tensor cores and a shape they take."""
        return fp8_product_available(x.device) and self.shape_fits_product()

    def _float_weight(self) -> torch.Tensor:
        return self.dequantized if self.dequantized is not None else self.dequantized_weight()

    def fp8_product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, in] -> [M, out] in rows' dtype: the fused activation quantization, then the
        product of the fp8 operands with both block scales on the tensor cores. Rows are padded
        with zeros to a multiple of ``PRODUCT_ROWS``; each token is quantized on its own, so the
        padding changes no other row."""
        m = rows.shape[0]
        pad = -m % PRODUCT_ROWS
        q, scale = _quantize_for_product(nn.functional.pad(rows, (0, 0, 0, pad)) if pad else rows)
        out = torch._scaled_mm(q, self.weight.t(), scale_a=scale, scale_b=self.weight_scale_inv.t(),
                               out_dtype=rows.dtype)
        return out[:m] if pad else out

    def reference_product(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """rows [M, in] -> [M, out] in ``dtype`` (default float32, float64 for float64 rows): the math
        :meth:`fp8_product` approximates, on any device: the activation quantized and dequantized,
        times the dequantized weight, multiplied in ``dtype``. In bf16 each dequantized operand is
        within 2^-9 of its value (e4m3's own steps are 2^-4), and a GPU runs it at the bf16 rate,
        which the float32 product does not: ``forward`` takes it for half-precision activations."""
        q, scale = quantize_groups(rows, self.block[1])
        dtype = dtype or torch.promote_types(rows.dtype, torch.float32)
        return dequantize_groups(q, scale, self.block[1]).to(dtype) @ self._float_weight().to(dtype).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.fp8_product_fits(x):
            out = self.fp8_product(rows)
        else:
            half = rows.dtype in (torch.bfloat16, torch.float16)
            out = self.reference_product(rows, rows.dtype if half else None).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """The model's ``nn.Linear`` modules by name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def quantize_model(model: nn.Module, block: Sequence[int] = (BLOCK, BLOCK),
                   not_converted: Sequence[str] = NOT_CONVERTED) -> list[str]:
    """Replace every linear layer of ``model`` but those ``not_converted`` names (see
    :func:`converted`) by its :class:`FP8BlockLinear`, one layer at a time (the peak memory is the
    model's plus one layer's); the names replaced."""
    names = [n for n in linear_layers(model) if converted(n, not_converted)]
    for name in names:
        _replace(model, name, FP8BlockLinear.quantized(model.get_submodule(name), block))
    return names


def dequantize_model(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Replace every :class:`FP8BlockLinear` of ``model`` by an ``nn.Linear`` of its dequantized
    weight in ``dtype``: the same weights without the FP8 products, the reference FP8 features are
    measured against; the names replaced."""
    names = [n for n, m in model.named_modules() if isinstance(m, FP8BlockLinear)]
    for name in names:
        q = model.get_submodule(name)
        linear = nn.Linear(q.in_features, q.out_features, bias=q.bias is not None,
                           device=q.weight.device, dtype=dtype)
        linear.weight.data = q.dequantized_weight().to(dtype)
        if q.bias is not None:
            linear.bias.data = q.bias.detach().to(dtype)
        linear.requires_grad_(False)
        _replace(model, name, linear)
    return names


def _safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no .safetensors files")
    return files


def save_fp8_checkpoint(model: nn.Module, path: str | Path, block: Sequence[int] = (BLOCK, BLOCK),
                        not_converted: Sequence[str] = NOT_CONVERTED, max_shard_size: str | int = "5GB"
                        ) -> list[str]:
    """Write ``model`` (a transformers model in a float dtype) to ``path`` in the published FP8
    format: ``save_pretrained`` (shards of ``max_shard_size`` before quantization), then each
    converted linear layer's weight replaced in the safetensors files by :func:`quantize_blocks`'s
    fp8 weight and ``weight_scale_inv`` (the shard index updated), and the ``quantization_config``
    added to config.json. Returns the checkpoint names quantized."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    wanted = {f"{n}.weight" for n in linear_layers(model) if converted(n, not_converted)}
    done: list[str] = []
    for file in _safetensors_files(path):
        tensors = load_file(file)
        for key in sorted(wanted & tensors.keys()):
            tensors[key], tensors[key[:-len("weight")] + SCALE_SUFFIX] = quantize_blocks(tensors[key], block)
            done.append(key[:-len(".weight")])
        save_file(tensors, file, metadata={"format": "pt"})
    missing = wanted - {f"{n}.weight" for n in done}
    if missing:  # save_pretrained renamed them: the checkpoint's names are not the model's
        raise ValueError(f"{path}: linear weights not found under the model's names: {sorted(missing)[:4]}")
    if (index := path / "model.safetensors.index.json").exists():
        raw = json.loads(index.read_text())
        for name in done:
            raw["weight_map"][f"{name}.{SCALE_SUFFIX}"] = raw["weight_map"][f"{name}.weight"]
        index.write_text(json.dumps(raw, indent=2))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config(block, not_converted)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return done


def checkpoint_scales(path: str | Path) -> dict[str, torch.Tensor]:
    """Every ``weight_scale_inv`` of a checkpoint directory, by its module's checkpoint name."""
    from safetensors import safe_open

    scales: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(Path(path)):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if key.endswith(f".{SCALE_SUFFIX}"):
                    scales[key[:-len(SCALE_SUFFIX) - 1]] = f.get_tensor(key)
    return scales


def model_name(checkpoint_name: str, names: Iterable[str]) -> str | None:
    """The model's name for a module named ``checkpoint_name`` in the checkpoint: the same, or the
    name less one dotted part (a composite checkpoint's ``model.language_model.layers.0...`` is
    the text model's ``model.layers.0...``); None when neither is among ``names``."""
    names = set(names)
    if checkpoint_name in names:
        return checkpoint_name
    parts = checkpoint_name.split(".")
    found = {".".join(parts[:i] + parts[i + 1:]) for i in range(len(parts))} & names
    if len(found) > 1:
        raise ValueError(f"checkpoint module {checkpoint_name} matches several modules: {sorted(found)}")
    return found.pop() if found else None


def attach_checkpoint_scales(model: nn.Module, path: str | Path, block: Sequence[int]) -> list[str]:
    """Turn each linear layer of a model that transformers loaded from an FP8 checkpoint (its
    quantized weights cast to the model's dtype, exact) into an :class:`FP8BlockLinear` with the
    checkpoint's scales; the model's names of the layers turned. A scale for a module the model
    does not have as a linear layer (the vision tower, the MTP head of a text-only load) is left."""
    linears = linear_layers(model)
    done: list[str] = []
    for ckpt_name, scale in checkpoint_scales(path).items():
        name = model_name(ckpt_name, linears)
        if name is None:
            continue
        linear = linears[name]
        weight = linear.weight.detach()
        q = weight.to(FP8)
        if not torch.equal(q.to(weight.dtype), weight):
            raise ValueError(f"{path}: {ckpt_name}.weight has a scale but was not stored as e4m3 values")
        _replace(model, name, FP8BlockLinear(q, scale.to(weight.device), linear.bias, block))
        done.append(name)
    return done


def checkpoint_fp8_config(name: str) -> dict[str, Any] | None:
    """:func:`fp8_config` of a checkpoint's config.json (a directory or hub name). An FP8 checkpoint
    must be a local directory: its scales are read from its files."""
    from transformers import PretrainedConfig

    config, _ = PretrainedConfig.get_config_dict(name)
    quant = fp8_config(config)
    if quant is not None and not Path(name).is_dir():
        raise ValueError(f"{name} is an FP8 checkpoint: download it to a directory first "
                         f"(hf download {name} --local-dir DIR) and give DIR as the model")
    return quant


def _scales_only_report(record: logging.LogRecord) -> bool:
    """Drop transformers' load report when all it reports is the scales as unexpected keys (they
    are read next); any other report passes."""
    lines = [line for line in record.getMessage().splitlines() if "UNEXPECTED" in line and "|" in line]
    return not lines or any(SCALE_SUFFIX not in line for line in lines)


def load_fp8_target(path: str, quant: Mapping[str, Any], torch_dtype: torch.dtype,
                    attn_implementation: str) -> nn.Module:
    """A causal LM from a block-scaled FP8 checkpoint directory (``quant``: its quantization_config),
    on the CPU: transformers loads it as if unquantized (fp8 weights cast to ``torch_dtype``, which
    holds every e4m3 value), then :func:`attach_checkpoint_scales` makes its quantized linear
    layers FP8 again."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    for part in {id(c): c for c in (config, getattr(config, "text_config", None)) if c is not None}.values():
        if hasattr(part, "quantization_config"):
            del part.quantization_config  # else transformers' own fp8 path runs (a hub kernel)
    report = logging.getLogger("transformers.modeling_utils")
    report.addFilter(_scales_only_report)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch_dtype,
                                                     attn_implementation=attn_implementation, **NO_HUB_KERNELS)
    finally:
        report.removeFilter(_scales_only_report)
    if not attach_checkpoint_scales(model, path, quant["weight_block_size"]):
        raise ValueError(f"{path}: its config says FP8, but no weight of the model has a {SCALE_SUFFIX}")
    return model
