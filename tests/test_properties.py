"""Property-based tests (hypothesis) of every verifier and of ``sample`` on hostile-but-legal input.

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
from asps_jax.sampler import METHODS
from asps_jax.verify.api import CHAIN_METHODS, DRAFTS_METHODS

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
