"""The constraints on device: the stacked token-class automaton of a batch, read per tree node.

The DFAs of a batch are stacked (:func:`asps_jax.controls.constraints.stack`) into one table over
their joint classes (tokens that every DFA of the batch puts in the same class): ``classes
int32[V]``, ``next int32[S, C]`` (-1 = forbidden) with ``final bool[S]`` (accepting states) and a
start state per row, carried in the rows' ``SamplingParams`` (``dfa_classes``, ``dfa_next``,
``dfa_final``, ``dfa_start``); state 0 is the sink (nothing allowed), state 1 the free state of an
unconstrained row (everything allowed, accepting). Each row carries its committed state
(``History.dfa``; -1 before the first generated token = the row's start state); a tree node's
state is δ* of its path below the root (the same path the penalties read), and the mask — the
tokens with ``next >= 0``, plus the EOS ids in accepting states — is the first processor of every
law: draft, target and bonus (:func:`mask`).

A node whose state allows nothing (a dead state: e.g. an accepting state with no transition when
EOS is disabled) ends the row there: the draft law is empty, so its chain ends before it, and the
slot drawn from its target law is dropped (:func:`dead_slots`). Every verifier is exact for
arbitrary laws per node, so the output law is the law of constrained sampling from the masked,
renormalised target without speculation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

SINK, FREE, FIRST = 0, 1, 2  # global state ids: the sink, the free state, the first pattern state


def root_states(sampling, history) -> jax.Array:
    """int32[B]: each row's committed DFA state (its start state before any generated token)."""
    return jnp.where(history.dfa < 0, sampling.dfa_start, history.dfa)


def advance(sampling, states, tokens) -> jax.Array:
    """δ(state, token) elementwise; a forbidden token leads to the sink."""
    nxt = sampling.dfa_next[states, sampling.dfa_classes[jnp.asarray(tokens, jnp.int32)]]
    return jnp.where(nxt >= 0, nxt, SINK)


def node_states(sampling, history, path_BXD, depth_BX) -> jax.Array:
    """int32[B, X]: δ* of each node's path below the root (the first ``depth`` tokens) from the
    row's committed state."""
    states = jnp.broadcast_to(root_states(sampling, history)[:, None], depth_BX.shape)
    for d in range(path_BXD.shape[2]):
        moved = advance(sampling, states, path_BXD[:, :, d])
        states = jnp.where(d < depth_BX, moved, states)
    return states


def allowed(sampling, states) -> jax.Array:
    """bool[..., V]: the tokens allowed in each state (the EOS ids in accepting states only)."""
    vocab = sampling.dfa_classes.shape[0]
    eos = sampling.eos_ids
    is_eos_V = jnp.zeros(vocab, bool).at[jnp.where(eos >= 0, eos, vocab)].set(True, mode="drop")
    steps = jnp.take(sampling.dfa_next[states] >= 0, sampling.dfa_classes, axis=-1)
    is_eos = is_eos_V.reshape((1,) * (steps.ndim - 1) + (vocab,))
    return (steps & ~is_eos) | (sampling.dfa_final[states][..., None] & is_eos)


def allows(sampling, states, tokens) -> jax.Array:
    """bool, elementwise: ``tokens`` is allowed in ``states`` (:func:`allowed` at one token each,
    without the ``[..., V]`` table)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    eos = sampling.eos_ids.reshape((1,) * tokens.ndim + (-1,))
    is_eos = jnp.any(tokens[..., None] == eos, axis=-1)
    step = sampling.dfa_next[states, sampling.dfa_classes[tokens]] >= 0
    return jnp.where(is_eos, sampling.dfa_final[states], step)


def mask(sampling, history, logits_BXV, path_BXD, depth_BX):
    """The logits with every token outside each node's allowed set at ``-inf``, and whether each
    node's state allows nothing (bool[B, X]); ``(logits, None)`` when no row is constrained."""
    if not sampling.constrained:
        return logits_BXV, None
    ok_BXV = allowed(sampling, node_states(sampling, history, path_BXD, depth_BX))
    return jnp.where(ok_BXV, logits_BXV, -jnp.inf), ~jnp.any(ok_BXV, axis=-1)


def dead_slots(sampling, history, block_BT, num_B):
    """Cut each emitted block before its first slot drawn at a dead node (a state that allows
    nothing: the constrained text ended after the previous token); returns ``(num, ended)``."""
    if not sampling.constrained:
        return num_B, jnp.zeros(num_B.shape, bool)
    width = block_BT.shape[1]
    states, dead = root_states(sampling, history), []
    for j in range(width):
        dead.append(~jnp.any(allowed(sampling, states), axis=-1))
        states = advance(sampling, states, jnp.maximum(block_BT[:, j], 0))
    dead_BT = jnp.stack(dead, axis=1) & (jnp.arange(width)[None, :] < num_B[:, None])
    first = jnp.where(jnp.any(dead_BT, axis=1), jnp.argmax(dead_BT, axis=1), width)
    ended = first < width
    return jnp.where(ended, first, num_B), ended


def commit(sampling, history, block_BT, num_B):
    """The history with each row's DFA state advanced along its first ``num`` block tokens."""
    if not sampling.constrained:
        return history
    states = root_states(sampling, history)
    for j in range(block_BT.shape[1]):
        moved = advance(sampling, states, jnp.maximum(block_BT[:, j], 0))
        # EOS (not a DFA transition) ends the row; its state stays.
        states = jnp.where((j < num_B) & (moved != SINK), moved, states)
    return dataclasses.replace(history, dfa=jnp.where(num_B > 0, states, history.dfa))


def allows_along(sampling, states_H, windows_HD) -> jax.Array:
    """bool[H, D]: whether each window's token at depth d is allowed after its first d tokens,
    walking each window through the DFA from ``states_H`` (a forbidden token leads to the sink,
    which allows nothing after it)."""
    ok = []
    for d in range(windows_HD.shape[1]):
        ok.append(allows(sampling, states_H, windows_HD[:, d]))
        states_H = advance(sampling, states_H, windows_HD[:, d])
    return jnp.stack(ok, axis=1)
