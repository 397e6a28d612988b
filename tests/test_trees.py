"""Static token trees (structure, constructors) and on-device merging of drawn chains."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asps_jax import trees

HAND = (-1, 0, 0, 1, 3, 3, 2)  # 0 -> {1, 2}, 1 -> 3, 3 -> {4, 5}, 2 -> 6


def test_structure_of_a_hand_tree():
    tree = trees.TokenTree(HAND)
    assert tree.num_nodes == 7 and tree.max_depth == 3
    np.testing.assert_array_equal(tree.depth, [0, 1, 1, 2, 3, 3, 2])
    np.testing.assert_array_equal(tree.sibling_rank, [0, 0, 1, 0, 0, 1, 0])
    np.testing.assert_array_equal(tree.num_children, [2, 1, 1, 2, 0, 0, 0])
    assert tree.postorder == (4, 5, 3, 1, 6, 2, 0)
    np.testing.assert_array_equal(tree.paths[4], [0, 1, 3, 4])
    np.testing.assert_array_equal(tree.paths[6], [0, 2, 6, -1])
    want = np.eye(7, dtype=bool)
    for i, j in [(1, 0), (2, 0), (3, 0), (3, 1), (4, 0), (4, 1), (4, 3), (5, 0), (5, 1), (5, 3)]:
        want[i, j] = True
    want[6, 0] = want[6, 2] = True
    np.testing.assert_array_equal(tree.ancestors, want)


def test_hashable_by_parents():
    a, b = trees.TokenTree(HAND), trees.TokenTree(list(HAND))
    assert a == b and hash(a) == hash(b) and a.parents == HAND
    assert a != trees.TokenTree(HAND[:-1])
    # A static jit argument.
    f = jax.jit(lambda t, x: x + t.max_depth, static_argnums=0)
    assert int(f(a, 1)) == int(f(b, 1)) == 4


def test_constructors():
    chain = trees.chain_token_tree(3)
    assert chain.parents == (-1, 0, 1, 2)
    k_chains = trees.chains_token_tree(3, 2)
    old = trees.build_chain_tree(3, 2)
    assert k_chains.parents == tuple(old.parents.tolist())
    np.testing.assert_array_equal(k_chains.depth, old.depth)
    np.testing.assert_array_equal(k_chains.ancestors, old.ancestors)
    assert trees.token_tree_of(old) == k_chains
    shape = trees.branching_token_tree((4, 2, 1, 1))
    assert shape.num_nodes == 1 + 4 + 8 + 8 + 8 and shape.max_depth == 4
    for d, width in enumerate((4, 2, 1, 1)):
        assert set(shape.num_children[shape.depth == d].tolist()) == {width}
    assert trees.branching_token_tree((2, 1)).parents == (-1, 0, 0, 1, 2)


@pytest.mark.parametrize(
    "parents, match",
    [((0, 0), "node 0 must be the root"), ((-1, 2, 0), "node 1 has parent 2"), ((), "root")],
)
def test_bad_parents(parents, match):
    with pytest.raises(ValueError, match=match):
        trees.TokenTree(parents)


def test_bad_widths():
    with pytest.raises(ValueError, match="widths must be >= 1"):
        trees.branching_token_tree((2, 0))


def _distinct_prefixes(chains, lengths):
    return {tuple(c[: i + 1]) for c, n in zip(chains, lengths) for i in range(n)}


@pytest.mark.slow
def test_merge_chains_hand_case():
    chains = jnp.array([[1, 2, 3], [1, 2, 0], [2, 2, 3], [1, 2, 3]])
    merged = jax.tree.map(np.asarray, trees.merge_chains(7, chains, jnp.array([3, 3, 3, 2])))
    # Nodes: root, chain 0 (3), chain 1's last token, chain 2 (3); chain 3 is all shared.
    np.testing.assert_array_equal(merged.valid, [1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0])
    assert int(merged.num_nodes) == 8 < 1 + 4 * 3
    np.testing.assert_array_equal(merged.chain_nodes, [[1, 2, 3], [1, 2, 6], [7, 8, 9], [1, 2, -1]])
    np.testing.assert_array_equal(merged.parent[[1, 2, 3, 6, 7, 8, 9]], [0, 1, 2, 2, 0, 7, 8])
    np.testing.assert_array_equal(merged.node_chain[[0, 1, 6, 7]], [0, 0, 1, 2])


def test_merge_chains_random_draws_count_and_map():
    """Valid nodes = distinct prefixes + root; every chain position maps to the node that
    carries its prefix, owned by the first chain with that prefix (vmapped, one jit)."""
    rng = np.random.default_rng(0)
    num, k, n, vocab = 200, 3, 4, 2  # a small vocabulary makes shared prefixes common
    chains = rng.integers(0, vocab, (num, k, n))
    lengths = rng.integers(0, n + 1, (num, k))
    merged = jax.jit(jax.vmap(lambda c, ln: trees.merge_chains(0, c, ln)))(
        jnp.asarray(chains), jnp.asarray(lengths)
    )
    merged = jax.tree.map(np.asarray, merged)
    counts = merged.valid.sum(1)
    fewer = 0
    for b in range(num):
        want = 1 + len(_distinct_prefixes(chains[b].tolist(), lengths[b]))
        assert counts[b] == want
        fewer += counts[b] < 1 + lengths[b].sum()
        tok, par = merged.node_tokens[b], merged.parent[b]
        for c, i in itertools.product(range(k), range(n)):
            node = int(merged.chain_nodes[b, c, i])
            if i >= lengths[b, c]:
                assert node == -1
                continue
            assert merged.valid[b, node]
            path = []
            while node > 0:
                path.append(int(tok[node]))
                node = int(par[node])
            assert path[::-1] == chains[b, c, : i + 1].tolist()
            owner = min(
                j
                for j in range(k)
                if lengths[b, j] > i and (chains[b, j, : i + 1] == chains[b, c, : i + 1]).all()
            )
            assert int(merged.node_chain[b, merged.chain_nodes[b, c, i]]) == owner
    assert fewer > num // 2  # shared prefixes were common, and were counted once


@pytest.mark.slow
def test_merge_duplicates_on_a_branching_tree():
    tree = trees.branching_token_tree((3, 2))  # slots 1..3 at depth 1, 4..9 at depth 2
    tokens = jnp.array([9, 5, 6, 5, 1, 1, 2, 3, 1, 4])
    node, parent, valid = trees.merge_duplicates(tree, tokens, jnp.ones(10, bool))
    # Slot 3 repeats slot 1: its children (8, 9) hang below node 1; slot 8 repeats slot 4.
    np.testing.assert_array_equal(node, [0, 1, 2, 1, 4, 4, 6, 7, 4, 9])
    np.testing.assert_array_equal(parent, [-1, 0, 0, 0, 1, 1, 2, 2, 1, 1])
    np.testing.assert_array_equal(valid, [1, 1, 1, 0, 1, 0, 1, 1, 0, 1])
    # Invalid slots and their descendants drop out (ancestor closure).
    mask = jnp.ones(10, bool).at[1].set(False)
    node, _, valid = trees.merge_duplicates(tree, tokens, mask)
    np.testing.assert_array_equal(node, [0, -1, 2, 3, -1, -1, 6, 7, 8, 9])
    assert not valid[4] and valid[3]


@pytest.mark.slow
def test_merged_attention_mask_follows_the_merged_root_paths():
    """Chains (1, 2), (1, 3), (4, 4): slot 3 repeats slot 1, so slot 4 (token 3 after 1) must
    attend to slot 1, not to its static parent 3, and slot 3 only to itself."""
    tree = trees.chains_token_tree(3, 2)
    tokens = jnp.array([0, 1, 2, 1, 3, 4, 4])
    canonical, _, _ = trees.merge_duplicates(tree, tokens, jnp.ones(7, bool))
    np.testing.assert_array_equal(canonical, [0, 1, 2, 1, 4, 5, 6])
    mask = np.asarray(trees.merged_attention_mask(tree, canonical[None]))[0]
    want = {0: {0}, 1: {0, 1}, 2: {0, 1, 2}, 3: {3}, 4: {0, 1, 4}, 5: {0, 5}, 6: {0, 5, 6}}
    for i, row in want.items():
        assert set(np.nonzero(mask[i])[0].tolist()) == row, i
    # With no repeat it is the static tree's mask.
    canonical = jnp.arange(7)[None]
    static = trees.attention_mask(trees.build_chain_tree(3, 2), jnp.ones((1, 7), bool))
    np.testing.assert_array_equal(trees.merged_attention_mask(tree, canonical), static)


def test_chain_layout_and_branching_plan():
    """One chain per leaf; the branching plan's replica l takes, at depth d, the child of its
    depth-d node given by l's digits in the widths' mixed radix."""
    layout = trees.chain_layout(trees.chains_token_tree(2, 3))
    np.testing.assert_array_equal(layout.chain_nodes, [[1, 2, 3], [4, 5, 6]])
    np.testing.assert_array_equal(layout.first_chain, [0, 0, 0, 0, 1, 1, 1])
    plan = trees.BranchingPlan((3, 2), replace=False)
    tree = plan.tree  # slots 1..3 at depth 1, 4..9 at depth 2
    layout = trees.chain_layout(tree)
    assert plan.num_chains == layout.num_chains == 6 and plan.max_width == 3
    np.testing.assert_array_equal(layout.chain_nodes[:, 0], [1, 1, 2, 2, 3, 3])
    np.testing.assert_array_equal(layout.chain_nodes[:, 1], [4, 5, 6, 7, 8, 9])
    np.testing.assert_array_equal(layout.first_chain, [0, 0, 2, 4, 0, 1, 2, 3, 4, 5])
    group_first, sibling = plan.tables
    np.testing.assert_array_equal(group_first, [[0] * 6, [0, 0, 2, 2, 4, 4]])
    np.testing.assert_array_equal(sibling, [[0, 0, 1, 1, 2, 2], [0, 1, 0, 1, 0, 1]])
    # Each replica's sibling choices name its own leaf's root path.
    for chain in range(6):
        node = 0
        for d in range(2):
            children = [i for i, p in enumerate(tree.parents) if p == node]
            node = children[sibling[d, chain]]
            assert node == layout.chain_nodes[chain, d]
    with pytest.raises(ValueError, match="every leaf at its full depth"):
        trees.chain_layout(trees.TokenTree((-1, 0, 0, 1)))
