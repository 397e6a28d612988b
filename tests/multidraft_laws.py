"""The library's token-level schemes as exact node laws ``pi(y | x)`` for enumeration tests.

Each entry of :data:`SCHEMES` builds, for a vocabulary size, a jitted function
``law(p[V], q[K, V], xs[M, K], alive[K]) -> [M, V]``: the law of the emitted token for each of M
token tuples (:func:`asps_jax.verify.tokenlevel.outcome_law`), in the dtype of its inputs. The
enumeration itself (tree walk, continuation by the target) lives in multidraft_reference.py.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax.verify import options as verify_options
from asps_jax.verify import tokenlevel
from asps_jax.verify.selection import RuleConfig

# Compiling dominates these tests (dozens of small programs) and the programs run in microseconds,
# so they are compiled without XLA's backend optimisations.
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def law_fn(scheme):
    def law(p, q, xs, alive):
        return jax.vmap(lambda x: tokenlevel.outcome_law(scheme(p, q, x, alive), x))(xs)

    return jax.jit(law, compiler_options=_FAST_COMPILE)


def is_law_fn(cfg):
    """IS schemes: the LP solves depend on the laws only, so they run once for all tuples."""

    def law(p, q, xs, alive):
        prepared = tokenlevel.importance_sampling_rules(p, q, alive, cfg)
        outcome = lambda x: tokenlevel.importance_sampling_outcome(prepared, p, q, x, alive)  # noqa: E731
        return jax.vmap(lambda x: tokenlevel.outcome_law(outcome(x), x))(xs)

    return jax.jit(law, compiler_options=_FAST_COMPILE)


def is_cfg(rule, block, alphabet, lp_iters=1000):
    return lambda vocab: RuleConfig(rule, min(block, vocab), min(alphabet, vocab), lp_iters)


SCHEMES = {
    "specinfer": lambda vocab: law_fn(tokenlevel.specinfer),
    "specinfer_wor": lambda vocab: law_fn(tokenlevel.specinfer_without_replacement),
    "spectr": lambda vocab: law_fn(tokenlevel.spectr),
    # The LP's iteration count changes efficiency only: few iterations mix LP and fallback weights.
    "is_lp_s2_m3": lambda vocab: is_law_fn(is_cfg("truncated_lp", 2, 3, 300)(vocab)),
    "is_fixed_order_m3": lambda vocab: is_law_fn(is_cfg("fixed_order", 1, 3)(vocab)),
    "is_sir_m3": lambda vocab: is_law_fn(is_cfg("sir", 3, 3)(vocab)),
    # The pairwise LP on 16 tokens (the old "optimal"; LP-optimal for K = 2 when V <= 16).
    "pairwise_lp16": lambda vocab: is_law_fn(is_cfg("truncated_lp", 16, 16)(vocab)),
    # The public "optimal" (gradient-fitted level race) and a cheaper one for the tree grids.
    "optimal": lambda vocab: is_law_fn(verify_options.rule_config("optimal", vocab, {})),
    "optimal_g20": lambda vocab: is_law_fn(
        verify_options.rule_config("optimal", vocab, {"grad_steps": 20})
    ),
    "is_lp_no_iters": lambda vocab: is_law_fn(is_cfg("truncated_lp", 5, 40, 0)(vocab)),
    # The level race (§3.10) on few levels and fit steps (the rates only change efficiency).
    "is_race_j3": lambda vocab: is_law_fn(RuleConfig("level_race", levels=3, fit_steps=4)),
    "is_race_j1": lambda vocab: is_law_fn(RuleConfig("level_race", levels=1, fit_steps=1)),
    # Two tabulated level laws on log(p / q) (+ the p = 0 and unproposed entries) that tokens mix.
    "is_race_table2": lambda vocab: is_law_fn(
        RuleConfig("level_race", levels=3, fit_steps=4, table=2)
    ),
    "optimal_table2": lambda vocab: is_law_fn(
        verify_options.rule_config("optimal", vocab, {"table": 2, "grad_steps": 5})
    ),
    # The public "is" defaults (the level race, J = 16, T = 15), as verify_drafts builds them.
    "is_default": lambda vocab: is_law_fn(verify_options.rule_config("is", vocab, {})),
    # At V = 4 the statistical test's "is" with rule="truncated_lp", lp_iters=60 solves this LP.
    "stat_lp": lambda vocab: is_law_fn(is_cfg("truncated_lp", 16, 16, 60)(vocab)),
}
_LAW_CACHE = {}


def node_law(name, vocab):
    """``fn(p, q, xs, alive) -> [M, V]`` NumPy float64 law of scheme ``name`` (compiled once)."""
    if (name, vocab) not in _LAW_CACHE:
        _LAW_CACHE[(name, vocab)] = SCHEMES[name](vocab)
    fn = _LAW_CACHE[(name, vocab)]

    def call(p, q, xs, alive):
        with jax.enable_x64(True):
            return np.asarray(fn(*(jnp.asarray(a) for a in (p, q, xs, alive))))

    return call


def root_acceptance(name, p, qs, alive=None):
    """P(Y in {X_k : alive}) at one node, exactly, for scheme ``name``."""
    num_drafts, vocab = qs.shape
    alive = np.ones(num_drafts, bool) if alive is None else np.asarray(alive)
    xs = np.array(list(itertools.product(range(vocab), repeat=num_drafts)), np.int64)
    laws = node_law(name, vocab)(p, qs, xs, alive)
    probs = np.ones(len(xs))
    for k in range(num_drafts):
        probs *= qs[k][xs[:, k]] if alive[k] else xs[:, k] == 0
    hit = np.zeros_like(laws, bool)
    for k in np.nonzero(alive)[0]:
        hit[np.arange(len(xs)), xs[:, k]] = True
    return float(np.sum(probs[:, None] * laws * hit))
