"""Tree and chain scoring against transformers' sequential forward, and its masking properties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from asps_jax.kv_cache import commit, init_cache
from asps_jax.models import load_model
from asps_jax.scoring import (
    chain_mask,
    prefill_cache,
    prefill_cache_grouped,
    score_chain,
    score_tree,
)
from asps_jax.trees import Tree, build_chain_tree, node_validity, path_nodes

V, S = 97, 32  # vocab, cache slots
SCORE_CHAIN = jax.jit(score_chain, static_argnums=0)
COMMIT = jax.jit(commit)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    cfg._attn_implementation = "eager"  # sdpa is ~50x slower on CPU at these tiny sizes
    hf = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny")
    hf.save_pretrained(path)
    return hf, load_model(path)


def hf_logits(hf, seq) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.as_tensor(np.asarray(seq)[None], dtype=torch.long)).logits[0].numpy()


def hand_tree() -> Tree:
    """A non-chain tree: 0 -> {1, 2}, 1 -> 3, 3 -> {4, 5}, 2 -> 6."""
    parents = np.array([-1, 0, 0, 1, 3, 3, 2], np.int32)
    depth = np.array([0, 1, 1, 2, 3, 3, 2], np.int32)
    anc = np.eye(7, dtype=bool)
    for i in range(7):
        p = parents[i]
        while p >= 0:
            anc[i, p], p = True, parents[p]
    # Tree hashes by (num_drafts, draft_len); (0, 0) is never produced by build_chain_tree.
    return Tree(0, 0, parents, depth, anc)


def root_path(tree: Tree, i: int) -> list[int]:
    path = [i]
    while tree.parents[path[-1]] >= 0:
        path.append(int(tree.parents[path[-1]]))
    return path[::-1]


def random_validity(tree: Tree, rng, B) -> np.ndarray:
    """Ancestor-closed random validity (what EOS / max_new_tokens truncation produces)."""
    valid = np.zeros((B, tree.num_nodes), bool)
    valid[:, 0] = True
    for i in range(1, tree.num_nodes):  # parents come before children in both layouts
        valid[:, i] = valid[:, tree.parents[i]] & (rng.random(B) < 0.75)
    return valid


def prefill(m, prompts):
    """Ragged prompts minus their last token into a fresh cache; returns (cache, roots)."""
    B = len(prompts)
    P = max(len(p) for p in prompts) - 1
    toks = np.zeros((B, P), np.int32)
    valid = np.zeros((B, P), bool)
    for b, p in enumerate(prompts):
        toks[b, : len(p) - 1], valid[b, : len(p) - 1] = p[:-1], True
    cache = init_cache(m.config, B, S)
    _, kv = SCORE_CHAIN(m.forward, m.params, cache, jnp.asarray(toks), jnp.asarray(valid))
    nodes = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    cache = COMMIT(cache, kv, nodes, jnp.asarray(valid.sum(1), jnp.int32))
    return cache, np.array([p[-1] for p in prompts], np.int32)


def tree_scorer(m, tree):
    return jax.jit(
        lambda params, cache, toks, valid: score_tree(m.forward, params, cache, toks, tree, valid)
    )


@pytest.mark.slow
@pytest.mark.parametrize("which", ["chains", "hand"])
def test_every_valid_node_matches_sequential_decoding(models, which):
    hf, m = models
    rng = np.random.default_rng(0 if which == "chains" else 1)
    tree = build_chain_tree(3, 4) if which == "chains" else hand_tree()
    B, N = 3, tree.num_nodes
    prompts = [list(rng.integers(0, V, n)) for n in (4, 7, 2)]
    cache, roots = prefill(m, prompts)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [3, 6, 1])
    if which == "chains":
        valid = np.asarray(node_validity(tree, jnp.asarray(rng.integers(0, 5, (B, 3)))))
    else:
        valid = random_validity(tree, rng, B)
    toks = rng.integers(0, V, (B, N)).astype(np.int32)
    toks[:, 0] = roots
    logits, new_kv = tree_scorer(m, tree)(m.params, cache, jnp.asarray(toks), jnp.asarray(valid))
    logits = np.asarray(logits)
    assert logits.shape == (B, N, V) and new_kv.k.shape[2] == N and np.isfinite(logits).all()
    checked = 0
    for b in range(B):
        for i in range(N):
            if valid[b, i]:
                seq = prompts[b][:-1] + [int(toks[b, j]) for j in root_path(tree, i)]
                np.testing.assert_allclose(logits[b, i], hf_logits(hf, seq)[-1], atol=1e-4)
                checked += 1
    assert checked > B  # some non-root nodes were valid


@pytest.mark.slow
def test_non_ancestors_and_padding_never_change_a_node(models):
    hf, m = models
    rng = np.random.default_rng(2)
    tree = hand_tree()
    N = tree.num_nodes
    # Row 0 is the original; row 1 + i re-draws every token that is not an ancestor of node i.
    toks = np.tile(rng.integers(0, V, N).astype(np.int32), (N + 1, 1))
    for i in range(N):
        others = ~tree.ancestors[i]
        toks[1 + i, others] = (toks[1 + i, others] + rng.integers(1, V, others.sum())) % V
    valid = np.tile(np.array([True, True, True, True, True, False, True]), (N + 1, 1))
    prompt = list(rng.integers(0, V, 5))
    cache, root = prefill(m, [prompt] * (N + 1))
    toks[:, 0] = root
    logits, _ = tree_scorer(m, tree)(m.params, cache, jnp.asarray(toks), jnp.asarray(valid))
    logits = np.asarray(logits)
    assert np.isfinite(logits).all()
    for i in range(N):
        np.testing.assert_array_equal(logits[1 + i, i], logits[0, i])
        if i > 0:  # the perturbations do matter wherever they are visible (the test can fail)
            assert np.abs(logits[1 + i] - logits[0]).max() > 1e-3
    # Padded node 5 attends only to itself: a valid sibling's path plus node 5's token.
    seq = prompt + [int(toks[0, 5])]
    assert np.abs(logits[0, 5] - hf_logits(hf, seq)[-1]).max() > 1e-3


@pytest.mark.slow
def test_commit_accepted_path_then_decode_matches_scratch(models):
    hf, m = models
    rng = np.random.default_rng(3)
    K, n = 2, 4
    tree = build_chain_tree(K, n)
    B = 3
    prompts = [list(rng.integers(0, V, k)) for k in (5, 3, 8)]
    cache, roots = prefill(m, prompts)
    toks = np.concatenate([roots[:, None], rng.integers(0, V, (B, K * n))], axis=1).astype(np.int32)
    valid = jnp.ones((B, tree.num_nodes), bool)
    _, kv = tree_scorer(m, tree)(m.params, cache, jnp.asarray(toks), valid)
    chosen = np.array([1, 0, 1], np.int32)  # accepted chain per row
    accepted = np.array([2, 0, 4], np.int32)  # accepted draft tokens per row
    # Per row (vmap over the scalar chain index): robust to how path_nodes broadcasts.
    nodes = jax.vmap(lambda k: path_nodes(tree, k))(jnp.asarray(chosen))
    cache2 = COMMIT(cache, kv, nodes, jnp.asarray(accepted + 1))  # root + accepted tokens
    np.testing.assert_array_equal(np.asarray(cache2.lengths - cache.lengths), accepted + 1)
    bonus = rng.integers(0, V, (B, 1)).astype(np.int32)
    logits, _ = SCORE_CHAIN(m.forward, m.params, cache2, jnp.asarray(bonus), jnp.ones((B, 1), bool))
    for b in range(B):
        path = np.asarray(nodes[b, 1 : accepted[b] + 1])
        seq = prompts[b] + [int(t) for t in toks[b, path]] + [int(bonus[b, 0])]
        np.testing.assert_allclose(np.asarray(logits[b, 0]), hf_logits(hf, seq)[-1], atol=1e-4)


@pytest.mark.slow
def test_score_chain_without_cache_and_padding(models):
    hf, m = models
    rng = np.random.default_rng(4)
    toks = rng.integers(0, V, (2, 6)).astype(np.int32)
    valid = np.array([[True] * 6, [True] * 4 + [False] * 2])
    logits, kv = SCORE_CHAIN(m.forward, m.params, None, jnp.asarray(toks), jnp.asarray(valid))
    assert kv.k.shape[2] == 6
    np.testing.assert_allclose(np.asarray(logits[0]), hf_logits(hf, toks[0]), atol=1e-4)
    np.testing.assert_allclose(np.asarray(logits[1, :4]), hf_logits(hf, toks[1, :4]), atol=1e-4)
    expected = np.tril(np.ones((6, 6), bool))
    expected[4:, :] = False
    expected[4, 4] = expected[5, 5] = True
    np.testing.assert_array_equal(np.asarray(chain_mask(jnp.asarray(valid)))[1], expected)


def test_scoring_rejects_bad_inputs(models):
    _, m = models
    tree = build_chain_tree(2, 2)
    cache = init_cache(m.config, 2, S)
    ok = jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match="nodes"):
        score_tree(
            m.forward, m.params, cache, jnp.zeros((2, 4), jnp.int32), tree, jnp.ones((2, 4), bool)
        )
    with pytest.raises(ValueError, match="valid"):
        score_tree(m.forward, m.params, cache, ok, tree, jnp.ones((2, 5), jnp.int32))
    with pytest.raises(ValueError, match="node_tokens"):
        score_tree(m.forward, m.params, cache, ok.astype(jnp.float32), tree, jnp.ones((2, 5), bool))
    with pytest.raises(ValueError, match="valid"):
        score_chain(m.forward, m.params, cache, ok, jnp.ones((2, 4), bool))
    with pytest.raises(ValueError, match="tokens"):
        score_chain(m.forward, m.params, None, jnp.zeros((5,), jnp.int32), jnp.ones((5,), bool))


# An uneven split (11 rows in groups of 3: the last group short) stacked, an even one per layer.
@pytest.mark.parametrize("group, rows, per_layer", [(3, 11, False), (2, 4, True)])
def test_grouped_prefill_is_the_prefill_of_every_row(models, group, rows, per_layer):
    """A prompt's n samples and a draft's K replicas are prefilled once and copied: the cache of
    a forward over every row (to float rounding: XLA's matrix products may round differently at
    another row count), every row of a group the same bits, slots past a row's length zero."""
    _, m = models
    rng = np.random.default_rng(4)
    prompts = rng.integers(0, V, (4, 6)).astype(np.int32)
    num = np.array([6, 1, 4, 0], np.int32)
    cache = init_cache(m.config, rows, S, per_layer=per_layer)
    src = np.arange(rows) // group * group * len(prompts) // rows  # each row's prompt
    grouped = jax.jit(prefill_cache_grouped, static_argnums=(0, 5))(
        m.forward, m.params, cache, jnp.asarray(prompts), jnp.asarray(num), group
    ).cache
    full = jax.jit(prefill_cache, static_argnums=0)(
        m.forward, m.params, cache, jnp.asarray(prompts[src]), jnp.asarray(num[src])
    ).cache
    np.testing.assert_array_equal(grouped.lengths, num[src])
    for a, b in zip(grouped.stacked(), full.stacked(), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    k = np.asarray(grouped.stacked()[0])  # [L, rows, KVH, S, H]
    np.testing.assert_array_equal(k, k[:, np.arange(rows) // group * group])
    for r in range(rows):
        assert not k[:, r, :, num[src[r]] :].any() and k[:, r, :, : num[src[r]]].all()
