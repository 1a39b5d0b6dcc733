"""Which target layers feed the drafter, and the ±1 layer-id conventions.

Id t (z-lab convention, the one we store and export) is the output of decoder layer t (0-based):
HF ``hidden_states[t + 1]``, a forward hook on ``model.layers[t]``. vLLM / speculators call the
same tensor "aux layer id" t + 1. Mixing the two silently shifts every feature by one layer.
"""

from __future__ import annotations

from collections.abc import Sequence


def default_target_layer_ids(num_target_layers: int, k: int) -> list[int]:
    """Spread k ids as ``round(1 + i*(L-4)/(k-1))`` (L=36 -> 1,9,17,25,33; L=64 -> 1,16,31,46,61).

    Python's ``round`` is used on purpose: it is what the upstream DFlash helper uses, so ties
    resolve the same way. k = 1 gives ``[L // 2]`` (upstream's rule).
    """
    if num_target_layers < 4 or k < 1:
        raise ValueError(f"need num_target_layers >= 4 and k >= 1, got L={num_target_layers}, k={k}")
    if k == 1:
        return [num_target_layers // 2]
    ids = [int(round(1 + i * (num_target_layers - 4) / (k - 1))) for i in range(k)]
    if len(set(ids)) != k:
        raise ValueError(f"{k} distinct layers do not fit in a {num_target_layers}-layer target: {ids}")
    return ids


def validate_target_layer_ids(ids: Sequence[int], num_target_layers: int) -> list[int]:
    """Check explicit ids: distinct, in ``[0, L - 1)``; order is kept (it fixes the fc input layout).

    The last layer, L - 1, is refused: servers read HF ``hidden_states[L]``, which transformers
    returns after the final norm, while a hook on ``layers[L - 1]`` sees it before the norm, so a
    drafter trained on one would be served the other."""
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError("target_layer_ids is empty")
    if len(set(ids)) != len(ids):
        raise ValueError(f"target_layer_ids has duplicates: {ids}")
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(f"target_layer_ids {bad} outside [0, {num_target_layers})")
    last = num_target_layers - 1
    if last in ids:
        raise ValueError(
            f"target layer id {last} is the last decoder layer of a {num_target_layers}-layer target: "
            f"serving engines read it as hidden_states[{num_target_layers}], after the final norm, which "
            f"the hook on layers[{last}] does not see; use ids up to {last - 1}")
    return ids


def to_aux_layer_ids(target_layer_ids: Sequence[int]) -> list[int]:
    """z-lab ids -> vLLM/speculators aux ids (t + 1: the index into HF ``hidden_states``)."""
    return [int(t) + 1 for t in target_layer_ids]


def from_aux_layer_ids(aux_layer_ids: Sequence[int]) -> list[int]:
    """vLLM/speculators aux ids -> z-lab ids (a - 1); aux id 0 (the embeddings) has no z-lab id."""
    if any(int(a) < 1 for a in aux_layer_ids):
        raise ValueError(f"aux layer ids must be >= 1 (0 is the embedding output): {list(aux_layer_ids)}")
    return [int(a) - 1 for a in aux_layer_ids]
