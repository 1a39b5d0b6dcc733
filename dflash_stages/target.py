"""The frozen target LLM: load it, find its decoder layers, capture chosen layers' outputs.

Shared by the extract stage (training features) and the evaluate stage (features of
verified tokens during speculative decoding), so both read exactly the same hidden states —
the ±1 layer-id convention is decided here once: id t = output of decoder layer t
(0-based) = HF ``hidden_states[t + 1]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, TypeVar

import torch
from torch import nn

from dflash_core.drafter.layers import validate_target_layer_ids


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """``auto`` = bf16 on CUDA, float32 elsewhere (CPU bf16 matmuls are slow and inexact)."""
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
            "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}[name]


T = TypeVar("T")
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
    # no public model: small enough to try a multi-process layout on CPU in seconds
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
    # Qwen3.6-27B's text model (DESIGN §10): 16 x [3 Gated DeltaNet + 1 gated full attention]
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


class _NoTokenizer:
    """Stands in for the tokenizer of a random-weight target: every row but the last is 'used'."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.all_special_ids: list[int] = []

    def __len__(self) -> int:
        return self.vocab_size - 1


def text_config(config: Any) -> Any:
    """The language model's config: a composite (vision-language) config's ``text_config``,
    any other config itself."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def random_config(name: str) -> Any:
    """The HF config ``random:NAME`` builds (a preset or a config.json path): its text model's,
    so that benchmarks size the drafter from the very config the trainer would see."""
    import json

    from transformers import AutoConfig

    if name in PRESETS:
        raw = dict(PRESETS[name]) if "model_type" in PRESETS[name] else {**QWEN3_PRESET, **PRESETS[name]}
    else:
        with open(name) as f:
            raw = json.load(f)
    return text_config(AutoConfig.for_model(raw.pop("model_type"), **raw))


def random_target(spec: str, device: str, torch_dtype: torch.dtype,
                  attn_implementation: str) -> tuple[nn.Module, Any]:
    """``random:qwen3-8b`` (a preset) or ``random:/path/config.json``: real shapes, random weights,
    built directly on the device — for benchmarks at production dimensions. Only the language
    model is built: a composite checkpoint's config.json (Qwen3.5/3.6) gives its text model."""
    from transformers import AutoModelForCausalLM

    cfg = random_config(spec[len(RANDOM_PREFIX):])
    dev = torch.device(device)
    # the weights are a function of the spec alone: every run, every torchrun rank and a later
    # `evaluate` rebuild the same target, and the caller's RNG streams are left untouched
    cuda = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(RANDOM_TARGET_SEED)
        with dev:
            lm = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype,
                                                  attn_implementation=attn_implementation)
    return lm, _NoTokenizer(cfg.vocab_size)


def load_target(model: str, device: str = "cpu", dtype: str = "auto",
                attn_implementation: str = "sdpa") -> tuple[nn.Module, Any]:
    """(model, tokenizer) for a path, a hub name, ``smollm2`` (the bundled GGUF target) or
    ``random:PRESET`` (random weights at real shapes, for benchmarks).

    The model is frozen, in eval mode, on ``device``. ``attn_implementation``: any HF name, or
    ``packed_flex`` (registered here first; see ``dflash_stages.packed_attention``), or ``auto``
    (packed_flex on CUDA, sdpa elsewhere).
    """
    from dflash_stages import linear_attention, packed_attention

    linear_attention.bind_fla()  # before transformers imports a hybrid model's module
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if attn_implementation == "auto":
        attn_implementation = packed_attention.resolve_attn_implementation("auto", device)
    if attn_implementation == packed_attention.NAME:
        packed_attention.register()
    torch_dtype = resolve_dtype(dtype, device)
    if model.startswith(RANDOM_PREFIX):
        lm, tok = random_target(model, device, torch_dtype, attn_implementation)
    elif model == "smollm2":
        from dflash_stages.smollm2 import load_smollm2

        lm, tok = load_smollm2(dtype=torch_dtype, attn_implementation=attn_implementation)
    else:
        tok = AutoTokenizer.from_pretrained(model)
        lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype,
                                                  attn_implementation=attn_implementation)
    got = getattr(lm.config, "_attn_implementation", None)
    if attn_implementation == packed_attention.NAME and got != attn_implementation:
        # the mask built for each row follows the implementation: a silent fallback would
        # hand a BlockMask to another attention function
        raise ValueError(f"{model}: asked for attn_implementation {attn_implementation!r}, "
                         f"the model uses {got!r}")
    lm = lm.to(device).eval()
    lm.requires_grad_(False)
    return lm, tok


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


def embeddings_and_head(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen verifier weights the drafter needs: input embedding and LM head [V, H]
    (the same tensor when the target ties them)."""
    return model.get_input_embeddings().weight, model.get_output_embeddings().weight


def target_header(name: str, model: nn.Module, layer_ids: Sequence[int], tokenizer: Any) -> dict[str, Any]:
    """The first item of extract's stream: what the trainer needs of the target (its config, the
    layers read, the frozen embedding and LM head, the tokenizer's size and special ids)."""
    embed, head = embeddings_and_head(model)
    return {"kind": "target", "model": name, "config": model.config.to_dict(),
            "target_layer_ids": list(layer_ids), "embed_weight": embed, "lm_head_weight": head,
            "tokenizer_len": len(tokenizer), "all_special_ids": list(getattr(tokenizer, "all_special_ids", []))}


class _Enough(Exception):
    """Raised by the last hook needed, so layers above it (and the LM head) never run."""


def compile_layers(model: nn.Module) -> None:
    """Regional compile of the target: every decoder layer's ``forward`` goes through one
    torch.compile'd function (Inductor fuses the norms, RoPE, SwiGLU and residual adds that HF
    runs as separate kernels; layers of one kind share a graph). Only ``forward`` is replaced,
    so the feature hooks, which run in the module call around it, stay outside the graph and
    can come and go without recompiling. For fixed-length rows (extract); a forward whose
    length changes every call (decoding with a KV cache) would recompile."""
    import types

    layers = decoder_layers(model)
    compiled = torch.compile(type(layers[0]).forward, dynamic=False)
    for layer in layers:
        layer.forward = types.MethodType(compiled, layer)


class FeatureCapture:
    """Forward hooks on the chosen decoder layers; ``capture`` returns [.., T, k*H].

    With ``last_hidden`` the final-normed last hidden state is returned too (needed only by
    the ``target_argmax``/``kl`` losses); otherwise the forward stops after the highest
    chosen layer. In hybrid targets the linear-attention layers are cut at each packed row's
    documents (``dflash_stages.linear_attention``).
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], last_hidden: bool = False) -> None:
        self.model = model
        self.layers = decoder_layers(model)
        self.layer_ids = validate_target_layer_ids(layer_ids, len(self.layers))
        self.last_hidden = last_hidden
        self._out: dict[int, torch.Tensor] = {}
        from dflash_stages.linear_attention import document_boundaries

        self._documents = document_boundaries(model)

    @contextmanager
    def _hooks(self, stop_early: bool) -> Iterator[None]:
        top = max(self.layer_ids)
        handles = []
        for t in set(self.layer_ids):
            def hook(_m: nn.Module, _i: Any, out: Any, t: int = t) -> None:
                self._out[t] = out[0] if isinstance(out, (tuple, list)) else out
                if t == top and stop_early:
                    raise _Enough()
            handles.append(self.layers[t].register_forward_hook(hook))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, **kw: Any
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(features [B, T, k*H], last hidden [B, T, H] or None) for a batch of ids."""
        self._out.clear()
        last = None
        with self._hooks(stop_early=not self.last_hidden):
            try:
                out = base_model(self.model)(input_ids=input_ids, position_ids=position_ids,
                                             attention_mask=attention_mask, use_cache=False, **kw)
                last = out[0] if self.last_hidden else None
            except _Enough:
                pass
        return self._take(), last

    def capture_row(self, row: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """extract's per-row work: (features [T, k*H], last hidden [T, H] or None) of one packed
        row (``input_ids``, ``position_ids``, ``doc_lengths``), with the row's mask for the model's
        attention implementation (4D additive or flex BlockMasks), on the model's device."""
        from dflash_stages.packed_attention import row_attention_mask

        p = next(self.model.parameters())
        ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
        pos = torch.as_tensor(row["position_ids"], dtype=torch.long)
        lengths = [int(n) for n in row["doc_lengths"]]
        mask = row_attention_mask(self.model, lengths, ids.shape[0], p.dtype, p.device)
        with self._documents.row(lengths, ids.shape[0]) if self._documents else nullcontext():
            feats, last = self.capture(ids.to(p.device)[None], pos.to(p.device)[None], mask)
        return feats[0], None if last is None else last[0]

    @torch.no_grad()
    def record(self, forward: Callable[[], T]) -> tuple[T, torch.Tensor]:
        """Run any forward of the model (the full LM with a KV cache, say) with the hooks on,
        to the end; return its result and the chosen layers' features [B, T, k*H] — the
        features of exactly the forward whose logits the caller uses."""
        self._out.clear()
        with self._hooks(stop_early=False):
            result = forward()
        return result, self._take()

    def _take(self) -> torch.Tensor:
        feats = torch.cat([self._out[t] for t in self.layer_ids], dim=-1)
        self._out.clear()
        return feats


def packed_attention_mask(doc_lengths: Sequence[int], total: int, dtype: torch.dtype,
                          device: torch.device | str, sliding_window: int | None = None
                          ) -> torch.Tensor:
    """Additive 4D mask [1, 1, T, T]: causal within each document, nothing across documents
    or into padding (padding rows see themselves so softmax stays finite); with
    ``sliding_window``, also nothing ``sliding_window`` or more tokens back (sliding layers)."""
    from dflash_stages.packed_attention import document_ids

    doc = document_ids(doc_lengths, total, device)  # padding: a group of its own per token
    idx = torch.arange(total, device=device)
    allowed = (doc[:, None] == doc[None, :]) & (idx[None, :] <= idx[:, None])
    if sliding_window is not None:
        allowed &= idx[:, None] - idx[None, :] < sliding_window
    mask = torch.zeros(total, total, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
