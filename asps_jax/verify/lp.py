"""A fixed-iteration LP solver for pairwise importance-sampling selection (docs/algorithms.md §3.8).

For K = 2 drafts with laws ``qa``, ``qb`` an IS selection rule is a matrix of pairwise weights
``W[i, j]`` = P(keep the first draft's token i | the second draft shows j != i). On a block of s
tokens (the truncated LP) the induced law of the selected token is affine in W::

    q_I(i) = c_i + sum_j A[i, j] W[i, j] - sum_j A[j, i] W[j, i],    A[i, j] = qa(i) qb(j) (i != j)

and the best weights maximise ``sum_i min(p_i, q_I(i))``. As an LP in (W, t)::

    max sum_i t_i   s.t.   t_i - (G W)_i <= c_i,   0 <= t_i <= p_i,   0 <= W <= 1.

Its dual has a closed form for any multipliers y >= 0 (the max over the boxes is explicit)::

    D(y) = sum_i y_i c_i + sum_i p_i (1 - y_i)_+ + sum_ij A[i, j] (y_i - y_j)_+

so every iterate carries a certified optimality gap ``D(y) - P(W)``; ``P(W)`` is the exact objective
of the clipped weights. We run a fixed number of diagonally preconditioned PDHG iterations
(Chambolle & Pock 2011, Pock & Chambolle 2011) with the operator applied in O(s^2) without forming
the constraint matrix, starting from the fixed-order rule. Callers use the weights only when the
gap is below a tolerance and otherwise fall back to an exact fixed rule: the solver proposes
weights, it never decides exactness (the induced law is always recomputed from the weights used).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PairwiseLPSolution:
    """Weights proposed by :func:`solve_pairwise_lp` with their certificate."""

    weights: jax.Array  # [s, s] in [0, 1]; the diagonal is irrelevant (A has a zero diagonal)
    primal: jax.Array  # []: sum_i min(p_i, q_I(i)) for ``weights`` (exact objective)
    dual: jax.Array  # []: an upper bound on the LP optimum
    converged: jax.Array  # bool[]: dual - primal <= tol


def selection_load(weights: jax.Array, coupling: jax.Array) -> jax.Array:
    """``(G W)_i = sum_j A[i, j] W[i, j] - sum_j A[j, i] W[j, i]`` for W [s, s], A [s, s] -> [s]."""
    flow = coupling * weights
    return jnp.sum(flow, axis=1) - jnp.sum(flow, axis=0)


def selection_mass(weights: jax.Array, coupling: jax.Array) -> jax.Array:
    """The pair part of the induced law from non-negative terms only:
    ``sum_j A[i, j] W[i, j] + sum_j A[j, i] (1 - W[j, i])`` for W clipped to [0, 1] -> [s].

    Equals ``sum_j A[j, i] + (G W)_i``, but without the cancellation of that form: a token that
    always loses gets exactly its own pair mass (possibly 0), never a negative rounding error.
    """
    w = jnp.clip(weights, 0.0, 1.0)
    return jnp.sum(coupling * w, axis=1) + jnp.sum(coupling * (1.0 - w), axis=0)


def primal_value(weights, target, base, coupling) -> jax.Array:
    """Exact objective ``sum_i min(p_i, c_i + (G W)_i)`` of the weights clipped to [0, 1]."""
    load = base + selection_load(jnp.clip(weights, 0.0, 1.0), coupling)
    return jnp.sum(jnp.minimum(target, load))


def dual_value(duals, target, base, coupling) -> jax.Array:
    """The closed-form dual bound ``D(y)`` above (valid for every y >= 0)."""
    y = jnp.clip(duals, 0.0, 1.0)
    pair = jnp.maximum(y[:, None] - y[None, :], 0.0)
    return (
        jnp.sum(y * base) + jnp.sum(target * jnp.maximum(1.0 - y, 0.0)) + jnp.sum(coupling * pair)
    )


def solve_pairwise_lp(
    target: jax.Array,
    base: jax.Array,
    coupling: jax.Array,
    init_weights: jax.Array,
    *,
    num_iters: int = 300,
    tol: float = 1e-5,
) -> PairwiseLPSolution:
    """Maximise ``sum_i min(p_i, c_i + (G W)_i)`` over ``W in [0, 1]^{s x s}`` (fixed iterations).

    Args:
      target: [s] target masses p_i (>= 0).
      base: [s] the W-independent part c_i of the induced law.
      coupling: [s, s] pair masses A[i, j] >= 0 with a zero diagonal.
      init_weights: [s, s] starting weights (e.g. the fixed-order rule).
      num_iters: PDHG iterations (static).
      tol: absolute optimality gap accepted as converged.
    """
    dtype = target.dtype
    # Diagonal preconditioning: tau_j = 1 / ||K[:, j]||_1, sigma_i = 1 / ||K[i, :]||_1. Column
    # W[i, j] touches rows i and j with weight A[i, j]; t_i only row i. Zero columns are frozen.
    tau_w = jnp.where(coupling > 0, 1.0 / jnp.maximum(2.0 * coupling, 1e-30), 0.0).astype(dtype)
    sigma = 1.0 / (1.0 + jnp.sum(coupling, axis=1) + jnp.sum(coupling, axis=0))

    def constraint(w, t):  # K z - c, feasible where <= 0
        return t - selection_load(w, coupling) - base

    def step(_, carry):
        w, t, y = carry
        # Gradient of the Lagrangian -sum t + y^T (K z - c): K^T y on W is -A[i, j] (y_i - y_j).
        grad_w = -coupling * (y[:, None] - y[None, :])
        w_new = jnp.clip(w - tau_w * grad_w, 0.0, 1.0)
        t_new = jnp.clip(t - (y - 1.0), 0.0, target)
        y_new = jnp.maximum(y + sigma * constraint(2 * w_new - w, 2 * t_new - t), 0.0)
        return w_new, t_new, y_new

    w0 = jnp.clip(init_weights, 0.0, 1.0).astype(dtype)
    t0 = jnp.minimum(target, base + selection_load(w0, coupling))
    y0 = jnp.full_like(target, 0.5)
    w, _, y = jax.lax.fori_loop(0, num_iters, step, (w0, t0, y0))
    primal = primal_value(w, target, base, coupling)
    # D is the Lovász extension of a cut function, so D(y) = int_0^1 D(1[y > theta]) d theta and
    # the best threshold rounding of y is a bound at least as tight (s + 1 candidates).
    y = jnp.clip(y, 0.0, 1.0)
    cuts = (y[None, :] > jnp.concatenate([jnp.zeros((1,), dtype), y])[:, None]).astype(dtype)
    dual = jnp.minimum(
        dual_value(y, target, base, coupling),
        jnp.min(jax.vmap(lambda yc: dual_value(yc, target, base, coupling))(cuts)),
    )
    return PairwiseLPSolution(weights=w, primal=primal, dual=dual, converged=(dual - primal) <= tol)
