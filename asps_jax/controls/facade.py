"""The controls' device façade: the three calls a decoding step makes, in this order.

1. :func:`laws` — every law of a step, processed from its node's own path: the draft laws a
   drafter draws from (``drafters/model.py``), the target laws the score stage hands the verifier
   and the AR step's one law (``decode.py``). In each: the constraint's mask, logit bias,
   penalties, no-repeat n-grams, ``min_tokens`` and bad words, then temperature, top-k, top-p,
   min-p and typical-p (:func:`asps_jax.controls.penalties.process`).
2. :func:`cut` — the end of each row's emitted block, written once for the AR and the
   speculative step: its first EOS (kept), then the first slot drawn at a constraint state that
   allows nothing (dropped), then the token that completes a stop string (kept).
3. :func:`commit` — the emitted tokens into the row history (:class:`~asps_jax.controls.History`:
   counts, seen-mask, text) and each row's constraint state advanced along them, once per step
   whatever ended the block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from asps_jax.controls import automaton, penalties, stopping
from asps_jax.controls.history import History


def laws(sampling, history: History, logits_BXV, path_BXD, depth_X, *, draft=False):
    """Processed log-probabilities ``[B, X, V]`` of X nodes per row from their raw logits, each
    from its path below the root (``path_BXD`` int32[B, X, D], the first ``depth_X`` entries),
    and whether each law is usable, bool[B, X]; ``draft``: the law a draft is drawn from (a
    constraint's dead node gives an empty law, not a point mass)."""
    return penalties.process(sampling, history, logits_BXV, path_BXD, depth_X, draft=draft)


def is_eos(sampling, tokens) -> jax.Array:
    """``tokens[...]`` is one of the rows' EOS ids (``sampling.eos_ids``, -1 entries unused)."""
    eos_ids = sampling.eos_ids
    eos = eos_ids.reshape((1,) * tokens.ndim + eos_ids.shape)
    return jnp.any((tokens[..., None] == eos) & (eos >= 0), axis=-1)


def _first_eos_length(sampling, block_BT, num_B):
    """Truncate each row's ``num`` at its first EOS (kept); returns (num, hit_eos)."""
    width = block_BT.shape[1]
    pos = jnp.arange(width)[None, :]
    eos_BT = is_eos(sampling, block_BT) & (pos < num_B[:, None])
    first = jnp.min(jnp.where(eos_BT, pos, width), axis=1)
    hit = first < width
    return jnp.where(hit, first + 1, num_B), hit


def _first_stop(sampling, generated_B) -> jax.Array | None:
    """int32[B]: the first token of this step's block that may complete a stop string (the
    row's ``min_tokens``-th generated token and after); None without ``min_tokens``."""
    if not sampling.limited:
        return None
    return jnp.maximum(sampling.min_tokens - generated_B - 1, 0).astype(jnp.int32)


def cut(sampling, history: History, stop, block_BT, num_B, generated_B):
    """Where each row's emitted block ``block_BT[:, :num_B]`` ends: at its first EOS (kept),
    before its first slot drawn at a node whose constraint state allows nothing (the row's
    constrained text ended), or after the first token that completes a stop string in the row's
    text (kept; none before the ``min_tokens``-th generated token) — whichever is first.

    ``stop``: the rows' :class:`~asps_jax.controls.StopStrings` (None: none); ``generated_B``:
    int32[B], the tokens each row generated before this block. Returns ``(num_B, ended_B,
    stop)``: the cut lengths, bool[B] where one of the three ended the row, and the stop strings
    with each row's tail moved past its kept tokens."""
    num_B, hit_eos = _first_eos_length(sampling, block_BT, num_B)
    num_B, dead_B = automaton.dead_slots(sampling, history, block_BT, num_B)
    first_B = _first_stop(sampling, generated_B)
    num_B, hit_stop, stop = stopping.advance(stop, block_BT, num_B, first_B)
    return num_B, hit_eos | dead_B | hit_stop, stop


def commit(sampling, history: History, block_BT, num_B) -> History:
    """The history after each row emitted the first ``num_B`` tokens of ``block_BT``: appended to
    its text and counts, and its constraint state advanced along them."""
    history = history.append(block_BT, num_B)
    return automaton.commit(sampling, history, block_BT, num_B)
