"""Path-dependent logits controls: logit bias, repetition / presence / frequency penalties and
no-repeat n-grams, applied to the law at every node of a token tree from that node's own path.

A node's path is the row's committed text (prompt + generated tokens, the last of which is the
root) followed by the node's draft tokens below the root. Every law the decoding loop uses is
processed from its node's path: the draft law a node's children are drawn from, the target law at
the node, and the bonus law at a leaf; so each verifier, exact for arbitrary laws per node, keeps
exactness for the processed target process (docs/api.md §3, the sampling controls).

The order is transformers' ``generate`` order: logit bias, repetition penalty, presence /
frequency penalties, no-repeat n-grams; temperature, top-k, top-p, min-p and typical-p follow in
:func:`asps_jax.controls.processors.process_logits`.

* repetition penalty θ (transformers' ``RepetitionPenaltyLogitsProcessor``): a logit of a token
  of the prompt + generated text becomes ``l / θ`` if ``l > 0`` else ``l · θ``;
* presence a / frequency b (OpenAI): ``l -= a · [c > 0] + b · c``, c = the token's count among the
  generated tokens only (not the prompt);
* no-repeat n-grams (transformers' ``NoRepeatNGramLogitsProcessor``): ``-inf`` for every token
  that would complete an n-gram already in the prompt + generated text.

Per-row state (:class:`~asps_jax.controls.history.History`): the counts ``[B, V]`` of the
generated tokens, the seen-mask ``[B, V]`` of the prompt + generated tokens, and the text itself
``[B, H]`` for n-grams. At a node,
the counts are the row's plus the node's path tokens: the elementwise penalty runs once over the
``[.., V]`` logits with the row's counts, then the (at most D) path tokens are re-penalised with
their path counts (a scatter of D entries, not a ``[V]`` one-hot per depth).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from asps_jax.controls import automaton
from asps_jax.controls.history import History
from asps_jax.logspace import F32_MAX, NEG_INF


def _penalize(logits, counts, seen, rep, presence, frequency):
    """Repetition, presence and frequency penalties, elementwise (broadcasting).

    Large values stay defined in float32: a logit pushed past the largest float32 (a bias or a
    penalty near 3.4e38, a reward times a count) is clamped there instead of becoming ``+inf``
    (which would leave no law), one pushed below it becomes ``-inf`` (banned), and a banned
    (``-inf``) logit stays banned whatever the penalties add."""
    repeated = jnp.where(logits < 0, logits * rep, logits / rep)
    out = jnp.where(seen, repeated, logits)
    out = out - presence * (counts > 0) - frequency * counts.astype(logits.dtype)
    return jnp.where(logits == NEG_INF, NEG_INF, jnp.minimum(out, F32_MAX))


def _ngram_banned(tokens_H, length, path_XD, depth_X, n, window: int, vocab: int):
    """bool[X, V]: the tokens that would complete an n-gram already in each node's text (the
    row's ``tokens_H[:length]`` followed by ``path_XD[x, :depth_X[x]]``); ``window`` >= n is
    the static bound the comparison loop runs to, n <= 0 bans nothing."""
    if path_XD.shape[1] == 0:  # no draft tokens (the AR step): one unused column
        path_XD = jnp.zeros((path_XD.shape[0], 1), jnp.int32)
    width = tokens_H.shape[0] + path_XD.shape[1]
    pos = jnp.arange(width)
    len_X = length + depth_X

    def node_text(path, depth):
        offset = pos - length
        from_path = jnp.take(path, jnp.clip(offset, 0, path.shape[0] - 1))
        hist = jnp.concatenate([tokens_H, jnp.full(path.shape, -1, jnp.int32)])
        return jnp.where(offset < 0, hist, jnp.where(offset < depth, from_path, -1))

    seq_XL = jax.vmap(node_text)(path_XD, depth_X)
    padded_XL = jnp.pad(seq_XL, ((0, 0), (window, 0)), constant_values=-2)
    # f: the position of the token an n-gram would end with; its n - 1 predecessors must equal
    # the node's last n - 1 tokens.
    match_XL = (pos[None, :] >= n - 1) & (pos[None, :] < len_X[:, None]) & (n >= 1)
    for i in range(window):
        before_XL = padded_XL[:, window - 1 - i : window - 1 - i + width]  # seq[f - 1 - i]
        suffix_X = jnp.take_along_axis(seq_XL, jnp.maximum(len_X - 1 - i, 0)[:, None], 1)
        match_XL = match_XL & ((i >= n - 1) | (before_XL == suffix_X))
    rows = jnp.arange(seq_XL.shape[0])[:, None]
    banned = jnp.zeros((seq_XL.shape[0], vocab), bool)
    return banned.at[rows, jnp.where(match_XL, seq_XL, vocab)].set(True, mode="drop")


def apply_controls(sampling, history: History, logits_BXV, path_BXD, depth_X) -> jax.Array:
    """The logits ``[B, X, V]`` of X nodes per row after bias, penalties and n-gram bans.

    ``path_BXD``: int32[B, X, D], each node's draft tokens below the root (entries from
    ``depth_X[x]`` on are ignored); ``depth_X``: int32[X] or int32[B, X].
    """
    logits_BXV = jnp.asarray(logits_BXV, jnp.float32)
    batch, nodes, vocab = logits_BXV.shape
    depth_BX = jnp.broadcast_to(jnp.asarray(depth_X, jnp.int32), (batch, nodes))
    path_BXD = jnp.asarray(path_BXD, jnp.int32)
    depth_cap = path_BXD.shape[2]

    def penalties(logits_BXV):
        def row(logits, bias, rep, presence, frequency, counts, seen, path, depth):
            logits = jnp.minimum(logits + bias, F32_MAX)
            out = _penalize(logits, counts[None], seen[None], rep, presence, frequency)
            if depth_cap == 0:
                return out
            on_XD = jnp.arange(depth_cap)[None, :] < depth[:, None]
            tok_XD = jnp.where(on_XD, path, 0)
            same_XDD = (tok_XD[:, :, None] == tok_XD[:, None, :]) & on_XD[:, None, :]
            count_XD = counts[tok_XD] + jnp.sum(same_XDD, axis=-1)
            at_path_XD = jnp.take_along_axis(logits, tok_XD, axis=1)
            redo_XD = _penalize(at_path_XD, count_XD, True, rep, presence, frequency)
            at_XD = jnp.where(on_XD, tok_XD, vocab)
            return out.at[jnp.arange(nodes)[:, None], at_XD].set(redo_XD, mode="drop")

        return jax.vmap(row)(
            logits_BXV,
            sampling.logit_bias[:, None, :],
            sampling.repetition_penalty,
            sampling.presence_penalty,
            sampling.frequency_penalty,
            history.counts,
            history.seen,
            path_BXD,
            depth_BX,
        )

    any_penalty = (
        jnp.any(sampling.repetition_penalty != 1.0)
        | jnp.any(sampling.presence_penalty != 0.0)
        | jnp.any(sampling.frequency_penalty != 0.0)
        | jnp.any(sampling.logit_bias != 0.0)
    )
    # Batch-level predicates: real branches, so a run without controls does none of this work;
    # a call that gives none of them does not compile it (static).
    if sampling.penalized:
        logits_BXV = jax.lax.cond(any_penalty, penalties, lambda x: x, logits_BXV)
    window = sampling.ngram_window
    if window == 0:
        return logits_BXV

    def ngrams(logits_BXV):
        banned_BXV = jax.vmap(
            lambda tokens, length, path, depth, n: _ngram_banned(
                tokens, length, path, depth, n, window, vocab
            )
        )(history.tokens, history.length, path_BXD, depth_BX, sampling.no_repeat_ngram_size)
        return jnp.where(banned_BXV, NEG_INF, logits_BXV)

    any_ngram = jnp.any(sampling.no_repeat_ngram_size > 0)
    return jax.lax.cond(any_ngram, ngrams, lambda x: x, logits_BXV)


def apply_limits(sampling, history: History, logits_BXV, path_BXD, depth_X) -> jax.Array:
    """The logits ``[B, X, V]`` with ``min_tokens``' EOS ban (a node at depth d of a row that
    generated g tokens draws token g + d + 1) and the ``bad_words`` bans, each from the node's
    own text (the row's text followed by its path); nothing when the call gives neither."""
    batch, nodes, vocab = logits_BXV.shape
    depth_BX = jnp.broadcast_to(jnp.asarray(depth_X, jnp.int32), (batch, nodes))
    if sampling.limited:
        generated_B = jnp.sum(history.counts, axis=1)
        early_BX = generated_B[:, None] + depth_BX < sampling.min_tokens[:, None]
        eos_V = jnp.any(jnp.arange(vocab)[:, None] == sampling.eos_ids[None, :], axis=1)
        logits_BXV = jnp.where(early_BX[..., None] & eos_V[None, None, :], NEG_INF, logits_BXV)
    if sampling.bad_words.shape[1] == 0:
        return logits_BXV
    banned_BXV = jax.vmap(
        lambda tokens, length, path, depth, words: _bad_words_banned(
            tokens, length, path, depth, words, vocab
        )
    )(history.tokens, history.length, jnp.asarray(path_BXD, jnp.int32), depth_BX,
      sampling.bad_words)  # fmt: skip
    return jnp.where(banned_BXV, NEG_INF, logits_BXV)


def _bad_words_banned(tokens_H, length, path_XD, depth_X, words_WL, vocab: int):
    """bool[X, V]: each word's last token where the node's text (``tokens_H[:length]`` then
    ``path_XD[x, :depth_X[x]]``) ends with the word's other tokens; ``words_WL`` -1 padded on
    the left (a word of one token is banned everywhere)."""
    if path_XD.shape[1] == 0:  # no draft tokens (the AR step): one unused column
        path_XD = jnp.zeros((path_XD.shape[0], 1), jnp.int32)
    D, L = path_XD.shape[1], words_WL.shape[1]

    def node(path, depth):
        # The node's last L - 1 tokens, oldest first (-2 before the text's start).
        back = jnp.arange(L - 1, 0, -1)  # how far back from the end: L - 1 .. 1
        at = length + depth - back  # positions in the node's text
        from_path = jnp.take(path, jnp.clip(at - length, 0, D - 1))
        from_hist = jnp.take(tokens_H, jnp.clip(at, 0, tokens_H.shape[0] - 1))
        last = jnp.where(at >= length, from_path, jnp.where(at >= 0, from_hist, -2))
        prefix_W = words_WL[:, :-1]
        match_W = jnp.all((prefix_W == last[None, :]) | (prefix_W < 0), axis=1)
        target_W = jnp.where(match_W & (words_WL[:, -1] >= 0), words_WL[:, -1], vocab)
        return jnp.zeros((vocab,), bool).at[target_W].set(True, mode="drop")

    return jax.vmap(node)(path_XD, depth_X)


def process(sampling, history: History, logits_BXV, path_BXD, depth_X, *, draft=False):
    """Processed log-probabilities ``[B, X, V]`` of X nodes per row (the constraint's mask, the
    controls, then ``sampling.process``: temperature, top-k, top-p, min-p, typical-p), and whether
    each law is usable, bool[B, X] (bans can remove every token).

    A node whose constraint state allows nothing (:mod:`asps_jax.controls.automaton`: the text
    ends there) is usable: its draft law is empty (no child is drawn from it) and its target law a
    point mass on token 0, whose slot ``automaton.dead_slots`` drops.
    """
    depth_BX = jnp.broadcast_to(jnp.asarray(depth_X, jnp.int32), logits_BXV.shape[:2])
    logits, dead_BX = automaton.mask(
        sampling, history, logits_BXV, jnp.asarray(path_BXD, jnp.int32), depth_BX
    )
    logits = apply_controls(sampling, history, logits, path_BXD, depth_X)
    logits = apply_limits(sampling, history, logits, path_BXD, depth_X)
    logprobs = sampling.process(logits, draft=draft)
    mass = jnp.any(logprobs > NEG_INF, axis=-1)
    if dead_BX is None:
        return logprobs, mass
    if not draft:
        point = jnp.where(jnp.arange(logprobs.shape[-1]) == 0, 0.0, NEG_INF)[None, None, :]
        logprobs = jnp.where(dead_BX[..., None], point, logprobs)
    return logprobs, mass | dead_BX
