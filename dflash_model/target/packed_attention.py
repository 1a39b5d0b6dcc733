"""``packed_flex``: the target forward on packed rows with flex_attention and a document-causal
BlockMask.

Why: a packed row holds several documents back to back, and none may see another. Given as a 4D
additive mask, that rule takes SDPA off its flash kernel onto a much slower one (docs/benchmarks.md has the
figures). flex_attention
takes the rule as a BlockMask instead: blocks that are fully masked (everything across documents)
are skipped and the rest runs in one fused kernel, so the cross-document work disappears rather
than being masked away.

How it reaches the model: :func:`register` adds ``packed_flex`` to transformers'
``AttentionInterface``; a model loaded with ``attn_implementation="packed_flex"`` is given the
prepared mask of :func:`packed_model_mask` as its ``attention_mask`` — one BlockMask (4D, so
``masking_utils`` returns it as is for every model built on it, Llama and Qwen3 alike), or a
``{layer type: BlockMask}`` dict for models that mix full and sliding layers (those models take a
dict as already prepared masks). Either way the model builds no mask of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, get_args

from dflash_model.fast.settings import AttnImplementation

if TYPE_CHECKING:  # torch is imported where used: the extract config reads this module's names
    import torch  # without paying for torch

NAME = "packed_flex"
"""The attention implementation name, for ``attn_implementation=`` (after :func:`register`).
Not "dflash_...": transformers takes any name containing "flash" for a flash-attention kernel
request and tries to load it from the hub."""
IMPLEMENTATIONS = get_args(AttnImplementation)
"""What the extract stage accepts: auto = packed_flex on CUDA, sdpa elsewhere."""

LINEAR_KINDS = ("linear_attention",)
"""Layer types that take no attention mask (Gated DeltaNet): ``dflash_model.target.linear_attention`` cuts
them at the documents instead; they get ``None`` in a per-layer-type mask dict."""

MaskMod = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor"], "torch.Tensor"]


def resolve_attn_implementation(name: str, device: torch.device | str) -> str:
    """``auto`` -> packed_flex on CUDA (fused kernel), sdpa elsewhere (flex_attention runs eager
    and unfused on CPU, many times slower than SDPA with the 4D mask)."""
    import torch

    if name not in IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {IMPLEMENTATIONS}, got {name!r}")
    if name == "auto":
        return NAME if torch.device(device).type == "cuda" else "sdpa"
    return name


def packed_flex_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: Any, scaling: float | None = None,
                          dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function: q [B, heads, T, d], k/v [B, kv_heads, S, d] ->
    ([B, T, heads, d], None). ``attention_mask`` must be the prepared BlockMask — without one
    flex_attention would attend everywhere, so anything else is an error, not a fallback."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    from dflash_model.fast.flex import flex_attention_fn

    if not isinstance(attention_mask, BlockMask):
        raise TypeError(f"attn_implementation {NAME!r} needs the BlockMask of "
                        f"dflash_model.target.packed_attention.packed_model_mask as attention_mask, "
                        f"got {type(attention_mask).__name__}")
    if dropout:
        raise ValueError(f"{NAME} is for the frozen target's forward: dropout must be 0")
    # compiled once per process on CUDA (fused kernel); eager (unfused) on CPU, and traced in
    # place when the caller is itself being compiled
    compiled = query.device.type == "cuda" and not torch.compiler.is_compiling()
    group = query.shape[1] // key.shape[1]
    if group & (group - 1):  # some torch versions want power-of-2 GQA groups (torch#143117):
        key = key.repeat_interleave(group, dim=1)  # expand the few kv heads instead (e.g.
        value = value.repeat_interleave(group, dim=1)  # SmolLM2: 9 query / 3 kv heads)
    out = flex_attention_fn(compiled)(query, key, value, block_mask=attention_mask, scale=scaling,
                                      enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Add ``packed_flex`` to transformers' AttentionInterface (idempotent); needed before a model
    is loaded or switched with that name."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, packed_flex_attention)


def document_ids(doc_lengths: Sequence[int], total: int, device: torch.device | str) -> torch.Tensor:
    """[total] long: document index of each token; tokens after the last document get one
    negative id each (they see only themselves, as in ``packed_attention_mask``)."""
    import torch

    idx = torch.arange(total, device=device)
    lengths = torch.as_tensor([int(n) for n in doc_lengths], dtype=torch.long)
    if int(lengths.sum()) > total:
        raise ValueError(f"documents of {int(lengths.sum())} tokens do not fit a row of {total}")
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)
    return torch.cat([doc, -1 - idx[doc.shape[0]:]])


def doc_causal_mask_mod(doc: torch.Tensor, sliding_window: int | None = None) -> MaskMod:
    """flex mask_mod: kv visible from q iff same document and kv <= q (and q - kv < window in
    sliding layers, transformers' rule). Indices are clamped: flex may evaluate the mask past the
    row's end (lengths rounded up to its block size); those rows and columns are never used
    (a clamped kv past the end is > every real q, so causality drops it)."""
    last = doc.shape[0] - 1

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        ok = (doc[q_idx.clamp(max=last)] == doc[kv_idx.clamp(max=last)]) & (kv_idx <= q_idx)
        if sliding_window is not None:
            ok = ok & (q_idx - kv_idx < sliding_window)
        return ok

    return mask_mod


def packed_block_mask(doc_lengths: Sequence[int], total: int, device: torch.device | str,
                      sliding_window: int | None = None,
                      block_size: int | tuple[int, int] | None = None) -> Any:
    """The document-causal BlockMask [1, 1, total, total] of one packed row.

    Each query sees one interval of keys, [its document's start (or q - window + 1), q], so the
    tiles are classified from interval overlaps ([total, KV tiles] counts) instead of evaluating
    the mask on the [total, total] grid as ``create_block_mask`` does (compiling that took minutes
    per new row length). The result is the same, field for field (tests). ``block_size``: flex's
    sparse block size (default 128)."""
    import torch
    from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE

    from dflash_model.drafter.mask import block_mask_from_counts

    device = torch.device(device)
    bs = block_size or _DEFAULT_SPARSE_BLOCK_SIZE
    tq, tkv = (bs, bs) if isinstance(bs, int) else bs
    doc = document_ids(doc_lengths, total, device)
    i32 = torch.int32  # the [total, KV tiles] counts below: half the memory of int64 on long rows
    q = torch.arange(total, device=device, dtype=i32)
    starts = torch.cumsum(torch.as_tensor([0, *[int(n) for n in doc_lengths]], device=device), 0).to(i32)
    lo = torch.where(doc >= 0, starts[doc.clamp(min=0)], q)  # a padding token sees only itself
    if sliding_window is not None:
        lo = torch.maximum(lo, q - sliding_window + 1)
    n_kv = -(-total // tkv)
    kv_lo = torch.arange(n_kv, device=device, dtype=i32) * tkv
    kv_hi = (kv_lo + tkv).clamp(max=total) - 1
    counts = (torch.minimum(q[:, None], kv_hi[None, :]) - torch.maximum(lo[:, None], kv_lo[None, :]) + 1).clamp(min=0)
    return block_mask_from_counts(counts, (tq, tkv), doc_causal_mask_mod(doc, sliding_window), (total, total))


def layer_windows(config: Any) -> dict[str, int | None]:
    """Layer type -> sliding window (None = full attention) of the model's attention layers.

    Models with ``layer_types`` (Qwen3, Gemma...) name each layer's kind; models without it use
    one kind everywhere (sliding iff ``config.sliding_window`` is set, as Mistral does). Linear
    layers (``LINEAR_KINDS``) take no mask and are left out."""
    window = getattr(config, "sliding_window", None)
    types = list(getattr(config, "layer_types", None) or [])
    if not types:
        types = ["sliding_attention" if window else "full_attention"]
    out: dict[str, int | None] = {}
    for kind in dict.fromkeys(types):
        if kind in LINEAR_KINDS:
            continue
        if kind == "full_attention":
            out[kind] = None
        elif kind == "sliding_attention" and window:
            out[kind] = int(window)
        else:
            raise ValueError(f"{NAME} supports full, sliding-window and linear attention layers, not "
                             f"{kind!r} (sliding_window={window}); use attn_implementation: sdpa")
    return out


def packed_model_mask(config: Any, doc_lengths: Sequence[int], total: int,
                      device: torch.device | str) -> Any:
    """What a ``packed_flex`` model takes as ``attention_mask`` for one packed row: one BlockMask
    when all its layers are of one kind, else ``{layer type: BlockMask}`` (full and sliding; None
    for linear layers)."""
    return _per_layer_kind(config, layer_windows(config), lambda w: packed_block_mask(
        doc_lengths, total, device, sliding_window=w))


def row_attention_mask(model: torch.nn.Module, doc_lengths: Sequence[int], total: int,
                       dtype: torch.dtype, device: torch.device | str) -> Any:
    """The packed-row mask for the model's attention implementation: the BlockMask(s) for
    packed_flex, the 4D additive block-diagonal causal mask(s) for sdpa / eager (one per layer
    kind as well: a 4D mask is used as given, so sliding layers need their own)."""
    config = model.config.get_text_config()  # a vision-language model's mask is its text model's
    if getattr(model.config, "_attn_implementation", None) == NAME:
        return packed_model_mask(config, doc_lengths, total, device)

    try:
        windows = layer_windows(config)
    except ValueError:  # other layer kinds: the plain document-causal mask everywhere
        windows = {"full_attention": None}
    return _per_layer_kind(config, windows, lambda w: packed_attention_mask(
        doc_lengths, total, dtype, device, sliding_window=w))


def _per_layer_kind(config: Any, windows: dict[str, int | None], build: Callable[[int | None], Any]) -> Any:
    """One mask when every layer is of one kind, else ``{layer type: mask}`` (one per window, None
    for linear layers: given a dict, the model builds no masks of its own)."""
    masks = {kind: build(w) for kind, w in windows.items()}
    masks.update(dict.fromkeys(k for k in getattr(config, "layer_types", None) or [] if k in LINEAR_KINDS))
    return next(iter(masks.values())) if len(masks) == 1 else masks


def packed_attention_mask(doc_lengths: Sequence[int], total: int, dtype: "torch.dtype",
                          device: "torch.device | str", sliding_window: int | None = None
                          ) -> "torch.Tensor":
    """Additive 4D mask [1, 1, T, T]: causal within each document, nothing across documents
    or into padding (padding rows see themselves so softmax stays finite); with
    ``sliding_window``, also nothing ``sliding_window`` or more tokens back (sliding layers)."""
    import torch

    doc = document_ids(doc_lengths, total, device)  # padding: a group of its own per token
    idx = torch.arange(total, device=device)
    allowed = (doc[:, None] == doc[None, :]) & (idx[None, :] <= idx[:, None])
    if sliding_window is not None:
        allowed &= idx[:, None] - idx[None, :] < sliding_window
    mask = torch.zeros(total, total, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
