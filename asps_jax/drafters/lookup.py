"""Prompt-lookup drafting: draft chains copied from the row's own text (docs/algorithms.md §9).

The drafter reads each row's committed text, the prompt followed by the generated tokens (the
root last; :class:`asps_jax.controls.penalties.History`). The last ``m`` tokens (``m =
lookup_ngram``) are searched for among the earlier text; the continuation of an occurrence (the
tokens after it, up to ``lookup_max`` and never past the root) is a draft chain. Chain k is the k-th
most recent *distinct* continuation: candidates are taken from the most recent occurrence backwards,
and a continuation equal, token for token over the whole window, to one taken before is skipped. A
row with fewer than K distinct continuations gets chains of length 0, and a row with no occurrence
drafts nothing that step (it emits the target's token). A constrained row (regex / JSON schema) cuts
every continuation before its first token the constraint forbids at its node (the DFA walked from
the row's committed state along the continuation); an occurrence whose continuation is then empty is
no match, so the next most recent one is taken.

Each chain is a deterministic function of the committed text (and the row's committed
constraint state, itself a function of that text), so its law is a point mass: log-prob
0 at the chain's token, ``-inf`` elsewhere. Every verifier is exact for it (SpS accepts x with
probability ``p(x)``, else draws from p with x removed), and for K chains each a point mass (the
multi-draft schemes are exact for independent drafts with per-draft laws; deterministic drafts are
independent). Everything is on device with fixed shapes: one ``[H, D]`` window table per row and K
selection rounds, no host round trip.

Shape letters: B batch, H history width, K chains, D draft length (n), V vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from asps_jax import footprint
from asps_jax.controls import constraints
from asps_jax.drafters.base import Drafter, Proposal
from asps_jax.logspace import NEG_INF

DEFAULT_NGRAM = 3


def row_candidates(
    text_H, length, *, ngram: int, cap, num_chains: int, draft_len: int, allowed=None
):
    """One row's lookup chains.

    Args:
      text_H: int32[H], the committed text (prompt, then generated tokens), -1 after ``length``.
      length: int32[], the number of tokens of ``text_H``.
      ngram: m >= 1 (static), the suffix length searched for.
      cap: int32[] (or int), the longest chain to draft (``lookup_max``), at most ``draft_len``.
      num_chains: K (static). draft_len: D (static).
      allowed: None, or a function of the continuation windows int32[H, D] returning bool[H, D],
        whether each window's token d is allowed after its first d tokens (the row's constraint,
        :func:`constraint_filter`); a window is cut before its first token not allowed, and an
        occurrence whose continuation is then empty is no match.

    Returns:
      ``(tokens int32[K, D], lengths int32[K])``: the K most recent distinct continuations of an
      earlier occurrence of the last ``ngram`` tokens (entries at and past a chain's length are 0).
    """
    width = text_H.shape[0]
    pos = jnp.arange(width)
    # An occurrence *ending* at j: text[j - i] == text[length - 1 - i] for i < m, with j strictly
    # before the last token (the suffix itself is not an occurrence) and j - m + 1 >= 0.
    match_H = (pos >= ngram - 1) & (pos < length - 1) & (length >= ngram)
    for i in range(ngram):
        suffix_i = text_H[jnp.clip(length - 1 - i, 0, width - 1)]
        match_H = match_H & (text_H[jnp.clip(pos - i, 0, width - 1)] == suffix_i)
    # The continuation after j: text[j + 1 + d] for j + 1 + d < length and d < cap, else -1.
    at_HD = pos[:, None] + 1 + jnp.arange(draft_len)[None, :]
    inside_HD = (at_HD < length) & (jnp.arange(draft_len)[None, :] < cap)
    if allowed is not None:  # cut before the first token the constraint forbids at its node
        ok_HD = allowed(jnp.maximum(text_H[jnp.clip(at_HD, 0, width - 1)], 0))
        inside_HD = inside_HD & (jnp.cumsum(~ok_HD, axis=1) == 0)
    windows_HD = jnp.where(inside_HD, text_H[jnp.clip(at_HD, 0, width - 1)], -1)
    lengths_H = jnp.sum(inside_HD, axis=1).astype(jnp.int32)
    match_H = match_H & (lengths_H > 0)  # (always so without a constraint)

    def pick(avail_H, _):
        found = jnp.any(avail_H)
        j = jnp.argmax(jnp.where(avail_H, pos, -1))  # the most recent one left
        window_D = windows_HD[j]
        # Every candidate with this very window (j included) is spent.
        avail_H = avail_H & ~jnp.all(windows_HD == window_D[None, :], axis=1)
        chain_len = jnp.where(found, lengths_H[j], 0)
        tokens_D = jnp.where(jnp.arange(draft_len) < chain_len, window_D, 0)
        return avail_H, (tokens_D.astype(jnp.int32), chain_len.astype(jnp.int32))

    _, (tokens_KD, lengths_K) = jax.lax.scan(pick, match_H, None, length=num_chains)
    return tokens_KD, lengths_K


def constraint_filter(sampling, state):
    """For a row whose committed constraint state is ``state`` (int32[]): the ``allowed``
    function of :func:`row_candidates`, walking each window through the row's DFA from
    ``state`` (a forbidden token leads to the sink, which allows nothing after it)."""

    def allowed(windows_HD):
        states_H = jnp.broadcast_to(state, windows_HD.shape[:1])
        ok = []
        for d in range(windows_HD.shape[1]):
            ok.append(constraints.allows(sampling, states_H, windows_HD[:, d]))
            states_H = constraints.advance(sampling, states_H, windows_HD[:, d])
        return jnp.stack(ok, axis=1)

    return allowed


def lookup_drafts(
    history,
    *,
    ngram: int,
    cap: int,
    num_chains: int,
    draft_len: int,
    vocab: int,
    sampling=None,
):
    """The lookup chains of every row: ``(tokens int32[B, K, D], logprobs float32[B, K, D, V],
    lengths int32[B, K])``; ``logprobs`` are the point-mass laws (0 at the token, -inf
    elsewhere; at depths past a chain's length a point mass on token 0, never read). With a
    constrained ``sampling`` (:class:`~asps_jax.controls.processors.SamplingParams`), each row's
    candidates are cut before their first token its constraint forbids (:func:`row_candidates`).
    """
    constrained = sampling is not None and sampling.constrained
    states_B = (
        constraints.root_states(sampling, history)
        if constrained
        else jnp.zeros_like(history.length)
    )

    def row(text, length, state):
        allowed = constraint_filter(sampling, state) if constrained else None
        return row_candidates(
            text,
            length,
            ngram=ngram,
            cap=cap,
            num_chains=num_chains,
            draft_len=draft_len,
            allowed=allowed,
        )

    tokens_BKD, lengths_BK = jax.vmap(row)(history.tokens, history.length, states_B)
    logprobs_BKDV = point_mass_laws(tokens_BKD, vocab)
    return tokens_BKD, logprobs_BKDV, lengths_BK


def point_mass_laws(tokens, vocab: int) -> jax.Array:
    """float32[..., V]: log-prob 0 at each token, ``-inf`` elsewhere."""
    ids = jnp.arange(vocab).reshape((1,) * tokens.ndim + (vocab,))
    return jnp.where(ids == tokens[..., None], 0.0, NEG_INF).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Lookup(Drafter):
    """``draft="lookup"``: K chains copied from each row's own text (see the module docstring);
    no parameters, no state. ``ngram``: m, the suffix searched for; ``cap``: the longest chain
    (0: ``num_draft_tokens``)."""

    ngram: int = DEFAULT_NGRAM
    cap: int = 0

    one_root_law = False  # K different point masses

    @property
    def name(self) -> str:
        return "lookup"

    def check(self, target, spec) -> None:
        if spec.method.kind == "tree" or spec.tree.plan is not None:
            what = (
                "verifies a tree of draws from one law per node"
                if spec.method.kind == "tree"
                else "draws its K root drafts without replacement from one law"
            )
            raise ValueError(
                f"draft='lookup': method {spec.method.name!r} {what}; lookup chains are point "
                "masses per chain: use a chain method (sps, asps) or a multi-draft one "
                "(specinfer, spectr, is, optimal)"
            )

    def default_draft_len(self) -> int | None:
        return self.cap or None  # the chains are at most lookup_max long

    def footprint(self, sizes) -> dict[str, int]:
        # The search: per row, the [H, n] windows, their positions, cuts and DFA states, one
        # [H, n] comparison per chain taken; the point-mass laws [B, K, n, V] (and the ids).
        k, n = sizes.replicas, sizes.depth
        return {
            "draft rollout": sizes.rows * sizes.history * n * (6 * footprint.F32 + 2 * k),
            "laws": 2 * footprint.F32 * sizes.rows * k * n * sizes.vocab,
        }

    def propose(self, dec, params, sampling, state) -> Proposal:
        spec = dec.spec
        n, k = spec.num_draft_tokens, spec.tree.num_chains
        tokens_BKD, draft_lp_BKDV, found_BK = lookup_drafts(
            state.history,
            ngram=self.ngram,
            cap=min(self.cap, n) or n,
            num_chains=k,
            draft_len=n,
            vocab=dec.target_config.vocab_size,
            sampling=sampling,
        )
        batch = tokens_BKD.shape[0]
        return Proposal(
            tokens_BKD=tokens_BKD,
            logprobs_BKDV=draft_lp_BKDV,
            ok_BKD=jnp.ones((batch, k, n), bool),
            usable_BK=found_BK,
        )
