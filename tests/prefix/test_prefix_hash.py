import pytest

from splitserve.prefix_hash import HASH_BYTES, extend, prefix_hash_chain, root


def test_a_chain_names_whole_units_only():
    chain = prefix_hash_chain(list(range(10)), 4)
    assert len(chain) == 2 and all(len(h) == HASH_BYTES for h in chain)


def test_prompts_sharing_units_share_exactly_those_names():
    a = prefix_hash_chain([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = prefix_hash_chain([1, 2, 3, 4, 5, 6, 7, 9], 4)
    assert a[0] == b[0] and a[1] != b[1]


def test_each_name_covers_everything_before_it():
    # the same second unit after a different first unit is a different prefix
    a = prefix_hash_chain([1, 2, 5, 6], 2)
    b = prefix_hash_chain([3, 4, 5, 6], 2)
    assert a[1] != b[1]


def test_a_chain_is_extend_applied_unit_by_unit():
    tokens = [7, 8, 9, 10, 11, 12]
    chain = prefix_hash_chain(tokens, 3, salt=b"m")
    assert chain[1] == extend(extend(root(b"m"), tokens[:3]), tokens[3:])


def test_salts_separate_models():
    assert prefix_hash_chain([1, 2], 2, b"a") != prefix_hash_chain([1, 2], 2, b"b")


def test_unit_boundaries_are_part_of_the_name():
    # [1, 2] + [3] and [1] + [2, 3] name different things: a unit's bytes are fixed-width int32s
    assert extend(extend(root(), [1, 2]), [3]) != extend(extend(root(), [1]), [2, 3])


def test_a_unit_below_one_token_is_refused():
    with pytest.raises(ValueError, match="at least 1 token"):
        prefix_hash_chain([1], 0)
