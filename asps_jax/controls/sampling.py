"""The sampling arguments of a call as one typed value, :class:`Sampling`: validated once
(one-line errors naming the argument), documented once, and lowered once into the per-row
:class:`~asps_jax.controls.processors.SamplingParams` of the compiled loop (:meth:`Sampling.lower`),
with the host's view of the rows' constraints (:class:`HostConstraint`).

Every sampling argument may be one value for all prompts or one per prompt (``logit_bias``: one
``{token id: bias}`` dict, or one per prompt; ``regex`` / ``json_schema``: one pattern, or one per
prompt with None for an unconstrained row). docs/api.md gives the controls' order.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from asps_jax.controls import constraints
from asps_jax.controls.processors import CONTROL, CONTROLS, SamplingParams
from asps_jax.logspace import F32_MAX


def _control(name: str, default=None):
    """The field of a numeric control, its declaration (one of
    :data:`asps_jax.controls.processors.CONTROLS`) as its metadata "control"."""
    return dataclasses.field(default=default, metadata=dict(control=CONTROL[name]))


@dataclasses.dataclass(frozen=True, eq=False)
class Sampling:
    """Every sampling argument of ``sample`` / ``Session`` / ``prepare`` (None: off, or the
    model's default), checked when the value is made.

    Attributes:
      temperature: the target's temperature (0: greedy); default 1.
      top_k, top_p: the target law's top-k / nucleus cuts, as transformers applies them.
      draft_temperature: the temperature a draft model samples at (default: ``temperature``);
        the output law does not depend on it.
      min_p: tokens below ``min_p`` times the most likely one's probability are dropped.
      typical_p: locally typical sampling (transformers' ``TypicalLogitsWarper``): the tokens
        whose surprisal is closest to the law's entropy are kept, up to ``typical_p`` of mass.
      repetition_penalty, presence_penalty, frequency_penalty: the penalties on tokens already in
        the row's text (transformers' and OpenAI's definitions).
      no_repeat_ngram_size: n; a token that would repeat an n-gram of the row's text is banned.
      logit_bias: ``{token id: bias}`` added to the logits (-inf bans the token).
      eos_token_id: the id(s) that end a row (None: the target config's; negative: never).
      regex, json_schema: the constraint the generated text must match (``json_schema`` a dict
        or its JSON text).
      min_tokens: the EOS id(s) are banned until a row has generated this many tokens, and stop
        strings are not matched before (vLLM's ``min_tokens``; transformers' ``min_new_tokens``).
      bad_words: words a row never generates: strings (vLLM's ``bad_words``: each tokenized
        alone and after a space, when that gives as many tokens starting with another) or
        token-id lists (transformers' ``bad_words_ids``); each token sequence is banned as
        transformers' ``NoBadWordsLogitsProcessor`` bans it: its last token wherever the text
        (prompt included) ends with its other tokens. One list for every prompt, or one list
        per prompt.
    """

    # A numeric control's field carries its declaration (metadata "control": dtype, neutral value,
    # check, role); the check, the lowering and SamplingParams.make iterate them.
    temperature: Any = _control("temperature", 1.0)
    top_k: Any = _control("top_k")
    top_p: Any = _control("top_p")
    draft_temperature: Any = _control("draft_temperature")
    min_p: Any = _control("min_p")
    repetition_penalty: Any = _control("repetition_penalty")
    presence_penalty: Any = _control("presence_penalty")
    frequency_penalty: Any = _control("frequency_penalty")
    no_repeat_ngram_size: Any = _control("no_repeat_ngram_size")
    logit_bias: Any = None
    eos_token_id: Any = None
    regex: Any = None
    json_schema: Any = None
    min_tokens: Any = _control("min_tokens")
    bad_words: Any = None
    typical_p: Any = _control("typical_p")

    def __post_init__(self):
        for control in self.controls():  # in the declarations' order
            value = getattr(self, control.name)
            if value is None:
                continue
            for v in _numbers(control.name, value):
                if not control.check(v):
                    raise ValueError(f"{control.name} must be {control.expected}, got {value!r}")

    @classmethod
    def controls(cls):
        """The declarations (:class:`~asps_jax.controls.processors.Control`) of the numeric
        fields, in :data:`~asps_jax.controls.processors.CONTROLS`' order."""
        declared = {f.name for f in dataclasses.fields(cls) if "control" in f.metadata}
        return tuple(c for c in CONTROLS if c.name in declared)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The sampling arguments' names, in the order of the attributes."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def lower(self, target, batch: int, padded: int, draft_stop=None):
        """``(SamplingParams, HostConstraint or None)``: the parameters of the ``padded`` rows
        (the first ``batch`` are the prompts; the padding rows take row 0's values), the rows'
        constraints compiled against the target's tokenizer, and ``draft_stop``, the confidence
        stop τ of a draft model's rollout (None: off)."""
        constraint = _constraint_rows(target, self.regex, self.json_schema, batch, padded)
        eos_ids = _eos_ids(target, self.eos_token_id)
        rows = {
            c.name: _per_row(c.name, _bounded(c.name, getattr(self, c.name), target), batch, padded)
            for c in self.controls()
        }
        vocab = target.vocab_size
        bias = _logit_bias_rows(self.logit_bias, batch, padded, vocab)
        _check_min_tokens(self.min_tokens, bias, eos_ids, batch)
        params = SamplingParams.make(
            padded,
            eos_ids=eos_ids,
            logit_bias=bias,
            constraint=constraint,
            draft_stop=draft_stop,
            bad_words=_bad_words_rows(target, self.bad_words, batch, padded, vocab),
            **rows,
        )
        return params, None if constraint is None else HostConstraint(*constraint, eos_ids)


def _bounded(name: str, value, target):
    """A control's value as the target bounds it: ``top_k >= V`` keeps every token (clamped as
    floats, inside int32: an int past int64, e.g. 10**20, overflows np.int64); an n-gram longer
    than the context can never repeat, so such a row bans nothing, as n = 0 does (and the static
    n-gram window never exceeds the context). The others as given."""
    if value is None:
        return None
    if name == "top_k":
        return np.minimum(np.asarray(value, np.float64), target.vocab_size).astype(np.int64)
    if name == "no_repeat_ngram_size":
        ngram = np.asarray(value, np.float64)
        context = target.config.max_position_embeddings
        return np.where(ngram > context, 0, ngram).astype(np.int32)
    return value


def _check_min_tokens(min_tokens, bias, eos_ids: tuple[int, ...], batch: int) -> None:
    """Refuse ``min_tokens`` where ``logit_bias`` bans every token but the EOS id(s), which
    ``min_tokens`` bans too: nothing could be sampled (blamed on ``min_tokens``, the ban that
    makes the row empty, not on the bias)."""
    eos = [e for e in eos_ids if e >= 0]
    if min_tokens is None or bias is None or not eos or np.shape(min_tokens) not in ((), (batch,)):
        return  # (a per-prompt list of another length: _per_row's error)
    need = np.broadcast_to(np.asarray(min_tokens, np.float64), (batch,)) > 0
    others = np.ones(bias.shape[1], bool)
    others[eos] = False
    stuck = np.flatnonzero(need & np.all(bias[:batch, others] == -np.inf, axis=1)).tolist()
    if stuck:
        raise ValueError(
            f"min_tokens bans the EOS id(s) {eos} before a row has min_tokens tokens, and "
            f"logit_bias bans every other token for prompts {stuck[:8]}: nothing could be "
            "sampled; lower min_tokens to 0 for them or leave a token other than EOS unbanned"
        )


def _per_row(name: str, value, batch: int, padded: int):
    """A scalar stays a scalar; one value per prompt is padded with the first row's value."""
    if value is None:
        return None
    arr = np.asarray(value)
    if arr.ndim == 0:
        return arr
    if arr.shape != (batch,):
        raise ValueError(
            f"{name} must be a scalar or have one value per prompt ({batch}), got {arr.shape}"
        )
    return np.concatenate([arr, np.repeat(arr[:1], padded - batch)])


def _constraint_rows(target, regex, json_schema, batch: int, padded: int):
    """The stacked constraint tables of the rows (:func:`asps_jax.controls.constraints.stack`), or
    None when no row is constrained."""

    def per_row(name, value):
        if value is None:
            return [None] * batch
        if isinstance(value, (list, tuple)):
            if len(value) != batch:
                raise ValueError(
                    f"{name}: give one pattern for all prompts or one per prompt ({batch}), got "
                    f"{len(value)}"
                )
            return list(value)
        return [value] * batch

    regexes, schemas = per_row("regex", regex), per_row("json_schema", json_schema)
    if all(r is None for r in regexes) and all(j is None for j in schemas):
        return None
    if any(r is not None and j is not None for r, j in zip(regexes, schemas)):
        raise ValueError("regex and json_schema: give at most one constraint per prompt")
    what = "regex" if any(r is not None for r in regexes) else "json_schema"
    if target.tokenizer is None:
        raise ValueError(
            f"{what}: the target model {target.name!r} has no tokenizer, which a constraint "
            "needs (its token strings)"
        )
    tokens = constraints.token_bytes(target.tokenizer, target.vocab_size)
    compiled: dict = {}
    dfas = []
    for r, j in zip(regexes, schemas):
        if r is None and j is None:
            dfas.append(None)
            continue
        pattern, name = (r, "regex") if r is not None else (None, "json_schema")
        if pattern is None:
            cache_key = ("schema", json.dumps(j, sort_keys=True) if not isinstance(j, str) else j)
            if cache_key not in compiled:
                compiled[cache_key] = constraints.compile_regex(
                    constraints.schema_regex(j), tokens, what="json_schema"
                )
            dfas.append(compiled[cache_key])
        else:
            if ("regex", pattern) not in compiled:
                compiled[("regex", pattern)] = constraints.compile_regex(pattern, tokens, what=name)
            dfas.append(compiled[("regex", pattern)])
    return constraints.stack(dfas + [None] * (padded - batch), target.vocab_size)


def _numbers(name: str, value) -> list[float]:
    """The values of a numeric argument (a scalar, or one per prompt) as Python floats; a
    one-line error for anything that is not a real number: bools and strings included (NumPy
    would turn ``True`` into 1.0 and ``"3"`` into 3.0)."""
    if isinstance(value, (np.ndarray, jax.Array)):
        if np.asarray(value).dtype.kind not in "iuf":
            raise ValueError(f"{name} must be a number (or one per prompt), got {value!r}")
        return np.asarray(value, np.float64).reshape(-1).tolist()
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(_is_real(v) for v in items):
        raise ValueError(f"{name} must be a number (or one per prompt), got {value!r}")
    return [float(v) for v in items]


def _is_real(v) -> bool:
    """A Python or NumPy real number, not a bool (which NumPy would take as 0 / 1)."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(
        v, (bool, np.bool_)
    )


def _in_float32(v: float) -> bool:
    """``v`` stays finite in float32."""
    return math.isfinite(v) and abs(v) <= F32_MAX


def bad_word_ids(tokenizer, word: str) -> list[list[int]]:
    """The token sequences of one bad word, as vLLM makes them: the word (its leading spaces
    stripped) alone, and after a space when that gives as many tokens starting with another
    token (a word-initial token of its own, e.g. GPT-2's ``Ġword``)."""
    plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
    spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
    seqs = [list(plain)]
    if spaced and len(spaced) == len(plain) and spaced[0] != plain[0]:
        seqs.append(list(spaced))
    return seqs


def _is_word(w) -> bool:
    """A bad word: a string or a non-empty list of token ids."""
    return isinstance(w, str) or (isinstance(w, Sequence) and bool(w) and all(_is_id(t) for t in w))


def bad_words_per_prompt(bad_words) -> bool:
    """``bad_words`` is one list per prompt (a list of lists of words), not one list of words."""
    return (
        isinstance(bad_words, Sequence)
        and not isinstance(bad_words, str)
        and bool(bad_words)
        and not any(_is_word(w) for w in bad_words)
    )


_WORDS = "bad_words: each must be a non-empty string or a non-empty list of token ids"


def _is_id(t) -> bool:
    return isinstance(t, int | np.integer) and not isinstance(t, bool)


def _bad_entry(bad_words, batch: int) -> str | None:
    """What is wrong with the first entry of ``bad_words`` (none of them a word) that is not a
    list of words either (an empty list only where the lists cannot be one per prompt), or None.
    """
    for i, entry in enumerate(bad_words):
        if isinstance(entry, str) or not isinstance(entry, Sequence):
            return f"{_WORDS} (or, one per prompt, a list of them); bad_words[{i}] is {entry!r}"
        if not entry and len(bad_words) != batch:
            return f"{_WORDS}; bad_words[{i}] is an empty list (one per prompt: {batch} lists)"
        ids = any(_is_id(t) for t in entry)  # meant as a token-id list: its first non-id
        for j, word in enumerate(entry):
            if not (_is_id(word) if ids else _is_word(word)):
                return f"{_WORDS}; bad_words[{i}][{j}] is {word!r} (a token id is an int)"
    return None


def _bad_words_rows(target, bad_words, batch: int, padded: int, vocab: int):
    """int32[padded, W, L] token sequences of each row's bad words, -1 padded on the left (the
    padding rows take row 0's); None when no row has one. A word is a string (tokenized by
    :func:`bad_word_ids`) or a list of token ids (as it is: transformers' ``bad_words_ids``)."""
    if bad_words is None:
        return None
    if isinstance(bad_words, str) or not isinstance(bad_words, Sequence):
        raise ValueError(
            f"bad_words must be a list of strings or token-id lists (or one list per prompt), "
            f"got {bad_words!r}"
        )
    per_prompt = bad_words_per_prompt(bad_words)
    problem = _bad_entry(bad_words, batch) if per_prompt else None
    if problem:
        raise ValueError(problem)
    rows = list(bad_words) if per_prompt else [bad_words] * batch
    if per_prompt and len(rows) != batch:
        raise ValueError(
            f"bad_words: give one list for all prompts or one per prompt ({batch}), got "
            f"{len(rows)} lists"
        )
    seqs_per_row = []
    for b, words in enumerate(rows):
        if isinstance(words, str) or not isinstance(words, Sequence):
            raise ValueError(f"bad_words: each prompt's must be a list, got {words!r}")
        seqs = []
        for j, word in enumerate(words):
            if not _is_word(word) or (isinstance(word, str) and not word.strip()):
                where = f"bad_words[{b}][{j}]" if per_prompt else f"bad_words[{j}]"
                raise ValueError(f"{_WORDS}; {where} is {word!r}")
            if not isinstance(word, str):
                if not all(0 <= t < vocab for t in word):
                    raise ValueError(
                        f"bad_words: {list(word)!r} has a token id outside the vocabulary "
                        f"[0, {vocab})"
                    )
                seqs.append([int(t) for t in word])
                continue
            tokenizer = getattr(target, "tokenizer", None)
            if tokenizer is None:
                raise ValueError(
                    f"bad_words: the target model {target.name!r} has no tokenizer to tokenize "
                    f"{word!r} with; give token-id lists"
                )
            seqs += [s for s in bad_word_ids(tokenizer, word) if s]
        seqs_per_row.append(seqs)
    if not any(seqs_per_row):
        return None
    width = max(len(s) for seqs in seqs_per_row for s in seqs)
    count = max(len(seqs) for seqs in seqs_per_row)
    out = np.full((padded, count, width), -1, np.int32)
    for b, seqs in enumerate(seqs_per_row + [seqs_per_row[0]] * (padded - batch)):
        for w, seq in enumerate(seqs):
            out[b, w, width - len(seq) :] = seq
    return out


def _logit_bias_rows(logit_bias, batch: int, padded: int, vocab: int):
    """``float32[padded, V]`` from ``{id: bias}`` (every prompt) or a list of them (one per
    prompt); None when no row has a bias."""
    if logit_bias is None:
        return None
    if isinstance(logit_bias, dict):
        per_row = [logit_bias] * batch
    elif isinstance(logit_bias, Sequence) and all(isinstance(d, dict) for d in logit_bias):
        per_row = list(logit_bias)
        if len(per_row) != batch:
            raise ValueError(
                f"logit_bias must be one {{token id: bias}} dict or one per prompt ({batch}), "
                f"got {len(per_row)} dicts"
            )
    else:
        raise ValueError(
            f"logit_bias must be a {{token id: bias}} dict (or one per prompt), got {logit_bias!r}"
        )
    out = np.zeros((padded, vocab), np.float32)
    for b, row in enumerate(per_row):
        for token, bias in row.items():
            if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
                raise ValueError(f"logit_bias: token ids must be integers, got {token!r}")
            if not 0 <= int(token) < vocab:
                raise ValueError(
                    f"logit_bias: token id {token} lies outside the vocabulary [0, {vocab})"
                )
            value = float(bias) if _is_real(bias) else np.nan
            if not (_in_float32(value) or value == -np.inf):
                raise ValueError(
                    f"logit_bias: the bias of token {token} must be a finite number that "
                    f"float32 holds (|bias| at most 3.4e38) or -inf (a ban), got {bias!r}"
                )
            out[b, int(token)] = value
    banned_all = np.flatnonzero(np.all(out[:batch] == -np.inf, axis=1)).tolist()
    if banned_all:
        raise ValueError(
            f"logit_bias bans every token of the vocabulary for prompts {banned_all[:8]}: "
            "nothing could be sampled; leave at least one token unbanned"
        )
    if not np.any(out):
        return None
    return out


def _eos_ids(target, eos_token_id) -> tuple[int, ...]:
    """None -> the target config's EOS id(s); a negative int -> never stop; else those ids."""
    if eos_token_id is None:
        eos_token_id = getattr(target.config, "eos_token_id", None)
    if eos_token_id is None:
        return ()
    values = list(np.atleast_1d(np.asarray(eos_token_id, dtype=object)).reshape(-1))
    if not values or any(
        isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)) for i in values
    ):
        raise ValueError(
            f"eos_token_id must be a token id, a list of them, or a negative int to disable "
            f"stopping; got {eos_token_id!r}"
        )
    ids = tuple(int(i) for i in values)
    if any(i < 0 for i in ids):
        return ()
    if any(i >= target.vocab_size for i in ids):
        raise ValueError(
            f"eos_token_id {list(ids)} lies outside the vocabulary [0, {target.vocab_size}); "
            "pass a negative value to disable stopping"
        )
    return ids


@dataclasses.dataclass(frozen=True, eq=False)
class HostConstraint:
    """The stacked constraint tables of a call, kept on the host to tell which rows' text the
    constraint accepts (:meth:`incomplete_rows`): ``classes int32[V]``, ``next int32[S, C]``,
    ``final bool[S]``, ``start int32[rows]`` (:func:`asps_jax.controls.constraints.stack`) and the
    EOS ids."""

    classes: np.ndarray
    next: np.ndarray
    final: np.ndarray
    start: np.ndarray
    eos_ids: tuple[int, ...]

    def incomplete_rows(self, tokens_BM, lengths_B, rows=None) -> np.ndarray:
        """bool[B]: row b's tokens ``tokens[b, :lengths[b]]`` end where its constraint does not
        accept the text (cut by ``max_new_tokens``, a stop string, an interruption or an
        unusable law). A row that ended with EOS or at a state that allows nothing is complete:
        EOS is allowed in accepting states only, and a dead state is accepting. ``rows``: the
        prompt index of each of the B rows (default: the first B)."""
        tokens = np.asarray(tokens_BM)
        lengths = np.asarray(lengths_B)
        rows = np.arange(lengths.shape[0]) if rows is None else np.asarray(rows)
        state = self.start[rows].astype(np.int64)
        live = np.ones(rows.shape[0], bool)
        eos = np.asarray(self.eos_ids or (-1,))
        for j in range(tokens.shape[1]):
            token = tokens[:, j]
            live &= (j < lengths) & ~np.isin(token, eos)
            moved = self.next[state, self.classes[np.clip(token, 0, self.classes.shape[0] - 1)]]
            state = np.where(live, np.where(moved >= 0, moved, constraints.SINK), state)
        return ~self.final[state]
