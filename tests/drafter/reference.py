"""A deliberately naive reference of the DFlash drafter: per-block Python loops, explicit per-head
attention over an explicitly listed context, float64. Shares only the parameter tensors with the
real model (so gradients can be compared), none of its code."""

from __future__ import annotations

import math

import torch


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: list[int], theta: float) -> torch.Tensor:
    """x [S, heads, d]; rotate pair (i, i + d/2) by pos * theta^(-2i/d) (HF's float32 frequencies)."""
    d = x.shape[-1]
    inv = (1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))).double()
    ang = torch.tensor(pos, dtype=torch.float64)[:, None] * inv[None, :]
    c, sn = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * c - b * sn, b * c + a * sn], dim=-1)

def reference_block_logits(model, features, input_ids, position_ids, doc_ids, anchors, E, W):
    """[N, B-1, V] logits of slots 1..B-1, one block at a time."""
    cfg = model.config
    B, eps = cfg.block_size, cfg.rms_norm_eps
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    theta = cfg.rope_parameters("full_attention")["rope_theta"]
    P = dict(model.named_parameters())
    ctx_all = _rms(features @ P["fc.weight"].T, P["hidden_norm.weight"], eps)
    out = []
    for a in anchors.tolist():
        doc = int(doc_ids[a])
        rows = [j for j in range(a) if int(doc_ids[j]) == doc]  # strictly before the anchor, same document
        ctx = ctx_all[rows]
        x = E[[int(input_ids[a])] + [cfg.mask_token_id] * (B - 1)]
        bpos = [int(position_ids[a]) + k for k in range(B)]
        cpos = [int(position_ids[j]) for j in rows]
        for i, lt in enumerate(cfg.layer_types):
            p = f"layers.{i}."
            h = _rms(x, P[p + "input_layernorm.weight"], eps)
            q = _rms((h @ P[p + "self_attn.q_proj.weight"].T).view(B, nh, d), P[p + "self_attn.q_norm.weight"], eps)
            kin = torch.cat([ctx, h])
            k = _rms((kin @ P[p + "self_attn.k_proj.weight"].T).view(-1, nkv, d), P[p + "self_attn.k_norm.weight"], eps)
            v = (kin @ P[p + "self_attn.v_proj.weight"].T).view(-1, nkv, d)
            q, k = _rope(q, bpos, theta), _rope(k, cpos + bpos, theta)
            heads = []
            for hh in range(nh):
                g = hh // (nh // nkv)
                slot_outs = []
                for s in range(B):
                    keys = list(range(len(rows))) + [len(rows) + t for t in range(B)]
                    if lt == "sliding_attention":
                        w = cfg.sliding_window
                        keys = [j for j in range(len(rows)) if (a + s) - rows[j] < w]
                        keys += [len(rows) + t for t in range(B) if t <= s and s - t < w]
                    pr = torch.softmax(k[keys, g] @ q[s, hh] / math.sqrt(d), 0)
                    slot_outs.append(pr @ v[keys, g])
                heads.append(torch.stack(slot_outs))
            attn = torch.stack(heads, 1).reshape(B, nh * d)
            x = x + attn @ P[p + "self_attn.o_proj.weight"].T
            h = _rms(x, P[p + "post_attention_layernorm.weight"], eps)
            mlp = (torch.nn.functional.silu(h @ P[p + "mlp.gate_proj.weight"].T) * (h @ P[p + "mlp.up_proj.weight"].T))
            x = x + mlp @ P[p + "mlp.down_proj.weight"].T
        out.append(_rms(x, P["norm.weight"], eps)[1:] @ W.T)
    return torch.stack(out)


def reference_loss(model, features, input_ids, loss_mask, position_ids, doc_ids, anchors, E, W, gamma):
    """Σ w_k m CE / Σ w_k m with labels input_ids[a+k] (same document, loss_mask = 1)."""
    logits = reference_block_logits(model, features, input_ids, position_ids, doc_ids, anchors, E, W)
    B, T = model.config.block_size, input_ids.shape[0]
    num, den = 0.0, 0.0
    for n, a in enumerate(anchors.tolist()):
        for k in range(1, B):
            p = a + k
            if p < T and int(doc_ids[p]) == int(doc_ids[a]) and int(loss_mask[p]) == 1:
                w = math.exp(-(k - 1) / gamma)
                ce = -torch.log_softmax(logits[n, k - 1], -1)[int(input_ids[p])]
                num = num + w * ce
                den += w
    return num / den, logits
