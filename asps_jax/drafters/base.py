"""The drafter protocol: what the decode loop asks of whoever proposes the step's draft tree.

A drafter is a frozen, hashable value (static under ``jax.jit``: it is a field of the
:class:`~asps_jax.decode.Decoder`, so two equal drafters share a compiled program). It answers the
host's questions once per call (:meth:`Drafter.check`, :meth:`Drafter.footprint`,
:meth:`Drafter.cache_slots`) and, inside the compiled step, keeps a state of its own (a draft KV
cache, nothing, or scratch slots in the target's cache) through six device methods:

* :meth:`Drafter.init` / :meth:`Drafter.prefill`: its state for a batch, then with the prompts'
  committed tokens;
* :meth:`Drafter.refill`: new prompts in some rows of a running state (continuous batching);
* :meth:`Drafter.propose`: the step's K root paths (tokens, the laws they were drawn from, which
  laws were usable, each path's usable length) as a :class:`Proposal`;
* :meth:`Drafter.commit`: its state after verification accepted a path (the replica that drew it
  and the number of slots committed);
* :meth:`Drafter.take`: with :attr:`Drafter.feature_layers`, its state after taking the accepted
  path's target features (a learned head's input).

The loop owns everything else: the common cuts of a proposal (budget, EOS, unusable laws), the
tree layout by node, the target forward, verification and the emitted block. Exactness needs one
thing of a drafter: ``logprobs`` is the law each token was actually drawn from, and the law at
depth i depends on the path's first i tokens only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from asps_jax.controls import logits_ok

PURPOSE_DRAFT = 0  # the step key's purpose for drafting (decode folds in the others)
PURPOSES = 2  # a speculative step's: drafting, verification (decode's 1; the AR step's is 2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposal:
    """What :meth:`Drafter.propose` returns for one step (B rows, K = L root paths of depth D).

    Attributes:
      tokens_BKD: int32[B, K, D], each root path's draft tokens (replica k of row b).
      logprobs_BKDV: float32[B, K, D, V], the law each token was drawn from (exactly that law:
        verification compares against it).
      ok_BKD: bool[B, K, D], whether each law was usable (finite logits, some mass); a path ends
        before its first unusable law.
      usable_BK: int32[B, K], the drafter's own usable length of each path (D for all of it;
        e.g. a lookup's match length or a confidence stop).
      state: the drafter's state after drawing (passed to :meth:`Drafter.commit`).
      target_cache: the target cache with the drafter's scratch slots written, for a drafter
        that drafts inside the target's cache; None leaves it as it was.
      finite_BKD: bool[B, K, D] or None, :func:`finite_laws` of each law's raw logits (the
        drafter's own, before any control): the loop stops a row with ``NonFiniteLogitsError``
        at the first depth within reach (the step's budget, the path's EOS) whose logits were
        not finite, whatever ``ok_BKD`` and ``usable_BK`` say, so a drafter cannot turn a broken
        model into silently empty drafts. :func:`~asps_jax.drafters.model.rollout_proposal`
        fills it; a drafter computing logits its own way sets it with :func:`finite_laws`
        (None: a drafter with no logits, e.g. a lookup).
    """

    tokens_BKD: jax.Array
    logprobs_BKDV: jax.Array
    ok_BKD: jax.Array
    usable_BK: jax.Array
    state: Any = None
    target_cache: Any = None
    finite_BKD: Any = None


class Drafter:
    """The protocol (and its defaults) of a drafter; see the module docstring.

    Subclass it as a frozen dataclass whose fields are static (configs, sizes, flags). Device
    methods take ``dec``, the :class:`~asps_jax.decode.Decoder` (its ``spec``: the method, the
    tree, sizes; ``target_config``, ``mesh``, ``cache_len``), ``params`` (the drafter's weights,
    ``DecodeInputs.draft_params``: None for a drafter without any), and ``state`` (the drafter's
    own, as :meth:`init` made it).
    """

    #: Whether every root child is drawn from one law (the tree's root law); False for a
    #: drafter whose K paths are different point masses (the root's optimal acceptance, a
    #: diagnostic, is then not measured).
    one_root_law: bool = True
    #: Whether the K root paths are K replicas of a model's rollout (memory messages say so).
    replicated: bool = False
    #: The target layers whose input streams the drafter reads (a learned head's features):
    #: the loop then has the target's forwards return them, passes the prompt's to
    #: :meth:`prefill` / :meth:`refill` (``features=``) and the accepted path's to :meth:`take`.
    feature_layers: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        """How the drafter is named in messages and statistics."""
        return type(self).__name__

    # ---------------------------------------------------------------------------------------
    # Host

    def check(self, target, spec) -> None:
        """Refuse, with a one-line ``ValueError``, a call this drafter cannot draft for
        (``target``: the target :class:`~asps_jax.models.Model`; ``spec``: the
        :class:`~asps_jax.decode.SpecConfig`, method and tree resolved)."""

    def context(self) -> int | None:
        """The most positions the drafter can attend over (a draft model's context), None for no
        bound of its own."""
        return None

    def context_source(self) -> str:
        """Where :meth:`context`'s bound comes from, named in the error of a call past it."""
        return f"the {self.name} drafter's context"

    def default_draft_len(self) -> int | None:
        """The draft length when the call gives no ``num_draft_tokens`` (None: the default 8)."""
        return None

    def cache_slots(self, num_draft_tokens: int, num_chains: int) -> int:
        """Slots per row the drafter needs in the target cache past the committed ones (for
        draft trees of ``num_chains`` root paths of ``num_draft_tokens``)."""
        return 0

    def footprint(self, sizes) -> dict[str, int]:
        """Bytes of the drafter's own buffers for one call: ``{"kv caches", "draft rollout",
        "laws"}`` (any subset) from ``sizes``, a :class:`~asps_jax.footprint.Shape`."""
        return {}

    # ---------------------------------------------------------------------------------------
    # Device (inside the compiled step)

    def init(self, dec, params, batch: int):
        """The drafter's state for ``batch`` rows before any prompt (None: it keeps none)."""
        return None

    def prefill(self, dec, params, state, prompts_BP, committed_B):
        """The state after the prompts' first ``committed_B`` tokens."""
        return state

    def refill(self, dec, params, state, take_B, prompts_BP, committed_B):
        """The rows ``take_B`` (bool[B]) restart from their new prompts; the others unchanged."""
        return state

    def propose(self, dec, params, sampling, state) -> Proposal:
        """The step's K root paths from ``state``, the :class:`~asps_jax.decode.DecodeState`
        (``state.draft`` is the drafter's own; ``state.root`` the last emitted token of each
        row; ``state.history`` the committed text; ``sampling`` the rows' sampling parameters;
        :func:`step_keys` the per-row keys of this step)."""
        raise NotImplementedError(f"{self.name}.propose")

    def commit(self, dec, before, after, winner_B, num_B):
        """The drafter's state after the step: ``before`` its state before drawing, ``after``
        the one :meth:`propose` returned (``Proposal.state``), ``winner_B`` int32[B] the replica
        whose path was accepted, ``num_B`` int32[B] the slots committed (the root and the
        accepted draft tokens)."""
        return after

    def take(self, dec, state, features_BTF, tokens_BT, num_B):
        """With :attr:`feature_layers`: the state after the step's commit took the accepted
        path's target features (``features_BTF[:, j]``: the path's node j, the root first) and
        the emitted tokens (``tokens_BT[:, j]``: the token after node j), ``num_B`` of them."""
        return state


def finite_laws(logits_V: jax.Array) -> jax.Array:
    """bool ``[...]``: the shared check of a draft law's raw logits ``[..., V]`` (the draft
    model's, :func:`asps_jax.controls.processors.logits_ok`): no NaN or ``+inf`` and some finite
    logit. ``Proposal.finite_BKD`` holds it per law."""
    return logits_ok(logits_V)


def unusable_depths(proposal: Proposal, lengths_BK, reach_BK, never: int) -> jax.Array:
    """int32[B, K]: the depth of each path's first law that stops its row (``never`` where none
    does): an unusable law (``ok_BKD``) among the ``lengths_BK`` depths the path uses, or a law
    whose raw logits were not finite (``finite_BKD``) among the ``reach_BK`` depths the step could
    use (the budget, the path's EOS), whatever the drafter's own cut (``usable_BK``)."""
    bad_BK = _first_false(proposal.ok_BKD, never)
    bad_BK = jnp.where(bad_BK < lengths_BK, bad_BK, never)
    if proposal.finite_BKD is None:
        return bad_BK
    broken_BK = _first_false(proposal.finite_BKD, never)
    return jnp.minimum(bad_BK, jnp.where(broken_BK < reach_BK, broken_BK, never))


def _first_false(ok_BKD, never: int) -> jax.Array:
    """int32[B, K]: the index of the first False along the last axis (``never`` if none)."""
    return jnp.where(jnp.all(ok_BKD, axis=-1), never, jnp.argmax(~ok_BKD, axis=-1))


def step_keys(state, purpose: int = PURPOSE_DRAFT) -> jax.Array:
    """Each row's key for this step and ``purpose``: ``fold_in(fold_in(row key, tokens generated
    so far), purpose)``, so a row's draws depend on its key and its text only."""
    keys = getattr(state, "step_keys", None)  # derived once at the step's start (decode)
    if keys is not None and purpose < keys.shape[1]:
        return keys[:, purpose]
    fold = jax.vmap(jax.random.fold_in)
    step = fold(state.row_keys, state.num_generated)
    return fold(step, jnp.full(step.shape, purpose, jnp.uint32))


def all_step_keys(state) -> jax.Array:
    """``[B, PURPOSES]``: :func:`step_keys` of every purpose at once, in one vectorized
    derivation (the same bits as one ``fold_in`` each); the decode step makes them once, at its
    start (``DecodeState.step_keys``), so that its stages share one copy of the derivation."""
    step = jax.vmap(jax.random.fold_in)(state.row_keys, state.num_generated)
    return fold_each(step, jnp.arange(PURPOSES, dtype=jnp.uint32))


def fold_each(keys_R: jax.Array, data_X: jax.Array) -> jax.Array:
    """``[R, X]``: ``fold_in(keys[r], data[x])`` for every pair, as one ``fold_in`` over a flat
    ``R * X`` axis (one copy in the program, smaller on XLA:TPU than a nested ``vmap``)."""
    rows, width = keys_R.shape[0], data_X.shape[0]
    flat = jax.vmap(jax.random.fold_in)(jnp.repeat(keys_R, width), jnp.tile(data_X, rows))
    return flat.reshape(rows, width)


def chain_keys(state, num_chains: int) -> jax.Array:
    """One key per (row, chain), rows major (``b * K + k``): chain k's is ``fold_in(row's draft
    key, k)``."""
    return fold_each(step_keys(state), jnp.arange(num_chains, dtype=jnp.uint32)).reshape(-1)


def load_named(target, spec: str, prefix: str, cache, load, what: str):
    """The checkpoint that ``draft=spec`` (``prefix`` + a folder) names for ``target``: an explicit
    folder, else a bundled alias under ``models/``; loaded by ``load(folder, target)`` once per
    target and folder (``cache``: a weak dictionary keyed by target). ``what`` names it in the
    error for an empty path."""
    from pathlib import Path

    path = spec[len(prefix) :]
    if not path:
        raise ValueError(f"draft={spec!r}: give the {what}'s folder, e.g. '{prefix}path/to/it'")
    folder = Path(path)
    if not folder.exists():
        from asps_jax.models.cards import MODELS_DIR

        if (MODELS_DIR / path).is_dir():
            folder = MODELS_DIR / path
    per_target = cache.setdefault(target, {})
    key = str(folder.resolve()) if folder.exists() else path
    if key not in per_target:
        per_target[key] = load(folder, target)
    return per_target[key]
