"""No token with target probability 0 is ever emitted by the IS rules (issue 15, defect 8), and
the pairwise rules' induced law is built from non-negative terms (no cancellation to q_I <= 0)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import asps_jax
from asps_jax.verify import options as verify_options
from asps_jax.verify import tokenlevel
from asps_jax.verify.selection import RuleConfig, build_pairwise


def test_pairwise_law_of_a_token_that_always_loses():
    """float32: a token ranked last (p = 0) with pair mass 1e-16 keeps exactly that mass.

    The old ``base + selection_load`` form cancelled it to <= 0, so it was accepted where p = 0.
    """
    p = np.array([0.0, 0.3, 0.3, 0.2, 0.2])
    q = np.array([1e-8, 0.4, 0.3, 0.2, 0.1 - 1e-8])
    cfg = RuleConfig("fixed_order", block=5, alphabet=5)
    args = [jnp.asarray(a, jnp.float32) for a in (p, q, q)]
    _, law, _ = jax.jit(lambda *a: build_pairwise(*a, cfg))(*args)
    assert float(law[0]) > 0
    assert float(law[0]) == pytest.approx(float(np.float32(1e-8)) ** 2, rel=1e-5)


P_ZERO_FIRST = np.array([0.0, 0.3, 0.3, 0.25, 0.15])


def _zero_token_laws(method, options, num_drafts, q_tokens):
    """float32 node laws pi(. | x = (0, .., 0)) when every chain drafted token 0 (p = 0, q tiny),
    one per q in ``q_tokens``, with the rule verify_drafts builds for ``method`` / ``options``."""
    vocab = len(P_ZERO_FIRST)
    cfg = verify_options.rule_config(method, vocab, options)
    x = jnp.zeros((num_drafts,), jnp.int32)
    alive = jnp.ones((num_drafts,), bool)
    p = jnp.asarray(P_ZERO_FIRST, jnp.float32)

    def law(q_token):
        q = jnp.full((vocab,), 1.0, jnp.float32).at[0].set(0.0)
        q = q * (1.0 - q_token) / (vocab - 1) + jnp.zeros((vocab,), jnp.float32).at[0].set(q_token)
        qs = jnp.broadcast_to(q, (num_drafts, vocab))
        return tokenlevel.outcome_law(tokenlevel.importance_sampling(p, qs, x, alive, cfg), x)

    return np.asarray(jax.jit(jax.vmap(law))(jnp.asarray(q_tokens, jnp.float32)))


@pytest.mark.slow
@pytest.mark.parametrize(
    "method,options",
    [
        ("is", {}),
        ("is", {"rule": "truncated_lp"}),
        ("is", {"rule": "fixed_order"}),
        ("optimal", {}),
    ],
)
def test_never_emits_a_zero_probability_token(method, options):
    """Issue 15, defect 8: every live chain drafted the same token (p = 0, q <= 1e-4 for K = 3,
    q = 1e-8 for K = 2): the emitted law puts exactly 0 on it (float32, the public dtype). The old
    pairwise law cancelled to q_I <= 0 there and accepted the token with certainty."""
    for num_drafts, q_tokens in ((3, [1e-4, 3e-5, 1e-5, 1e-6]), (2, [1e-8, 1e-7])):
        laws = _zero_token_laws(method, options, num_drafts, q_tokens)
        assert np.all(laws[:, 0] == 0), (method, options, num_drafts, laws[:, 0])
        np.testing.assert_allclose(laws.sum(1), 1.0, atol=1e-5)


@pytest.mark.slow
def test_never_emits_a_zero_probability_token_verify_drafts():
    """The same through verify_drafts (default "is" and "optimal", K = 2, q = 1e-8, 2048 keys)."""
    num_drafts, vocab, n = 2, len(P_ZERO_FIRST), 2
    q = np.full(vocab, (1.0 - 1e-8) / (vocab - 1))
    q[0] = 1e-8
    lq = np.log(np.broadcast_to(q, (num_drafts, n, vocab))).astype(np.float32)
    with np.errstate(divide="ignore"):
        lp = np.log(np.broadcast_to(P_ZERO_FIRST, (num_drafts, n + 1, vocab))).astype(np.float32)
    tokens = np.zeros((num_drafts, n), np.int32)

    def one(key):
        return tuple(
            asps_jax.verify_drafts(key, tokens, lq, lp, method=m).tokens for m in ("is", "optimal")
        )

    outs = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(0), 2048))
    for out in outs:
        out = np.asarray(out)
        assert np.all(P_ZERO_FIRST[out[out >= 0]] > 0)
