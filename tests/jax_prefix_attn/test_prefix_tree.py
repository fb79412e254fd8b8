"""PrefixTree construction, layout and validation (host-side; fast)."""
import numpy as np
import pytest

from jax_prefix_attn import PrefixTree


def test_from_nested_layout_and_paths():
    t = PrefixTree.from_nested([[10, [3, 1, 2], 4], 7], seqs_per_leaf=2)
    # Depth-first layout: root(10) a(3) a1(1) a2(2) b(4) | root2(7)
    assert t.parents == (-1, 0, 1, 1, 0, -1)
    assert t.lengths == (10, 3, 1, 2, 4, 7)
    assert t.starts == (0, 10, 13, 14, 16, 20)
    assert t.leaf_of_seq == (2, 2, 3, 3, 4, 4, 5, 5)
    assert t.path(2) == [0, 1, 3]
    np.testing.assert_array_equal(t.path_token_indices(2), list(range(0, 13)) + [14, 15])
    np.testing.assert_array_equal(t.info["seq_path_len"], [14, 14, 15, 15, 14, 14, 7, 7])
    assert t.pool_extent == 27
    assert hash(t) == hash(PrefixTree.from_nested([[10, [3, 1, 2], 4], 7], seqs_per_leaf=2))


def test_from_parents_parent_after_child_and_explicit_starts():
    # node 0's parent is node 2 (listed later): fine.
    t = PrefixTree(parents=[2, 2, -1], starts=[100, 5, 0], lengths=[3, 4, 5], leaf_of_seq=[0, 1, 1])
    assert t.path(0) == [2, 0]
    np.testing.assert_array_equal(t.path_token_indices(0), [0, 1, 2, 3, 4, 100, 101, 102])
    t2 = PrefixTree.from_parents([2, 2, -1], [3, 4, 5])
    assert t2.starts == (5, 8, 0)            # depth-first: 2, 0, 1
    assert sorted(t2.leaf_of_seq) == [0, 1]


@pytest.mark.parametrize("kwargs, match", [
    (dict(parents=[1, 0], starts=[0, 1], lengths=[1, 1], leaf_of_seq=[0]), "cycle"),
    (dict(parents=[1, 2, 0, -1], starts=[0] * 4, lengths=[1] * 4, leaf_of_seq=[3]), "cycle"),
    (dict(parents=[0], starts=[0], lengths=[1], leaf_of_seq=[0]), "own parent"),
    (dict(parents=[-1, 5], starts=[0, 1], lengths=[1, 1], leaf_of_seq=[1]), "missing parent"),
    (dict(parents=[-1, -2], starts=[0, 1], lengths=[1, 1], leaf_of_seq=[1]), "missing parent"),
    (dict(parents=[-1, 0, 0], starts=[0, 1, 2], lengths=[1, 1, 1], leaf_of_seq=[1]), "no sequence beneath"),
    (dict(parents=[-1], starts=[0], lengths=[-1], leaf_of_seq=[0]), "lengths must be >= 0"),
    (dict(parents=[-1], starts=[-3], lengths=[1], leaf_of_seq=[0]), "starts must be >= 0"),
    (dict(parents=[-1], starts=[0], lengths=[1], leaf_of_seq=[]), "at least one sequence"),
    (dict(parents=[-1], starts=[0], lengths=[1], leaf_of_seq=[1]), "not a node index"),
    (dict(parents=[-1, 0], starts=[0], lengths=[1, 1], leaf_of_seq=[1]), "same length"),
    (dict(parents=[], starts=[], lengths=[], leaf_of_seq=[0]), "at least one node"),
    (dict(parents=[[-1]], starts=[0], lengths=[1], leaf_of_seq=[0]), "one-dimensional"),
])
def test_validation_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrefixTree(**kwargs)


def test_type_errors_and_nested_errors():
    with pytest.raises(TypeError, match="parents"):
        PrefixTree(parents=[-1.5], starts=[0], lengths=[1], leaf_of_seq=[0])
    with pytest.raises(ValueError, match="forest"):
        PrefixTree.from_nested([])
    with pytest.raises(ValueError, match=r"forest\[0\]\[1\]"):
        PrefixTree.from_nested([[4, "x"]])
    with pytest.raises(ValueError, match="seqs_per_leaf"):
        PrefixTree.from_nested([3], seqs_per_leaf=0)
    t = PrefixTree.from_nested([[4, 2]])
    with pytest.raises(ValueError, match=r"span \[4, 6\) lies outside the pool"):
        t.check_pool(5)
    with pytest.raises(AttributeError):
        t.parents = (0,)
