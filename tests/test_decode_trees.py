"""End-to-end tests of the tree methods' decode loop beyond what ``test_decode.py`` runs for every
method: branching draft trees (``sample(tree=...)``), the merged-tree scoring, the verdict's chain,
and tree options. Expected values come from transformers, as there (its helpers are shared).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_decode import (
    GREEDY_DRAFT_TEMPERATURES,
    GREEDY_PROMPTS,
    MAX_NEW,
    N_DRAFT,
    PROMPT,
    _assert_two_token_law,
    _hf_greedy,
    _sample_law,
    write_pair,
)

import asps_jax
from asps_jax import decode, sampler
from asps_jax.verify.step import verify_step


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("ckpt"))


# A branching draft tree for each tree method: siblings without replacement ("tv"), independent
# ("tv_wr", "is_bv").
TREE_CASES = [("tv", (2, 2)), ("tv_wr", (2, 2)), ("is_bv", (2, 2))]


@pytest.fixture(scope="module")
def tree_law_run(pair):
    """One run per tree case: its law rows (three new tokens: the first step drafts the whole
    tree, 2 + 4 nodes, fewer when siblings repeat, and the first two tokens are decided at its
    depths 1 and 2) and its greedy rows (MAX_NEW tokens), in one compiled loop."""
    _, target, draft = pair
    runs = {}

    def run(method, tree):
        if (method, tree) not in runs:
            kw = dict(num_drafts=None, num_draft_tokens=None, max_new_tokens=3)
            runs[method, tree] = _sample_law(target, draft, method, tree=tree, greedy=True, **kw)
        return runs[method, tree]

    return run


@pytest.mark.slow
@pytest.mark.optimized  # the law run outweighs its compile (tests/conftest.py)
@pytest.mark.parametrize("method, tree", TREE_CASES)
def test_branching_tree_follows_the_target_law(pair, tree_law_run, method, tree):
    hf_target = pair[0]
    out, _ = tree_law_run(method, tree)
    assert np.all(np.asarray(out.lengths) == 3)
    scored = np.asarray(out.stats["scored_nodes_per_step"])
    assert np.all(scored <= 6) and np.all(scored > 0)
    _assert_two_token_law(hf_target, out, f"{method} tree={tree}")


# The merge and the scoring are the same for every tree method; "tv_wr" drafts and scores as "tv".
@pytest.mark.slow
@pytest.mark.parametrize("method", ["tv", "is_bv"])
def test_merged_tree_scores_fewer_nodes_and_gives_the_same_tokens(pair, method):
    """Chains that share a prefix share its nodes in the target forward: fewer nodes scored than
    K separate chains, and the very same tokens as scoring every slot (the verifier never reads
    a repeated slot)."""
    _, target, draft = pair
    rows, k = 64, 3
    call = sampler.prepare(
        target,
        draft,
        [PROMPT] * rows,
        key=jax.random.key(5),
        max_new_tokens=MAX_NEW,
        method=method,
        num_drafts=k,
        num_draft_tokens=N_DRAFT,
        draft_temperature=0.7,  # peaked draft laws: chains often repeat each other
        eos_token_id=-1,
    )
    merged_decoder, args, batch = call.decoder, call.inputs.kwargs(), call.batch
    assert merged_decoder.merge_tree
    every_slot = dataclasses.replace(merged_decoder, merge_tree=False)
    merged_state = merged_decoder.generate(**args)
    # Llama's run layout unrolls the layers; the loop then keeps one cache buffer per layer.
    assert merged_state.target_cache.per_layer and merged_state.draft.per_layer
    merged = sampler.summarize_stats(merged_state, batch)
    merged_tokens = np.asarray(merged_state.tokens)
    full_state = every_slot.generate(**args)
    full = sampler.summarize_stats(full_state, batch)
    np.testing.assert_array_equal(merged_tokens, np.asarray(full_state.tokens))
    calls = np.asarray(full["target_calls"])
    full_nodes = np.asarray(full["scored_nodes_per_step"]) * calls
    merged_nodes = np.asarray(merged["scored_nodes_per_step"]) * calls
    # Scoring every slot: K chains of n tokens (shorter only where max_new_tokens cuts them).
    assert np.all(full_nodes <= k * N_DRAFT * calls) and np.all(full_nodes >= k * calls)
    assert np.all(merged_nodes <= full_nodes) and merged_nodes.sum() < 0.9 * full_nodes.sum()


@pytest.mark.slow
@pytest.mark.parametrize("method, tree", TREE_CASES)
def test_branching_tree_greedy_is_the_target_greedy_decoding(pair, tree_law_run, method, tree):
    """A greedy draft (one-hot laws): "tv" runs out of distinct siblings at once, and the tokens
    it could not draw end their chains instead of being verified. The greedy rows (draft
    temperature 0 and 1) of the law run's loop."""
    hf_target = pair[0]
    _, tokens = tree_law_run(method, tree)
    for b, prompt in enumerate(GREEDY_PROMPTS):
        want = _hf_greedy(hf_target, prompt, MAX_NEW)
        for d, draft_temp in enumerate(GREEDY_DRAFT_TEMPERATURES):
            assert tokens[d, b].tolist() == want, (prompt, draft_temp)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(method="tv", alive="count"), "takes no options"),
        (dict(method="is_bv", beta=1.0), "unknown option"),
        (dict(method="is_bv", alive="all"), "alive must be one of"),
        (dict(method="tree"), "unknown method"),
    ],
)
def test_tree_method_bad_options_are_one_line_errors(pair, kwargs, match):
    _, target, draft = pair
    with pytest.raises(ValueError, match=match) as info:
        asps_jax.sample(
            target, draft, [PROMPT], key=jax.random.key(0), max_new_tokens=MAX_NEW, num_drafts=2,
            **kwargs,
        )  # fmt: skip
    assert "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["tv", "tv_wr"])
def test_tree_verdict_names_the_chain_that_drew_the_accepted_path(method):
    """Chains (1, 2), (1, 3), (4, 4) share their root token; after it the target rules out 2 and
    says 3, then 0: TV rejects (1, 2) and accepts (1, 3) through chain 0's slot of token 1 (the
    merged node) and chain 1's slot of token 3, so the path commits those slots and the draft
    replicas sync to chain 1, the chain that drew the whole path."""
    vocab = 5
    spec = decode.SpecConfig(method=method, num_draft_tokens=2, num_drafts=3, max_new_tokens=6)
    uniform = np.full(vocab, -np.log(vocab), np.float32)
    with np.errstate(divide="ignore"):
        point = np.log(np.eye(vocab, dtype=np.float32))
    # Node i: the target after slot i (slots 1 + 2k + j); equal prefixes get equal laws.
    target_lp = np.stack([uniform, point[3], uniform, point[3], point[0], uniform, uniform])
    tokens_N = jnp.array([7, 1, 2, 1, 3, 4, 4], jnp.int32)  # the root, then chain k at 1 + 2k
    draft_lp = jnp.broadcast_to(uniform, (7, vocab))
    verify = jax.jit(
        lambda lp, key: verify_step(
            spec.method, spec.tree, key, tokens_N, draft_lp, lp, jnp.ones(7, bool), {}
        )
    )
    verdict, path = jax.tree.map(lambda a: a[None], verify(target_lp, jax.random.key(0)))
    assert verdict.tokens.tolist() == [[1, 3, 0]] and verdict.num_tokens.tolist() == [3]
    assert path.tolist() == [[0, 1, 4]] and verdict.draft_index.tolist() == [1]
