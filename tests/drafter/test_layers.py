import pytest

from dflash_model.drafter import default_target_layer_ids, from_aux_layer_ids, to_aux_layer_ids
from dflash_model.drafter.layers import validate_target_layer_ids


def test_default_ids_match_design():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(52, 5) == [1, 13, 25, 37, 49]
    assert default_target_layer_ids(28, 1) == [14]


def test_default_ids_rule_for_many_shapes():
    for L in range(8, 100):
        for k in (2, 3, 5):
            assert default_target_layer_ids(L, k) == [round(1 + i * (L - 4) / (k - 1)) for i in range(k)]


def test_aux_conversion_round_trips_and_is_plus_one():
    ids = [1, 9, 17, 25, 33]
    assert to_aux_layer_ids(ids) == [2, 10, 18, 26, 34]
    assert from_aux_layer_ids(to_aux_layer_ids(ids)) == ids
    assert to_aux_layer_ids(from_aux_layer_ids([2, 10])) == [2, 10]
    with pytest.raises(ValueError):
        from_aux_layer_ids([0, 3])


def test_explicit_ids_validated():
    assert validate_target_layer_ids([3, 1], 8) == [3, 1]
    for bad in ([], [1, 1], [8], [-1], [7]):
        with pytest.raises(ValueError):
            validate_target_layer_ids(bad, 8)
    with pytest.raises(ValueError):
        default_target_layer_ids(5, 5)


def test_last_layer_is_refused_with_the_reason():
    """Servers read id L-1 as hidden_states[L], after the final norm; a hook reads it before."""
    assert validate_target_layer_ids([1, 6], 8) == [1, 6]
    with pytest.raises(ValueError, match=r"target layer id 7 is the last decoder layer of a 8-layer target.*"
                                         r"after the final norm.*use ids up to 6"):
        validate_target_layer_ids([1, 7], 8)
