"""A NumPy (float64) reference of the sampling controls, written from transformers' semantics and
independent of ``asps_jax``: one law from one row of logits and the text before it.

``text`` is the prompt followed by the generated tokens, ``generated`` how many of its last tokens
were generated (presence / frequency count those only; ``min_tokens`` bans the EOS ids while
fewer were). Order as transformers' ``generate``: logit bias, repetition penalty, presence /
frequency, no-repeat n-grams, the min-tokens and bad-words bans, temperature, top-k, top-p, min-p,
typical-p (the bans are -inf: their place among the logit controls changes nothing).
"""

from __future__ import annotations

import numpy as np


def controlled_logits(
    logits,
    text,
    generated,
    *,
    logit_bias=None,
    repetition_penalty=1.0,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    no_repeat_ngram_size=0,
    min_tokens=0,
    eos_ids=(),
    bad_words=(),
):
    """The logits after bias, penalties, n-gram, min-tokens and bad-words bans (before
    temperature). ``bad_words``: token-id sequences."""
    out = np.array(logits, np.float64)
    text = [int(t) for t in text]
    for token, bias in (logit_bias or {}).items():
        out[token] += bias
    for token in set(text):  # transformers: over every token of the prompt + generated text
        theta = repetition_penalty
        out[token] = out[token] * theta if out[token] < 0 else out[token] / theta
    new = text[len(text) - generated :] if generated else []
    for token in set(new):
        out[token] -= presence_penalty + frequency_penalty * new.count(token)
    n = no_repeat_ngram_size
    if n > 0 and len(text) + 1 >= n:
        key = tuple(text[len(text) - n + 1 :]) if n > 1 else ()
        for start in range(len(text) - n + 1):
            if tuple(text[start : start + n - 1]) == key:
                out[text[start + n - 1]] = -np.inf
    if generated < min_tokens:
        for token in eos_ids:
            out[token] = -np.inf
    for word in bad_words:
        word = [int(t) for t in word]
        if len(word) == 1 or text[len(text) - len(word) + 1 :] == word[:-1]:
            out[word[-1]] = -np.inf
    return out


def warped_probs(logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0):
    """The law after temperature, top-k, top-p, min-p and typical-p (greedy: a point mass on the
    argmax)."""
    logits = np.array(logits, np.float64)
    vocab = logits.size
    if temperature == 0:
        out = np.zeros(vocab)
        out[int(np.argmax(logits))] = 1.0
        return out
    scores = logits / temperature
    if 0 < top_k < vocab:
        kth = np.sort(scores)[::-1][top_k - 1]
        scores = np.where(scores < kth, -np.inf, scores)
    if top_p < 1.0:
        order = np.argsort(scores, kind="stable")  # ascending
        probs = np.exp(scores[order] - scores.max())
        probs /= probs.sum()
        remove = np.cumsum(probs) <= 1.0 - top_p
        remove[-1] = False
        scores = scores.copy()
        scores[order[remove]] = -np.inf
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    if min_p > 0:
        probs = np.where(probs < min_p * probs.max(), 0.0, probs)
        probs /= probs.sum()
    return typical_probs(probs, typical_p) if typical_p < 1.0 else probs


def typical_probs(probs, typical_p):
    """Locally typical sampling (Meister et al. 2022; transformers' ``TypicalLogitsWarper`` with
    ``min_tokens_to_keep`` 1) of the law ``probs``: sort the tokens by the distance of their
    surprisal ``-log p`` from the entropy ``H``, ascending, and keep them up to the first at
    which the sorted mass reaches ``typical_p`` (every token at that distance kept)."""
    probs = np.asarray(probs, np.float64) / np.sum(probs)
    with np.errstate(divide="ignore", invalid="ignore"):
        surprisal = -np.log(probs)
        entropy = np.sum(np.where(probs > 0, probs * surprisal, 0.0))
        distance = np.where(probs > 0, np.abs(surprisal - entropy), np.inf)
    order = np.argsort(distance, kind="stable")
    last = min(int(np.sum(np.cumsum(probs[order]) < typical_p)), probs.size - 1)
    kept = np.where(distance <= distance[order[last]], probs, 0.0)
    return kept / kept.sum()


def law(logits, text, generated, controls=None, warp=None):
    """The processed law of the next token: :func:`controlled_logits` then :func:`warped_probs`."""
    controlled = controlled_logits(logits, text, generated, **(controls or {}))
    return warped_probs(controlled, **(warp or {}))
