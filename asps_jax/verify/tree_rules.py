"""The selection rules of ``"is_bv"`` (verify/tree.py): which walker's token a node of the path
selects, and the exact law of the selected token (docs/algorithms.md §7)."""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax.logspace import NEG_INF
from asps_jax.verify.level_race import fit_race, race_selection

ALIVE_MODES = ("walkers", "count")
TREE_RULES = ("level_race", "fixed_order")  # the named selection rules of "is_bv"


def _log(x):
    return jnp.where(x > 0, jnp.log(jnp.where(x > 0, x, 1.0)), NEG_INF)


class SelectionRule(Protocol):
    """An importance-sampling selection rule for the walkers of one node, with its exact law.

    ``walkers(p, q_WV, tokens_W, alive_W) -> (select_W, q_I [V])``: P(walker w's token is
    selected | the tokens) for each walker (zero off ``alive_W``, summing to 1), and the law of
    the selected token when the alive walkers are independent draws from their rows of ``q_WV``
    (marginal over the tokens and over the rule's own randomness).

    ``counted(p, q_V, pi_M, tokens_W, alive_W) -> (select_W, q_I [V], survivors [W, M])``: the
    same for m i.i.d. draws from ``q_V`` with m ~ ``pi_M`` (m = 0..M-1); ``survivors[w, j]`` =
    P(walker w's token is selected and shown by j of the m draws), the law of the number of
    drafts still alive below the selected node. The pick is drawn from ``select_W`` (one-hot for
    a deterministic rule).
    """

    def walkers(self, p, q_WV, tokens_W, alive_W): ...

    def counted(self, p, q_V, pi_M, tokens_W, alive_W): ...


@dataclasses.dataclass(frozen=True)
class FixedOrderRule:
    """Select the walker token of highest rank, ranking tokens by ``log p - log mean(q)`` (ties:
    the smaller token id ranks higher). Deterministic given the tokens.

    With ``B_w(z)`` the mass of q_w ranked below z and ``A_w = q_w + B_w``,
    ``q_I(z) = prod_w A_w(z) - prod_w B_w(z)``, built from the non-negative terms
    ``sum_k prod_{w<k} B_w(z) q_k(z) prod_{w>k} A_w(z)``; for m i.i.d. draws
    ``A^m - B^m = q sum_{i<m} A^i B^(m-1-i)`` and P(z selected, j draws show z) =
    ``C(m, j) q(z)^j B(z)^(m-j)``. One sort of the vocabulary per node.
    """

    def _ascending(self, p, q_mean):
        """Tokens from the lowest rank to the highest: ``int32[V]``."""
        key = jnp.where(q_mean > 0, _log(p) - _log(q_mean), -jnp.inf)
        vocab = key.shape[0]
        # Stable sort of the reversed keys: among equal keys the larger token id comes first.
        return (vocab - 1 - jnp.argsort(jnp.flip(key), stable=True)).astype(jnp.int32)

    def _select(self, order, tokens_W, alive_W):
        """One-hot ``[W]``: the alive walker whose token ranks highest."""
        position = (
            jnp.zeros(order.shape, jnp.int32)
            .at[order]
            .set(jnp.arange(order.shape[0], dtype=jnp.int32))
        )
        best = jnp.argmax(jnp.where(alive_W, position[tokens_W], -1))
        return jax.nn.one_hot(best, tokens_W.shape[0])

    def walkers(self, p, q_WV, tokens_W, alive_W):
        count = jnp.maximum(jnp.sum(alive_W), 1)
        order = self._ascending(p, jnp.sum(jnp.where(alive_W[:, None], q_WV, 0.0), 0) / count)
        q_s = q_WV[:, order]  # [W, V] in ascending rank
        b_s = jnp.cumsum(q_s, axis=1) - q_s
        b = jnp.where(alive_W[:, None], b_s, 1.0)
        a = jnp.where(alive_W[:, None], q_s + b_s, 1.0)
        before = jnp.concatenate([jnp.ones_like(b[:1]), jnp.cumprod(b, axis=0)[:-1]])
        after = jnp.flip(jnp.cumprod(jnp.flip(a, 0), axis=0), 0)
        after = jnp.concatenate([after[1:], jnp.ones_like(a[:1])])
        law_s = jnp.sum(jnp.where(alive_W[:, None], before * q_s * after, 0.0), axis=0)
        law = jnp.zeros_like(law_s).at[order].set(law_s)
        return self._select(order, tokens_W, alive_W).astype(law.dtype), law

    def counted(self, p, q_V, pi_M, tokens_W, alive_W):
        size = pi_M.shape[0]
        order = self._ascending(p, q_V)
        q_s = q_V[order]
        b_s = jnp.cumsum(q_s) - q_s
        a_s = q_s + b_s

        # G_m = sum_{i<m} A^i B^(m-1-i): G_0 = 0, G_{m+1} = A^m + B G_m.
        def power(carry, _):
            g, a_m = carry
            return (a_m + b_s * g, a_m * a_s), g

        init = (jnp.zeros_like(q_s), jnp.ones_like(q_s))
        _, g_MV = jax.lax.scan(power, init, None, length=size)
        law = jnp.zeros_like(q_s).at[order].set(q_s * jnp.einsum("m,mv->v", pi_M, g_MV))
        b_W = jnp.zeros_like(b_s).at[order].set(b_s)[tokens_W]
        m = np.arange(size)[:, None]
        j = np.arange(size)[None, :]
        binom = np.array(
            [[math.comb(mm, jj) * (1 <= jj <= mm) for jj in range(size)] for mm in m[:, 0]]
        )
        # survivors[w, j] = sum_m pi(m) C(m, j) q(z_w)^j B(z_w)^(m-j).
        weight = pi_M[:, None] * jnp.asarray(binom, q_V.dtype)  # [m, j]
        powers = (
            q_V[tokens_W][:, None, None] ** j[None]
            * b_W[:, None, None] ** np.maximum(m - j, 0)[None]
        )  # [W, m, j]
        surv = jnp.einsum("mj,wmj->wj", weight, powers)
        return self._select(order, tokens_W, alive_W).astype(law.dtype), law, surv


@dataclasses.dataclass(frozen=True)
class LevelRaceRule:
    """The level race (level_race.py, docs/algorithms.md §3.10) at each node of the path: every
    alive walker draws a level from its token's level law, the lowest level wins, ties uniformly.
    Its induced law is exact for walkers drawn from different laws, and its rates are fitted to
    the target at the node, so the selected token's law tracks p far better than a fixed order
    (which over-selects the top-ranked tokens on flat laws). A node with one alive walker selects
    it (``q_I = q``, no fit). Random: the pick is drawn from ``select_W``.

    Only ``alive="walkers"``: the law of the number of drafts alive below a race's winner has no
    closed form here (:class:`FixedOrderRule` gives it).
    """

    levels: int = 16  # J
    fit_steps: int = 15  # T
    table: int = 128  # B: level laws tabulated on log(p / q) (level_race.fit_race; 0: per token)
    batch_axis: str | None = None  # a vmap axis over rows: fit only when some row needs it

    def walkers(self, p, q_WV, tokens_W, alive_W):
        options = dict(table=self.table, batch_axis=self.batch_axis)
        race = fit_race(p, q_WV, alive_W, self.levels, self.fit_steps, **options)
        return race_selection(race, tokens_W, alive_W), race.q_sel

    def counted(self, p, q_V, pi_M, tokens_W, alive_W):
        raise NotImplementedError('LevelRaceRule supports alive="walkers" only')
