"""The FLOP model of one drafter training step, for TFLOP/s and MFU figures (docs/drafter.md,
'FLOP model')."""

from __future__ import annotations

from collections.abc import Sequence

from dflash_model.drafter.config import DrafterConfig

H200_BF16_PEAK = 744e12  # the MFU denominator: the H200's measured bf16 matmul rate (docs/benchmarks.md)


def training_flops(cfg: DrafterConfig, num_tokens: int, num_anchors: int,
                   attended_pairs: int | Sequence[int], lm_head_rows: int | None = None) -> dict[str, float]:
    """FLOPs of one step: {fc, ctx_kv, block, attn, lm_head, step}.

    T = num_tokens (row length), N = num_anchors, Q = N*B, F = k*H;
    fc = 2TFH; ctx_kv = layers*2TH(2*nkv*d); block = layers*2Q(H*nh*d + H*2*nkv*d + nh*d*H + 3HI);
    attn = 4*nh*d*P summed over layers (P = attended (query, key) pairs of each layer's mask: an
    int for all layers or one per layer, see BlockLayout.attended_pairs); lm_head = 2*N(B-1)*H*V
    (``lm_head_rows`` replaces N(B-1) to count only the rows actually computed);
    step = 3*(fc + ctx_kv + block + attn) + 2*lm_head (the frozen LM head has no weight gradient).
    """
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size  # noqa: E741 (the paper's names)
    nh, nkv, d, n, B = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.num_layers, cfg.block_size
    T, N = int(num_tokens), int(num_anchors)
    Q, F = N * B, len(cfg.target_layer_ids) * H
    pairs = [int(attended_pairs)] * n if isinstance(attended_pairs, int) else [int(p) for p in attended_pairs]
    if len(pairs) != n:
        raise ValueError(f"attended_pairs has {len(pairs)} entries for {n} layers")
    rows = N * (B - 1) if lm_head_rows is None else int(lm_head_rows)
    out = {
        "fc": 2.0 * T * F * H,
        "ctx_kv": n * 2.0 * T * H * (2 * nkv * d),
        "block": n * 2.0 * Q * (H * nh * d + H * 2 * nkv * d + nh * d * H + 3 * H * I),
        "attn": 4.0 * nh * d * sum(pairs),
        "lm_head": 2.0 * rows * H * V,
    }
    out["step"] = 3 * (out["fc"] + out["ctx_kv"] + out["block"] + out["attn"]) + 2 * out["lm_head"]
    return out
