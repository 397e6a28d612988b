"""Property-based tests (hypothesis) of every verifier (chains, drafts, trees) and of ``sample`` on
hostile-but-legal input.

Laws come with zeros, point masses and extreme ratios, draft tokens anywhere in the vocabulary
(also where the draft law is 0, out of contract), and padded chains. Whatever the input: tokens
lie in the vocabulary, -1 pads after ``num_tokens``, the accepted prefix follows the named chain,
a token of target probability 0 is never emitted, and the same key gives the same verdict. Shapes
are fixed so that each method compiles once; hypothesis only varies the values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import asps_jax
from asps_jax import trees
from asps_jax.sampler import METHODS
from asps_jax.verify import verify_tree
from asps_jax.verify.api import CHAIN_METHODS, DRAFTS_METHODS, TREE_METHODS

V, N, K = 6, 3, 3
BUDGET = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def laws(draw, rows: int):
    """float32 log-laws [rows, V]: random logits, some tokens removed, sometimes a point mass."""
    logits = draw(hnp.arrays(np.float64, (rows, V), elements=st.floats(-30, 30, width=32)))
    removed = draw(hnp.arrays(np.bool_, (rows, V)))
    for r in range(rows):
        if draw(st.booleans()) and draw(st.booleans()):  # a point mass now and then
            removed[r] = True
            removed[r, draw(st.integers(0, V - 1))] = False
        if removed[r].all():
            removed[r, draw(st.integers(0, V - 1))] = False
    logits = np.where(removed, -np.inf, logits)
    shifted = logits - logits.max(-1, keepdims=True)
    return (shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))).astype(np.float32)


@functools.cache
def _chain_fn(method):
    return jax.jit(
        lambda key, x, lq, lp, n: asps_jax.verify_chain(
            key, x, lq, lp, method=method, draft_length=n
        )
    )


@functools.cache
def _drafts_fn(method):
    return jax.jit(
        lambda key, x, lq, lp, n: asps_jax.verify_drafts(
            key, x, lq, lp, method=method, draft_length=n
        )
    )


def _check_verdict(verdict, draft_tokens_KN, lengths_K, target_lp_DV):
    tokens = np.asarray(verdict.tokens)
    num = int(verdict.num_tokens)
    k = int(verdict.draft_index)
    assert 0 <= k < draft_tokens_KN.shape[0]
    assert 1 <= num <= lengths_K[k] + 1
    assert np.all(tokens[num:] == -1)
    emitted = tokens[:num]
    assert np.all((emitted >= 0) & (emitted < V))
    # The accepted prefix is the named chain's; every emitted token has target mass.
    np.testing.assert_array_equal(emitted[:-1], draft_tokens_KN[k, : num - 1])
    for d, token in enumerate(emitted):
        assert target_lp_DV[d, token] > -np.inf, (d, token, target_lp_DV[d])


@pytest.mark.slow
@pytest.mark.parametrize("method", CHAIN_METHODS)
@BUDGET
@given(
    draft=laws(N),
    target=laws(N + 1),
    tokens=hnp.arrays(np.int32, (N,), elements=st.integers(0, V - 1)),
    length=st.integers(0, N),
    seed=st.integers(0, 2**31 - 1),
)
def test_chain_verdict_properties(method, draft, target, tokens, length, seed):
    fn = _chain_fn(method)
    key = jax.random.key(seed)
    verdict = fn(key, tokens, draft, target, jnp.int32(length))
    _check_verdict(verdict, tokens[None], np.array([length]), target)
    again = fn(key, tokens, draft, target, jnp.int32(length))
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(verdict.tokens))


@pytest.mark.slow
@pytest.mark.parametrize("method", [m for m in DRAFTS_METHODS if m not in CHAIN_METHODS])
@BUDGET
@given(
    draft=laws(N),
    target=laws(N + 1),
    tokens=hnp.arrays(np.int32, (K, N), elements=st.integers(0, V - 1), unique=False),
    lengths=hnp.arrays(np.int32, (K,), elements=st.integers(0, N)),
    seed=st.integers(0, 2**31 - 1),
)
def test_drafts_verdict_properties(method, draft, target, tokens, lengths, seed):
    """The laws depend on the depth only, so chains that share a prefix share their laws, as
    the contract requires; chains may share prefixes, tokens and lengths."""
    if method == "specinfer_wor":  # its contract: distinct root tokens
        tokens[:, 0] = np.arange(K)
    fn = _drafts_fn(method)
    key = jax.random.key(seed)
    lq = np.broadcast_to(draft, (K, N, V))
    lp = np.broadcast_to(target, (K, N + 1, V))
    verdict = fn(key, tokens, lq, lp, lengths)
    _check_verdict(verdict, tokens, lengths, target)
    again = fn(key, tokens, lq, lp, lengths)
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(verdict.tokens))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from hf_checkpoints import write_tiny_llama

    root = tmp_path_factory.mktemp("props")
    hf_target = write_tiny_llama(root / "target", seed=0, initializer_range=0.4)
    write_tiny_llama(root / "draft", seed=1, initializer_range=0.4, noise_from=hf_target)
    return asps_jax.load_model(str(root / "target")), asps_jax.load_model(str(root / "draft"))


SAMPLE_METHODS = ("ar", "asps", "specinfer")


@pytest.mark.slow
@pytest.mark.parametrize("method", SAMPLE_METHODS)
@settings(max_examples=4, deadline=None, derandomize=True)
@given(
    prompts=st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=9), min_size=2, max_size=4),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    top_k=st.sampled_from([None, 1, 3, 50]),
    top_p=st.sampled_from([None, 0.5, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_sample_properties(pair, method, prompts, temperature, top_k, top_p, seed):
    """Tokens in range, -1 after each length, and a row's tokens do not depend on its batch."""
    assert method in METHODS
    target, draft = pair
    kwargs = dict(
        key=jax.random.key(seed),
        max_new_tokens=5,
        method=method,
        num_draft_tokens=2,
        num_drafts=2 if method == "specinfer" else 1,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_token_id=-1,
        # As in tests/test_decode.py (same checkpoint shapes, n = 2 and K, same batch buckets):
        # a test run that compiled its loops already hands them back from the compilation cache.
        diagnostics=True,
    )
    out = asps_jax.sample(target, None if method == "ar" else draft, prompts, **kwargs)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    assert np.all(lengths == 5)
    assert np.all((tokens >= 0) & (tokens < target.vocab_size))
    # Row 0 alone, given its own key (row b of a batch uses fold_in(key, b)): same tokens.
    row_key = jax.random.fold_in(jax.random.key(seed), 0)
    alone = asps_jax.sample(
        target, None if method == "ar" else draft, prompts[:1], **{**kwargs, "key": row_key[None]}
    )
    np.testing.assert_array_equal(np.asarray(alone.tokens)[0], tokens[0])


# verify_tree: every tree method on two fixed node tables (so each compiles once); random valid
# masks carve random trees out of them, and random ids (repeated among siblings, out of range,
# of draft probability 0) merge, end or keep branches.
TREE_TABLES = {
    "branching": trees.branching_token_tree((3, 2)),  # 10 slots, widths 3 then 2
    "irregular": trees.TokenTree((-1, 0, 0, 0, 1, 1, 2, 4, 4, 6)),
}
TREE_OPTIONS = {  # every tree method of the registry, is_bv with each rule and alive mode
    "tv": ("tv", {}),
    "tv_wr": ("tv_wr", {}),
    "is_bv": ("is_bv", {}),
    "is_bv_fixed_order": ("is_bv", {"rule": "fixed_order"}),
    "is_bv_count": ("is_bv", {"alive": "count"}),
}


@functools.cache
def _tree_fn(name):
    tree = TREE_TABLES[name]
    uniform = name == "branching"  # alive="count" needs equal widths per depth

    def run(key, tokens, lq, lp, valid):
        return {
            label: verify_tree(key, tree, tokens, lq, lp, valid, method=m, **opts)
            for label, (m, opts) in TREE_OPTIONS.items()
            if uniform or label != "is_bv_count"
        }

    return jax.jit(run)


def test_tree_options_cover_the_registry():
    assert {m for m, _ in TREE_OPTIONS.values()} == set(TREE_METHODS)


@pytest.mark.slow
@BUDGET
@given(
    data=st.data(),
    name=st.sampled_from(sorted(TREE_TABLES)),
    seed=st.integers(0, 2**31 - 1),
)
def test_tree_verdict_properties(data, name, seed):
    """Tokens in [0, V) followed by -1, 1 <= num_tokens <= 1 + the deepest drawn slot, the path
    a chain of drawn, in-contract slots whose root-path tokens are the emitted prefix, and every
    emitted token of positive target probability after its prefix (its path node's law)."""
    tree = TREE_TABLES[name]
    slots = tree.num_nodes
    lq = data.draw(laws(slots))
    lp = data.draw(laws(slots))
    ids = st.one_of(st.integers(0, 2), st.integers(-2, V + 1))  # repeats, and out of range
    tokens = data.draw(hnp.arrays(np.int32, (slots,), elements=ids))
    valid = data.draw(hnp.arrays(np.bool_, (slots,)))
    key = jax.random.key(seed)
    out = _tree_fn(name)(key, tokens, lq, lp, valid)
    # Slots that can be on the path: drawn (valid, in range, draft probability > 0), with every
    # ancestor drawn too.
    in_range = (tokens >= 0) & (tokens < V)
    drawn = valid & in_range & (lq[np.arange(slots), np.clip(tokens, 0, V - 1)] > -np.inf)
    drawn[0] = True
    drawn = np.all(drawn[None, :] | ~tree.ancestors, axis=1)
    deepest = int(tree.depth[drawn].max())
    for label, verdict in out.items():
        emitted_all, path = np.asarray(verdict.tokens), np.asarray(verdict.path)
        num = int(verdict.num_tokens)
        assert 1 <= num <= deepest + 1, (label, num, deepest)
        assert (emitted_all[num:] == -1).all() and (path[num:] == -1).all(), label
        emitted = emitted_all[:num]
        assert ((emitted >= 0) & (emitted < V)).all(), (label, emitted)
        assert path[0] == 0
        for t in range(1, num):
            slot = path[t]
            assert drawn[slot] and tree.depth[slot] == t, (label, path)
            # The slot's root path carries the emitted prefix (merged siblings: equal tokens).
            root_path = tree.paths[slot, 1 : t + 1]
            np.testing.assert_array_equal(tokens[root_path], emitted[:t], err_msg=label)
        for t, token in enumerate(emitted):
            assert lp[path[t], token] > -np.inf, (label, t, token, path)
        again = _tree_fn(name)(key, tokens, lq, lp, valid)[label]
        np.testing.assert_array_equal(np.asarray(again.tokens), emitted_all)
