"""``asps_jax.sample`` and ``asps_jax.stream``: the host-side entry points (docs/api.md §3).

They validate everything that can be validated before compiling (methods, sampling parameters,
prompts, context length, vocabularies), pad ragged prompts to a bucketed width so that calls with
different prompt contents and lengths rarely recompile, derive one key per row, and run the jitted
loop of :mod:`asps_jax.decode`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import operator
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax import (
    autotune,
    compile_cache,
    constraints,
    decode,
    footprint,
    selfdraft,
    sharding,
    slots,
    statistics,
    stopping,
)
from asps_jax.logspace import F32_MAX
from asps_jax.models import check_compatible
from asps_jax.models.base import run_params
from asps_jax.models.vocab import align_vocabularies
from asps_jax.processors import SamplingParams
from asps_jax.verify.api import TREE_METHODS
from asps_jax.verify.registry import REGISTRY

# The methods of the registry (verify/registry.py) that the decode loop runs: it draws the K
# drafts independently (with replacement), so the verifier that needs root drafts drawn without
# replacement is available through verify_drafts only. The CLI and the benchmarks take theirs
# from here.
METHODS: tuple[str, ...] = ("ar",) + tuple(m.name for m in REGISTRY.values() if m.in_sample)
# Prompt width, cache length and batch padding (footprint.py's size estimate pads the same way).
_PROMPT_BUCKET, _CACHE_BUCKET, _BATCH_BUCKET = footprint.BUCKETS


class NonFiniteLogitsError(FloatingPointError):
    """A model produced an unusable law (a NaN or ``+inf`` logit, or none finite).

    Each such row stopped at the token the law was to give. ``.rows`` lists them and
    ``.positions`` the index among the row's new tokens where each stopped; ``.output`` is the
    :class:`SampleOutput` with exactly the tokens generated before (a failed row's length is its
    position, -1 after), so nothing is lost; the other rows ran to their normal end.
    """

    def __init__(self, message: str, output: SampleOutput, rows: Sequence[int] = (), positions=()):
        super().__init__(message)
        self.output = output
        self.rows = list(rows)
        self.positions = list(positions)


@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """What :func:`sample` returns (``M`` = ``max_new_tokens``).

    Attributes:
      tokens: int32[B, M]; row b's new tokens are ``tokens[b, :lengths[b]]``, -1 after.
      lengths: int32[B].
      stats: on-device arrays, see :func:`asps_jax.statistics.summarize`.
      logprobs: float32[B, M] with ``return_logprobs=True`` (else None): the target's
        log-probability of each emitted token under the processed law it was sampled with
        (temperature, top-k, top-p; 0.0 at temperature 0, the greedy law). Finite for every
        emitted token; 0.0 after ``lengths[b]``, so ``logprobs.sum(-1)`` is each row's
        log-likelihood.
      top_logprobs: with ``top_logprobs=k > 0`` (and ``return_logprobs=True``), the pair
        ``(ids int32[B, M, k], logprobs float32[B, M, k])``: the k most likely tokens of the
        processed target law each emitted token was sampled from, most likely first (ids -1 and
        logprobs 0.0 after ``lengths[b]``); else None.
      incomplete: with a ``regex`` / ``json_schema``, bool[B] (NumPy): the row's text is not
        accepted by its constraint in full, because ``max_new_tokens``, a stop string, an
        interruption or an unusable law cut it first (a JSON document left unfinished); False
        for rows without a constraint; None when no row has one.
    """

    tokens: jax.Array
    lengths: jax.Array
    stats: dict
    logprobs: jax.Array | None = None
    top_logprobs: tuple[jax.Array, jax.Array] | None = None
    incomplete: np.ndarray | None = None


def _round_up(x: int, multiple: int) -> int:
    return int(math.ceil(max(x, 1) / multiple) * multiple)


def _as_prompt_array(prompts, prompt_lengths, vocab_size: int):
    if prompt_lengths is not None:
        arr = np.asarray(prompts)
        lengths = np.asarray(prompt_lengths, np.int64)
        if arr.ndim != 2 or lengths.shape != (arr.shape[0],):
            raise ValueError(
                "prompts: with prompt_lengths, prompts must be int32[B, P] and prompt_lengths "
                f"int32[B]; got shapes {arr.shape} and {lengths.shape}"
            )
        if np.any(lengths < 0) or np.any(lengths > arr.shape[1]):
            raise ValueError(
                f"prompt_lengths must lie in [0, {arr.shape[1]}] (the prompt array width), got "
                f"{lengths.tolist()[:8]}"
            )
        rows = [arr[b, : lengths[b]].tolist() for b in range(arr.shape[0])]
    else:
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and any(isinstance(p, str) for p in prompts)
        ):
            raise ValueError(
                "prompts must be token ids, not text: encode it first, e.g. "
                "[model.tokenizer.encode(text)]"
            )
        if isinstance(prompts, (np.ndarray, jax.Array)) and np.ndim(prompts) == 2:
            rows = np.asarray(prompts).tolist()
        elif isinstance(prompts, Sequence) and all(
            isinstance(p, Sequence | np.ndarray) for p in prompts
        ):
            rows = [list(np.asarray(p).reshape(-1).tolist()) for p in prompts]
        else:
            raise ValueError("prompts must be a list of token-id lists or an int32[B, P] array")
    if not rows:
        raise ValueError("prompts: at least one prompt is required")
    for b, row in enumerate(rows):
        if len(row) == 0:
            raise ValueError(f"prompts[{b}] is empty: every prompt needs at least one token")
        if any(isinstance(t, float) and t != int(t) for t in row):
            raise ValueError(f"prompts[{b}] holds non-integer token ids")
        bad = [t for t in row if not (0 <= int(t) < vocab_size)]
        if bad:
            raise ValueError(f"prompts[{b}] holds token ids outside [0, {vocab_size}): {bad[:5]}")
    # Rows of length 0 pad the batch to a bucket (they start done): fewer shapes, fewer compiles.
    padded_rows = _round_up(len(rows), _BATCH_BUCKET) if len(rows) > 1 else 1
    lengths = np.zeros(padded_rows, np.int32)
    lengths[: len(rows)] = [len(r) for r in rows]
    width = _round_up(int(lengths.max()), _PROMPT_BUCKET)
    out = np.zeros((padded_rows, width), np.int32)
    for b, row in enumerate(rows):
        out[b, : len(row)] = row
    return out, lengths, len(rows)


def budget_bucket(max_new_tokens: int) -> int:
    """The static output width for budgets up to ``max_new_tokens``: the next power of two
    (at least 16) up to 512, then the next multiple of 512. Budgets inside one bucket share the
    compiled program (``max_new_tokens`` itself is a traced per-row value); a power of two at
    most doubles the small buffers and cache slots of short runs, and past 512 the waste is
    bounded by 512 slots."""
    m = max(int(max_new_tokens), 16)
    if m <= 512:
        return 1 << (m - 1).bit_length()
    return _round_up(m, 512)


def _budgets(max_new_tokens, batch: int) -> list[int]:
    """One budget per prompt from an int or a list of them; one-line errors."""
    if isinstance(max_new_tokens, (list, tuple, np.ndarray)):
        values = list(np.asarray(max_new_tokens).reshape(-1).tolist())
        if len(values) != batch:
            raise ValueError(
                f"max_new_tokens: give one budget for all prompts or one per prompt ({batch}), "
                f"got {len(values)}"
            )
        for v in values:
            _check_int("max_new_tokens", v, 1)
        return [int(v) for v in values]
    return [_check_int("max_new_tokens", max_new_tokens, 1)] * batch


def _row_keys(key, batch: int, padded: int) -> jax.Array:
    """One key per row: ``fold_in(key, row)`` for a single key, or the given per-row keys."""
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))
    if key.shape == ():
        return jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(padded))
    if key.shape == (batch,):
        return jnp.concatenate([key, jnp.repeat(key[:1], padded - batch)])
    raise ValueError(
        f"key must be a single PRNG key or one key per prompt ([{batch}]), got {key.shape}"
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
    """The stacked constraint tables of the rows (:func:`asps_jax.constraints.stack`), or None
    when no row is constrained."""

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


def _integral(v: float) -> bool:
    return math.isfinite(v) and v == int(v)


# Every numeric sampling argument: (name, valid(value), what is expected). Each is checked in
# float32, what the device uses: 1e39 is finite here and inf there.
_NUMERIC_CHECKS = (
    ("temperature", lambda v: 0.0 <= v <= F32_MAX, "a finite number >= 0 (at most 3.4e38)"),
    ("draft_temperature", lambda v: 0.0 <= v <= F32_MAX,
     "a finite number >= 0 (at most 3.4e38)"),
    ("top_k", lambda v: _integral(v) and v >= 0, "an integer >= 0 (0 or None disables it)"),
    ("top_p", lambda v: 0.0 < v <= 1.0 and np.float32(v) > 0, "in (0, 1]"),
    ("min_p", lambda v: 0.0 <= v <= 1.0, "in [0, 1] (0 disables it)"),
    ("repetition_penalty", lambda v: 0.0 < v <= F32_MAX and np.float32(v) > 0,
     "a finite number > 0 that float32 holds (1 disables it; at most 3.4e38)"),
    ("presence_penalty", _in_float32,
     "a finite number that float32 holds (0 disables it; |value| at most 3.4e38)"),
    ("frequency_penalty", _in_float32,
     "a finite number that float32 holds (0 disables it; |value| at most 3.4e38)"),
    ("no_repeat_ngram_size", lambda v: _integral(v) and v >= 0,
     "an integer >= 0 (0 disables it)"),
)  # fmt: skip


def _validate_numbers(**values) -> None:
    """One-line errors for the numeric sampling arguments' values (scalars or one per prompt),
    each named; None is the default."""
    for name, ok, expected in _NUMERIC_CHECKS:
        value = values.pop(name)
        if value is None:
            continue
        for v in _numbers(name, value):
            if not ok(v):
                raise ValueError(f"{name} must be {expected}, got {value!r}")
    assert not values, values


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


def _check_top_logprobs(top_logprobs, return_logprobs, vocab: int) -> int:
    k = _check_int("top_logprobs", 0 if top_logprobs is None else top_logprobs, 0)
    if k > vocab:
        raise ValueError(f"top_logprobs must be at most the vocabulary size {vocab}, got {k}")
    if k and not return_logprobs:
        raise ValueError("top_logprobs needs return_logprobs=True (the log-probs come with them)")
    return k


def _check_int(name: str, value, minimum: int) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, np.integer, np.floating))
        or int(value) != value
        or int(value) < minimum
    ):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


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


def _check_tree(tree, method, num_drafts, num_draft_tokens) -> tuple[int, ...]:
    """The widths of a branching draft tree (``()`` for none), checked against the method and
    against ``num_drafts`` / ``num_draft_tokens`` when those are given too."""
    if tree is None:
        return ()
    try:
        widths = tuple(operator.index(w) for w in tree)
        if any(isinstance(w, (bool, np.bool_)) for w in tree):
            widths = None
    except TypeError:
        widths = None
    if not widths or any(w < 1 for w in widths):
        raise ValueError(
            f"tree: a branching draft tree is its children per node at each depth, e.g. "
            f"(4, 2, 1, 1), every width >= 1; got {tree!r}"
        )
    if method not in TREE_METHODS:
        raise ValueError(
            f"tree: a branching draft tree is verified by the tree methods "
            f"({', '.join(TREE_METHODS)}); method {method!r} verifies chains"
        )
    implied = {"num_drafts": math.prod(widths), "num_draft_tokens": len(widths)}
    for name, value in (("num_drafts", num_drafts), ("num_draft_tokens", num_draft_tokens)):
        if value is not None and value != implied[name]:
            raise ValueError(
                f"tree={widths} has {implied['num_drafts']} leaves at depth "
                f"{implied['num_draft_tokens']}; {name}={value} contradicts it (omit it)"
            )
    return widths


DRAFTERS = ("lookup", selfdraft.PREFIX + "L")
"""The drafters named by a string ``draft`` argument (a model object is the draft model)."""


def named_draft(draft) -> bool:
    """Whether ``draft`` names a drafter (``"lookup"``, ``"self:L"``) rather than a model or a
    checkpoint (what the command line loads); :func:`parse_draft` reads the name."""
    return isinstance(draft, str) and (draft == "lookup" or draft.startswith(selfdraft.PREFIX))


def parse_draft(target, draft):
    """The one place that reads the ``draft`` argument: ``(drafter, model)``.

    A :class:`~asps_jax.models.Model` (or None, for ``method="ar"``) is ``("model", draft)``;
    ``"lookup"`` is prompt-lookup drafting (``("lookup", None)``, :mod:`asps_jax.lookup`);
    ``"self:L"`` is the draft model built from the target's first L layers, final norm and head
    (``("model", SelfDraft)``, :mod:`asps_jax.selfdraft`; one object per target and L).
    """
    if not isinstance(draft, str):
        return "model", draft
    if draft == "lookup":
        return "lookup", None
    if draft.startswith(selfdraft.PREFIX):
        return "model", selfdraft.self_draft(target, draft)
    raise ValueError(
        f"draft: unknown drafter {draft!r}; give a draft model, 'lookup', 'self:L' (the "
        "target's first L layers), or None (method 'ar')"
    )


def _check_drafter(drafter, method, widths, context, lookup_ngram, lookup_max, draft_stop):
    """The drafter's own options: ``(lookup_ngram, lookup_max, draft_stop τ or None)``;
    ``context``: the target's positions (a longer lookup n-gram can never match)."""
    given = {
        name: value
        for name, value in (
            ("lookup_ngram", lookup_ngram),
            ("lookup_max", lookup_max),
            ("draft_stop", draft_stop),
        )
        if value is not None
    }
    if method == "ar" and given:
        name = next(iter(given))
        raise ValueError(f"{name}: method 'ar' uses no draft, so no drafter option; drop {name}")
    if drafter != "lookup":
        for name in ("lookup_ngram", "lookup_max"):
            if name in given:
                raise ValueError(f"{name} is an option of draft='lookup', not of a draft model")
    tau = None
    if draft_stop is not None:
        tau = _parse_draft_stop(draft_stop)
        if drafter == "lookup":
            raise ValueError(
                "draft_stop: a lookup draft has no draft law to be unsure of (its chains end "
                "where the match ends); drop draft_stop"
            )
        if widths:
            raise ValueError("draft_stop: confidence-stopped chains need K chains, not tree=")
    ngram = _check_int("lookup_ngram", 3 if lookup_ngram is None else lookup_ngram, 1)
    if ngram > context:
        raise ValueError(
            f"lookup_ngram={ngram} is longer than the model context of {context} positions: "
            "no suffix that long can ever match; use a few tokens (default 3)"
        )
    cap = 0 if lookup_max is None else _check_int("lookup_max", lookup_max, 1)
    if drafter == "lookup" and method in TREE_METHODS:
        raise ValueError(
            f"draft='lookup': method {method!r} verifies a tree of draws from one law per node; "
            "lookup chains are point masses per chain: use a chain method (sps, asps) or a "
            "multi-draft one (specinfer, spectr, is, optimal)"
        )
    return ngram, cap, tau


def _parse_draft_stop(draft_stop) -> float:
    """``"confidence:τ"`` (or the number τ) -> τ in [0, 1]."""
    text = draft_stop
    if isinstance(draft_stop, str):
        kind, _, text = draft_stop.partition(":")
        if kind != "confidence" or not text:
            raise ValueError(
                f"draft_stop must be 'confidence:τ' with τ in [0, 1], got {draft_stop!r}"
            )
    try:
        tau = float(text)
    except (TypeError, ValueError):
        tau = np.nan
    if isinstance(draft_stop, bool) or not 0.0 <= tau <= 1.0:
        raise ValueError(f"draft_stop must be 'confidence:τ' with τ in [0, 1], got {draft_stop!r}")
    return tau


def _check_method(method, draft, target, num_drafts, num_draft_tokens, options) -> None:
    if method not in METHODS:
        raise ValueError(f"method: unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "ar":
        if options:
            raise ValueError(f"method 'ar' takes no options, got {sorted(options)}")
        if num_drafts != 1:
            raise ValueError(f"method 'ar' uses no draft; num_drafts must be 1, got {num_drafts}")
        return
    if draft is None:
        raise ValueError(
            f"method {method!r} needs a draft model or draft='lookup' (draft=None is only for 'ar')"
        )
    if draft != "lookup":
        check_compatible(target, draft)
    entry = REGISTRY[method]  # resolved once; the options' one validator is the entry's
    if entry.kind == "chain" and num_drafts != 1:
        multi = ", ".join(m for m in METHODS if m in REGISTRY and REGISTRY[m].kind == "drafts")
        raise ValueError(
            f"method {method!r} verifies a single draft chain; use num_drafts=1 or a "
            f"multi-draft method ({multi})"
        )
    entry.validate(options)


def _check_tree_options(method, num_drafts, num_draft_tokens, options, widths) -> None:
    """The options against the tree the decode loop draws (K chains, or branching), for options
    that depend on its shape (``alive="count"``). Builds that tree: called after
    :func:`check_memory` has refused trees too big to build."""
    if method in REGISTRY:
        entry = REGISTRY[method]
        tree = entry.draft_tree(num_drafts, num_draft_tokens, widths).nodes
        entry.validate(options, tree=tree)


def _device_memory_bytes(mesh) -> int:
    """Memory the call may use: the devices' reported limit, else the host's physical memory."""
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    # The first of this process's devices: another process's device reports nothing here.
    local = next(
        (d for d in devices if d.process_index == jax.process_index()), jax.local_devices()[0]
    )
    stats = local.memory_stats() if hasattr(local, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]) * len(devices)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: never refuse


def check_memory(
    target,
    draft,
    *,
    batch,
    prompt_len,
    max_new_tokens,
    num_draft_tokens,
    num_drafts,
    mesh=None,
    method="asps",
    widths=(),
    options=None,
    num_prompts=None,
    drafter="model",
) -> dict[str, int]:
    """Refuse, before anything is built or allocated, a call that cannot fit the device(s): the
    estimate of :func:`asps_jax.footprint.estimate` from the shapes alone (caches, draft
    replicas, the tree and its ``N x N`` masks, laws, verification buffers) plus the weights,
    against the devices' memory. A one-line ``ValueError`` names the argument to lower; returns
    the estimate's parts (bytes) otherwise. ``draft``: a draft model, None, or a drafter's name
    (``"lookup"``, ``"self:L"``); ``drafter="lookup"`` with ``draft=None`` is a prompt lookup."""
    if isinstance(draft, str):
        drafter, draft = parse_draft(target, draft)
    shared = isinstance(draft, selfdraft.SelfDraft) and selfdraft.can_share_cache(draft.config)
    dtypes = [jax.tree.leaves(m.params)[0].dtype for m in (target, draft) if m is not None]
    own_weights = None if isinstance(draft, selfdraft.SelfDraft) else draft  # a self-draft's: views
    return footprint.check(
        target.config,
        None if draft is None else draft.config,
        available=_device_memory_bytes(mesh),
        weights=footprint.weight_bytes(target, own_weights),
        method=method,
        batch=batch,
        prompt_len=prompt_len,
        max_new_tokens=max_new_tokens,
        num_draft_tokens=num_draft_tokens,
        num_drafts=num_drafts,
        widths=tuple(widths),
        options=options,
        target_itemsize=np.dtype(dtypes[0]).itemsize,
        draft_itemsize=np.dtype(dtypes[-1]).itemsize,
        num_prompts=num_prompts,
        drafter=drafter,
        shared_draft_cache=shared,
    )


def _layout(sharding: str, default=dataclasses.MISSING):
    """A field with its layout on a mesh (:data:`asps_jax.sharding.LAYOUTS`)."""
    return dataclasses.field(default=default, metadata=dict(sharding=sharding))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeInputs:
    """The array arguments of ``Decoder.generate`` (a pytree; ``prefill`` takes all but
    ``sampling``, ``step`` the parameters and ``sampling``). Each field declares its layout on a
    mesh, which :func:`asps_jax.sharding.shard_inputs` follows, field by field.

    Attributes:
      target_params, draft_params: the models' parameters in their run layout (``draft_params``
        None for ``"ar"``).
      sampling: the per-row :class:`~asps_jax.processors.SamplingParams`.
      prompts_BP: int32[B, P], right-padded prompts (``B`` a padded batch).
      prompt_lengths_B: int32[B]; 0 for the padding rows (they start done).
      row_keys_B: one PRNG key per row.
      stop: the call's :class:`~asps_jax.stopping.StopStrings`, or None (with
        :attr:`Prepared.slots`, one tail per slot).
      budget_B: int32[B], each row's ``max_new_tokens`` (a traced value, at most the static
        ``SpecConfig.max_new_tokens``); 1 for the padding rows.
    """

    target_params: dict = _layout(sharding.PARAMS)
    draft_params: dict | None = _layout(sharding.PARAMS)
    sampling: SamplingParams = _layout(sharding.FIELDS)
    prompts_BP: jax.Array = _layout(sharding.ROWS)
    prompt_lengths_B: jax.Array = _layout(sharding.ROWS)
    row_keys_B: jax.Array = _layout(sharding.ROWS)
    stop: stopping.StopStrings | None = _layout(sharding.FIELDS, None)
    budget_B: jax.Array | None = _layout(sharding.ROWS, None)

    def kwargs(self) -> dict:
        """The keyword arguments of ``Decoder.generate`` (one level: the fields themselves)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def prefill_kwargs(self) -> dict:
        """The keyword arguments of ``Decoder.prefill`` (all but ``sampling``)."""
        return {name: value for name, value in self.kwargs().items() if name != "sampling"}


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What :func:`prepare` returns: a checked call, ready to run.

    Attributes:
      decoder: the static :class:`asps_jax.decode.Decoder` (compiled in).
      inputs: the :class:`DecodeInputs` (placed on the mesh when there is one).
      batch: the number of prompts; rows from ``batch`` on pad the batch and start done.
      slots: with ``batch_size``, the number of slots of continuous batching
        (:mod:`asps_jax.slots`; the inputs' rows are then the prompts, not the loop's rows);
      width: M, the widest budget of the call's prompts (the outputs' width), kept on the host:
        the budgets' array may span other processes' devices;
        None runs every row at once (``Decoder.generate``).
      constraint: the rows' constraint tables on the host (:class:`HostConstraint`), None when
        no row is constrained.
    """

    decoder: decode.Decoder
    inputs: DecodeInputs
    batch: int
    slots: int | None = None
    width: int = 0
    constraint: HostConstraint | None = None

    def generate(self) -> decode.DecodeState:
        """Run the whole loop (``Decoder.generate``) on the inputs."""
        return self.decoder.generate(**self.inputs.kwargs())

    def prompts(self) -> slots.Prompts:
        """The inputs' rows as the :class:`asps_jax.slots.Prompts` the slots draw from."""
        i = self.inputs
        return slots.Prompts(
            tokens=i.prompts_BP,
            lengths=i.prompt_lengths_B,
            keys=i.row_keys_B,
            budget=i.budget_B,
            sampling=i.sampling,
        )

    def slot_kwargs(self) -> dict:
        """The keyword arguments of :func:`asps_jax.slots.run` / ``start`` (after the decoder)."""
        i = self.inputs
        return dict(
            target_params=i.target_params,
            draft_params=i.draft_params,
            prompts=self.prompts(),
            stop=i.stop,
            batch=self.slots,
        )

    def run(self) -> decode.DecodeState | slots.Results:
        """Run the call: every row at once, or through the slots (:attr:`slots`)."""
        if self.slots is None:
            return self.generate()
        return slots.run(self.decoder, **self.slot_kwargs())

    def output_width(self) -> int:
        """M, the widest budget of the call's prompts (the outputs' width)."""
        return self.width


def _check_spec(
    target, draft, method, num_drafts, num_draft_tokens, tree, max_new_tokens, options, drafting
):
    """The method, its drafter, draft tree and sizes checked; returns ``(target, draft, spec,
    tau)`` with the vocabularies aligned (and no draft model for ``"ar"`` or a lookup draft);
    ``drafting``: the drafter's options (``lookup_ngram``, ``lookup_max``, ``draft_stop``), and
    ``tau`` the confidence stop (None without ``draft_stop``)."""
    drafter, draft = parse_draft(target, draft)
    widths = _check_tree(tree, method, num_drafts, num_draft_tokens)
    context = target.config.max_position_embeddings
    lookup_ngram, lookup_max, tau = _check_drafter(drafter, method, widths, context, **drafting)
    if drafter == "lookup" and num_draft_tokens is None and lookup_max:
        num_draft_tokens = lookup_max  # the lookup's chains are at most lookup_max long
    if widths:
        num_drafts, num_draft_tokens = math.prod(widths), len(widths)
    num_draft_tokens = _check_int(
        "num_draft_tokens", 8 if num_draft_tokens is None else num_draft_tokens, 1
    )
    num_drafts = _check_int("num_drafts", 1 if num_drafts is None else num_drafts, 1)
    if method != "ar" and drafter == "model":  # padded embeddings of one tokenizer
        target, draft = align_vocabularies(target, draft)
    _check_method(
        method,
        "lookup" if drafter == "lookup" else draft,
        target,
        num_drafts,
        num_draft_tokens,
        options,
    )
    if method == "ar":
        num_draft_tokens, num_drafts, draft = 1, 1, None
    spec = decode.SpecConfig(
        method=method,
        num_draft_tokens=num_draft_tokens,
        num_drafts=num_drafts,
        max_new_tokens=max_new_tokens,
        options=tuple(sorted(options.items())),
        widths=widths,
        drafter=drafter if method != "ar" else "model",
        lookup_ngram=lookup_ngram,
        lookup_max=min(lookup_max, num_draft_tokens),
        draft_stop=tau is not None and method != "ar",
    )
    return target, draft, spec, tau


def _check_fits(
    target, draft, spec: decode.SpecConfig, lengths_b, budgets, mesh, slot_count=None
) -> None:
    """Refuse a call whose prompt, new tokens and draft do not fit the models' context, or whose
    caches and tree do not fit the device memory (``slot_count``: the loop's rows with
    continuous batching); then check a tree method's options against the tree (built only once
    :func:`check_memory` has passed). ``lengths_b`` / ``budgets``: each prompt's length and
    ``max_new_tokens``."""
    context = target.config.max_position_embeddings
    if draft is not None:
        context = min(context, draft.config.max_position_embeddings)
    over = int(np.argmax(np.asarray(lengths_b) + np.asarray(budgets)))
    if lengths_b[over] + budgets[over] > context:
        raise ValueError(
            f"prompt of {lengths_b[over]} tokens plus max_new_tokens={budgets[over]} exceeds the "
            f"model context of {context} positions; shorten the prompt or lower max_new_tokens"
        )
    if draft is not None and spec.num_draft_tokens >= context:
        raise ValueError(
            f"num_draft_tokens={spec.num_draft_tokens} does not fit the model context of "
            f"{context} positions; lower num_draft_tokens"
        )
    options = dict(spec.options)
    batch = len(budgets)
    check_memory(
        target,
        draft,
        batch=batch if slot_count is None else slot_count,
        num_prompts=None if slot_count is None else batch,
        prompt_len=int(np.max(lengths_b)),
        max_new_tokens=spec.max_new_tokens,
        num_draft_tokens=spec.num_draft_tokens,
        num_drafts=spec.num_drafts,
        mesh=mesh,
        method=spec.method,
        widths=spec.widths,
        options=options,
        drafter=spec.drafter,
    )
    _check_tree_size(spec)
    _check_tree_options(spec.method, spec.num_drafts, spec.num_draft_tokens, options, spec.widths)


MAX_TREE_NODES = 1024
"""The most draft-tree nodes one step may verify (K chains of n: K * n nodes). A larger step's
program (the per-node laws, the ``N x N`` masks, the verifier's walk) takes minutes to compile
even when it fits the device (``--tree 5000`` did)."""


def _check_tree_size(spec: decode.SpecConfig) -> None:
    """Refuse a draft tree of more than :data:`MAX_TREE_NODES` nodes (one line naming the
    arguments), after :func:`check_memory` (which names the one that saves the most memory)."""
    widths = spec.widths
    nodes = (
        sum(math.prod(widths[: d + 1]) for d in range(len(widths)))
        if widths
        else spec.num_drafts * spec.num_draft_tokens
    )
    if nodes > MAX_TREE_NODES:
        lower = (
            "lower tree (--tree)"
            if widths
            else "lower num_drafts or num_draft_tokens (--num-drafts, --num-draft-tokens)"
        )
        raise ValueError(
            f"the draft tree has {nodes} nodes, past the bound of {MAX_TREE_NODES} nodes a step "
            f"verifies (a larger step compiles for minutes): {lower}"
        )


def _sampling_params(target, batch: int, padded: int, sampling: dict):
    """``(SamplingParams, constraint)``: the parameters of the ``padded`` rows from
    :func:`prepare`'s sampling arguments (``sampling``: their names and values; scalars or one
    value per prompt), and the host's :class:`HostConstraint` (None when no row has one)."""
    top_k = sampling["top_k"]
    if top_k is not None:  # top_k >= V keeps every token; clamping keeps it inside int32
        # (clamped as floats: an int past int64, e.g. 10**20, overflows np.int64)
        top_k = np.minimum(np.asarray(top_k, np.float64), target.vocab_size).astype(np.int64)
    controls = (
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "no_repeat_ngram_size",
    )
    ngram = sampling["no_repeat_ngram_size"]
    if ngram is not None:
        # An n-gram longer than the context can never repeat: such a row bans nothing, as n = 0
        # does (so the static n-gram window never exceeds the context).
        ngram = np.asarray(ngram, np.float64)
        ngram = np.where(ngram > target.config.max_position_embeddings, 0, ngram).astype(np.int32)
    sampling = dict(sampling, no_repeat_ngram_size=ngram)
    constraint = _constraint_rows(target, sampling["regex"], sampling["json_schema"], batch, padded)
    eos_ids = _eos_ids(target, sampling["eos_token_id"])
    params = SamplingParams.make(
        padded,
        _per_row("temperature", sampling["temperature"], batch, padded),
        _per_row("top_k", top_k, batch, padded),
        _per_row("top_p", sampling["top_p"], batch, padded),
        _per_row("draft_temperature", sampling["draft_temperature"], batch, padded),
        eos_ids=eos_ids,
        logit_bias=_logit_bias_rows(sampling["logit_bias"], batch, padded, target.vocab_size),
        constraint=constraint,
        draft_stop=sampling["draft_stop"],
        **{name: _per_row(name, sampling[name], batch, padded) for name in controls},
    )
    return params, None if constraint is None else HostConstraint(*constraint, eos_ids)


@dataclasses.dataclass(frozen=True, eq=False)
class HostConstraint:
    """The stacked constraint tables of a call, kept on the host to tell which rows' text the
    constraint accepts (:meth:`incomplete_rows`): ``next int32[S, V]``, ``final bool[S]``,
    ``start int32[rows]`` (:func:`asps_jax.constraints.stack`) and the EOS ids."""

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
            moved = self.next[state, np.clip(token, 0, self.next.shape[1] - 1)]
            state = np.where(live, np.where(moved >= 0, moved, constraints.SINK), state)
        return ~self.final[state]


def _decoder(target, draft, spec, prompt_width: int, mesh, diagnostics, top_logprobs, shared):
    """The static :class:`asps_jax.decode.Decoder` of a call (its KV cache length bucketed);
    ``shared``: a self-draft that shares the target's cache (``Decoder.share_draft_cache``)."""
    # A shared self-draft cache keeps the rollout's n * K scratch slots past the committed ones.
    scratch = spec.num_draft_tokens * spec.num_drafts if shared else 0
    cache_len = _round_up(
        prompt_width + spec.max_new_tokens + spec.num_draft_tokens + 2 + scratch, _CACHE_BUCKET
    )
    return decode.Decoder(
        target_config=target.config,
        draft_config=None if draft is None else draft.config,
        spec=spec,
        cache_len=cache_len,
        mesh=mesh,
        diagnostics=bool(diagnostics),
        top_logprobs=top_logprobs,
        share_draft_cache=shared,
    )


def _placed(inputs: DecodeInputs, mesh, target, draft) -> DecodeInputs:
    """The inputs on the mesh (jit propagates their shardings through the whole loop), the
    parameters in each model's fast run layout (made once per model)."""
    if mesh is not None:
        inputs = sharding.shard_inputs(
            inputs, mesh, {"target_params": target, "draft_params": draft}
        )
    changes = {}
    for name, model in (("target_params", target), ("draft_params", draft)):
        if getattr(inputs, name) is not None:
            changes[name] = run_params(model, getattr(inputs, name))
    return dataclasses.replace(inputs, **changes)


def prepare(
    target,
    draft,
    prompts,
    *,
    key,
    max_new_tokens,
    method="asps",
    num_draft_tokens=None,
    num_drafts=None,
    tree=None,
    temperature=1.0,
    top_k=None,
    top_p=None,
    draft_temperature=None,
    eos_token_id=None,
    stop=None,
    mesh=None,
    prompt_lengths=None,
    diagnostics=False,
    min_p=None,
    repetition_penalty=None,
    presence_penalty=None,
    frequency_penalty=None,
    no_repeat_ngram_size=None,
    logit_bias=None,
    top_logprobs=0,
    regex=None,
    json_schema=None,
    batch_size=None,
    lookup_ngram=None,
    lookup_max=None,
    draft_stop=None,
    **options,
) -> Prepared:
    """Validate the arguments of :func:`sample`; returns the :class:`Prepared` call: the static
    :class:`asps_jax.decode.Decoder`, the :class:`DecodeInputs` (the array pytrees of
    ``Decoder.generate``) and the number of prompts.

    ``max_new_tokens``: an int, or one per prompt; it is a traced per-row value
    (``DecodeInputs.budget_B``; the static output width is :func:`budget_bucket` of the largest),
    so budgets within a bucket reuse the compiled program. ``batch_size=B``: continuous batching
    (:mod:`asps_jax.slots`): ``Prepared.slots`` is then B and :meth:`Prepared.run` runs the
    prompts through B slots (:func:`asps_jax.slots.run`) instead of ``Decoder.generate``.

    ``temperature``, ``top_k``, ``top_p``,
    ``draft_temperature``, ``min_p``, ``repetition_penalty``, ``presence_penalty``,
    ``frequency_penalty`` and ``no_repeat_ngram_size`` may also be given per prompt, and
    ``logit_bias`` as one ``{token id: bias}`` dict per prompt (docs/api.md: the controls and their
    order). ``top_logprobs=k`` records the k most likely tokens of each emitted token's law.
    ``regex`` / ``json_schema`` constrain the generated text (one for all rows, or one per
    prompt, None = unconstrained; :mod:`asps_jax.constraints`).
    ``diagnostics=True`` also measures the root ``optimal_acceptance`` of multi-draft steps (see
    :class:`asps_jax.decode.Decoder`).

    ``num_draft_tokens`` defaults to 8 and ``num_drafts`` to 1. ``tree=(w_1, ..., w_D)`` (tree
    methods only) drafts a branching tree instead of K chains: every node at depth d - 1 draws
    ``w_d`` children, without replacement for ``"tv"`` and independently for ``"tv_wr"`` and
    ``"is_bv"``; the draft then runs ``prod(w)`` cache replicas (one per root path) and D is the
    draft length.

    ``stop``: a list of strings (at most 16, each 1 to 64 UTF-8 bytes); a row ends after the
    first token whose text completes an occurrence of one of them in the row's generated text,
    that token kept (:mod:`asps_jax.stopping`). Needs the target's tokenizer.
    """
    compile_cache.enable_default()  # the persistent cache, as the command line has it
    batch_size, stop_bytes, largest = _check_call(target, max_new_tokens, batch_size, mesh, stop)
    target, draft, spec, tau = _check_spec(
        target,
        draft,
        method,
        num_drafts,
        num_draft_tokens,
        tree,
        budget_bucket(largest),
        options,
        dict(lookup_ngram=lookup_ngram, lookup_max=lookup_max, draft_stop=draft_stop),
    )
    _validate_numbers(
        temperature=temperature,
        draft_temperature=draft_temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        no_repeat_ngram_size=no_repeat_ngram_size,
    )
    top_logprobs = _check_int("top_logprobs", top_logprobs, 0)
    if top_logprobs > target.vocab_size:
        raise ValueError(
            f"top_logprobs must be at most the vocabulary size {target.vocab_size}, got "
            f"{top_logprobs}"
        )
    if mesh is not None:
        mesh = sharding.check_mesh(mesh)
    if isinstance(prompts, (list, tuple)) and not prompts and prompt_lengths is None:
        raise ValueError("prompts: the list is empty; give at least one prompt")
    shared = _check_self_draft(draft, spec, mesh)
    prompts_bp, lengths_b, batch = _as_prompt_array(prompts, prompt_lengths, target.vocab_size)
    budgets = _budgets(max_new_tokens, batch)
    slot_count = None if batch_size is None else min(batch_size, prompts_bp.shape[0])
    _check_fits(target, draft, spec, lengths_b[:batch], budgets, mesh, slot_count)
    if mesh is not None:  # rows of length 0 until the batch splits evenly over "data"
        prompts_bp, lengths_b = sharding.pad_batch(
            prompts_bp, lengths_b, sharding.batch_multiple(mesh)
        )
    padded = prompts_bp.shape[0]
    sampling, constraint = _sampling_params(
        target,
        batch,
        padded,
        dict(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            draft_temperature=draft_temperature,
            eos_token_id=eos_token_id,
            logit_bias=logit_bias,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            no_repeat_ngram_size=no_repeat_ngram_size,
            regex=regex,
            json_schema=json_schema,
            draft_stop=tau,
        ),
    )
    decoder = _decoder(
        target, draft, spec, prompts_bp.shape[1], mesh, diagnostics, top_logprobs, shared
    )
    inputs = _decode_inputs(
        target, draft, sampling, prompts_bp, lengths_b, key, batch, budgets, stop_bytes, slot_count
    )
    _check_same_everywhere(mesh, decoder, inputs)
    return Prepared(
        decoder=decoder,
        inputs=_placed(inputs, mesh, target, draft),
        batch=batch,
        slots=slot_count,
        width=max(budgets),
        constraint=constraint,
    )


def _check_call(target, max_new_tokens, batch_size, mesh, stop):
    """The call-level arguments of :func:`prepare`: ``(batch_size, stop strings as bytes, the
    largest budget)``, one-line errors otherwise."""
    many = isinstance(max_new_tokens, (list, tuple, np.ndarray))
    if not many:
        _check_int("max_new_tokens", max_new_tokens, 1)
    if batch_size is not None:
        batch_size = _check_int("batch_size", batch_size, 1)
        if mesh is not None:
            raise ValueError(
                "batch_size: continuous batching runs on one device for now; omit batch_size "
                "(or mesh)"
            )
    stop_bytes = stopping.validate_stop(stop)
    if stop_bytes and getattr(target, "tokenizer", None) is None:
        raise ValueError(
            "stop: stop strings are matched against the tokens' text, and the target model was "
            "loaded without a tokenizer"
        )
    largest = max(_budgets(max_new_tokens, len(max_new_tokens) if many else 1))
    return batch_size, stop_bytes, largest


def _check_self_draft(draft, spec: decode.SpecConfig, mesh) -> bool:
    """Whether a ``draft="self:L"`` shares the target's cache; one-line errors for what a
    self-draft cannot do yet (a mesh, a confidence stop on a shared cache)."""
    if not isinstance(draft, selfdraft.SelfDraft):
        return False
    if mesh is not None:
        raise ValueError("draft='self:L' does not run on a mesh yet; pass mesh=None")
    shared = selfdraft.can_share_cache(draft.config)
    if shared and spec.draft_stop:
        raise ValueError(
            "draft_stop: confidence-stopped chains need the draft's own cache; draft='self:L' "
            "shares the target's (drop draft_stop)"
        )
    return shared


def _decode_inputs(
    target, draft, sampling, prompts_bp, lengths_b, key, batch, budgets, stop_bytes, slot_count
) -> DecodeInputs:
    """The array inputs of the loop (unplaced): parameters, sampling, prompts, row keys, the
    stop strings' state (one tail per loop row: per slot with ``batch_size``) and the budgets
    (padding rows start done)."""
    padded = prompts_bp.shape[0]
    budget_b = np.ones(padded, np.int32)
    budget_b[:batch] = budgets
    stop_state = None
    if stop_bytes:
        table = stopping.cached_table(target.tokenizer, target.vocab_size)
        stop_state = stopping.stop_strings(table, stop_bytes, slot_count or padded)
    return DecodeInputs(
        target_params=target.params,
        draft_params=None if draft is None else draft.params,
        sampling=sampling,
        prompts_BP=jnp.asarray(prompts_bp),
        prompt_lengths_B=jnp.asarray(lengths_b),
        row_keys_B=_row_keys(key, batch, padded),
        stop=stop_state,
        budget_B=jnp.asarray(budget_b),
    )


def _check_same_everywhere(mesh, decoder, inputs: DecodeInputs) -> None:
    """Several processes: each passes the full batch (so row keys follow the global row index),
    and every input but the parameters (which the decoder's repr stands for) must agree."""
    per_call = [
        getattr(inputs, f.name)
        for f in dataclasses.fields(inputs)
        if sharding.layout(inputs, f.name) != sharding.PARAMS
    ]
    sharding.check_same_everywhere(
        mesh,
        "the prompts, key, models, method or sampling arguments",
        np.frombuffer(repr(decoder).encode(), np.uint8),  # models, method, shapes
        *jax.tree.leaves(per_call),
    )


def summarize_stats(state: decode.DecodeState, batch: int) -> dict:
    """Per-row statistics (device arrays) of the first ``batch`` rows of a decode state; see
    :func:`asps_jax.statistics.summarize` for the entries."""
    return statistics.summarize(state.stats, state.num_generated, batch)


def _finish(
    state: decode.DecodeState | slots.Results,
    spec: decode.SpecConfig,
    batch: int,
    return_logprobs: bool,
    mesh=None,
    width: int | None = None,
    constraint: HostConstraint | None = None,
) -> SampleOutput:
    width = spec.max_new_tokens if width is None else width
    # Several processes: every process gets every row (on its first device).
    whole = sharding.to_local(
        dict(
            tokens=state.tokens,
            lengths=state.num_generated,
            logprobs=state.logprobs if return_logprobs else None,
            top_logprobs=state.top_logprobs if return_logprobs else None,
            stats=summarize_stats(state, batch),
        ),
        mesh,
    )

    def cut(a):
        """The first ``batch`` rows and ``width`` columns, cut on the host: a cut on device is
        one XLA program per width, so every new ``max_new_tokens`` would compile one (and so
        would ``jnp.asarray``; ``device_put`` only copies)."""
        return jax.device_put(np.asarray(a)[:batch, :width])

    top = None
    if return_logprobs and state.top_logprobs[0].shape[-1]:
        lengths = np.asarray(whole["lengths"])[:batch]
        emitted = (np.arange(width)[None, :] < lengths[:, None])[..., None]
        ids, lps = (np.asarray(a)[:batch, :width] for a in whole["top_logprobs"])
        top = jax.device_put((np.where(emitted, ids, -1), np.where(emitted, lps, 0.0)))
    lengths = np.asarray(whole["lengths"])[:batch]
    tokens = np.asarray(whole["tokens"])[:batch, :width]
    out = SampleOutput(
        tokens=jax.device_put(tokens),
        lengths=jax.device_put(lengths),
        stats=whole["stats"],
        logprobs=cut(whole["logprobs"]) if return_logprobs else None,
        top_logprobs=top,
        incomplete=None if constraint is None else constraint.incomplete_rows(tokens, lengths),
    )
    failed_at = np.asarray(out.stats["failed_at"])
    rows = np.flatnonzero(failed_at >= 0).tolist()
    if rows:
        raise NonFiniteLogitsError(
            f"rows {rows} stopped at new-token positions {failed_at[rows].tolist()}: the target or "
            "draft law there had NaN or +inf logits or none finite (check the checkpoint and "
            "dtype), or logit_bias / no_repeat_ngram_size banned every token (that the regex / "
            "json_schema constraint allowed); the exception's "
            ".output keeps the tokens generated before",
            out,
            rows=rows,
            positions=failed_at[rows].tolist(),
        )
    return out


def sample(
    target, draft, prompts, *, key, max_new_tokens, return_logprobs=False, **kwargs
) -> SampleOutput:
    """Sample ``max_new_tokens`` tokens per prompt with exactly the target's law (docs/api.md §3).

    ``target`` / ``draft`` are :class:`asps_jax.models.Model` (``draft`` may be None for
    ``method="ar"``). See :func:`prepare` for the keyword arguments; extra keyword arguments are
    method options (e.g. ``rule="fixed_order"`` for ``method="is"``). ``return_logprobs=True``
    fills :attr:`SampleOutput.logprobs` (measured in the loop either way: no extra forward, no
    recompile). ``max_new_tokens`` may be one budget per prompt; ``batch_size=B`` runs the
    prompts through B slots with continuous batching (:mod:`asps_jax.slots`), each prompt's
    tokens independent of B (docs/api.md §3).
    """
    _check_top_logprobs(kwargs.get("top_logprobs"), return_logprobs, target.vocab_size)
    compile_cache.enable_default()  # before the calibration of num_draft_tokens="auto" compiles
    calibration = _resolve_auto(target, draft, prompts, key, kwargs)
    call = prepare(target, draft, prompts, key=key, max_new_tokens=max_new_tokens, **kwargs)
    mesh = None if call.slots is not None else call.decoder.mesh
    width = call.output_width()
    out = _finish(
        call.run(), call.decoder.spec, call.batch, return_logprobs, mesh, width, call.constraint
    )
    if calibration is not None:
        out.stats["calibration"] = calibration
    return out


def _resolve_auto(target, draft, prompts, key, kwargs):
    """``num_draft_tokens="auto"``: calibrate (:mod:`asps_jax.autotune`) and put the chosen n into
    ``kwargs``; returns the :class:`~asps_jax.autotune.Calibration` (None without "auto")."""
    if not (isinstance(kwargs.get("num_draft_tokens"), str)):
        return None
    if kwargs["num_draft_tokens"] != "auto":
        raise ValueError(
            "num_draft_tokens must be an integer >= 1 or 'auto', got "
            f"{kwargs['num_draft_tokens']!r}"
        )
    if kwargs.get("method", "asps") == "ar" or kwargs.get("tree") is not None:
        raise ValueError(
            "num_draft_tokens='auto' chooses the length of draft chains: not for method 'ar' or "
            "a tree="
        )
    max_n = kwargs.get("lookup_max") or 8
    probe = {k: v for k, v in kwargs.items() if k != "num_draft_tokens"}
    # One-line errors for the call's own arguments before anything is measured.
    prepare(target, draft, prompts, key=key, max_new_tokens=1, num_draft_tokens=max_n, **probe)
    calibration = autotune.calibrate(Session, target, draft, prompts, key=key, max_n=max_n, **probe)
    kwargs["num_draft_tokens"] = calibration.num_draft_tokens
    return calibration


@contextlib.contextmanager
def _sigint_recorded() -> Iterator[threading.Event]:
    """Record SIGINT (Ctrl-C) during the block in the yielded event instead of raising
    KeyboardInterrupt wherever it lands: one that lands while a finaliser or weakref callback runs
    (a JAX buffer's, say) is printed as "Exception ignored" and lost. The caller acts on the event
    at its next boundary. Installed only on the main thread while SIGINT has Python's default
    handler (a program with its own handler keeps it, and acts on it itself); the previous handler
    is restored on leaving (``signal.signal`` runs a pending handler first, so nothing slips
    between)."""
    received = threading.Event()
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield received
        return
    previous = signal.signal(signal.SIGINT, lambda *_: received.set())
    try:
        yield received
    finally:
        signal.signal(signal.SIGINT, previous)


class Session:
    """Step-wise decoding for streaming, with compilation timed apart from running.

    ``Session(target, draft, prompts, key=..., max_new_tokens=..., **kwargs)`` takes the arguments
    of :func:`sample`. ``compile()`` compiles prefill and the step ahead of time and returns the
    seconds it took; ``steps()`` yields each row's new tokens after every compiled step;
    ``result()`` gives the :class:`SampleOutput`. With ``batch_size`` (continuous batching),
    ``steps()`` yields ``(prompt_index, new_tokens)`` and, as each pair is yielded:
    ``prompts_done`` counts the prompts finished so far; ``finished`` (bool[N], one per prompt) is
    True for a prompt once the pair carrying its last tokens is yielded (or, for one that gets no
    tokens in its last step, as that step's pairs are), so the pairs yielded up to then are all of
    its tokens; ``prompts_started`` counts the prompts that have taken a slot (prompts
    ``0 .. prompts_started - 1``: the started ones not ``finished`` are in flight, their tokens so
    far the pairs yielded for them); ``step_end`` is True when the pair is the last of its
    compiled step (a caller that stops there stops at a step boundary, every pair of the steps
    run received). A KeyboardInterrupt from ``next()`` leaves ``finished``, ``prompts_done`` and
    ``prompts_started`` as they were at the last pair yielded. ``constraint``: the call's
    :class:`HostConstraint` under a ``regex`` / ``json_schema`` (None without), which tells
    whether a row's tokens so far complete its text (:meth:`HostConstraint.incomplete_rows`).
    """

    def __init__(
        self, target, draft, prompts, *, key, max_new_tokens, return_logprobs=False, **kwargs
    ):
        self.return_logprobs = bool(return_logprobs)
        _check_top_logprobs(kwargs.get("top_logprobs"), return_logprobs, target.vocab_size)
        compile_cache.enable_default()  # before the calibration of num_draft_tokens="auto"
        # num_draft_tokens="auto": the autotune.Calibration that chose n (else None).
        self.calibration = _resolve_auto(target, draft, prompts, key, kwargs)
        call = prepare(target, draft, prompts, key=key, max_new_tokens=max_new_tokens, **kwargs)
        self.batch_size = call.batch
        self._width = call.output_width()
        self.constraint = call.constraint  # HostConstraint or None: which rows end incomplete
        self.decoder: decode.Decoder = call.decoder
        self.spec: decode.SpecConfig = self.decoder.spec
        inputs = call.inputs
        self._params = dict(target_params=inputs.target_params, draft_params=inputs.draft_params)
        # batch_size: continuous batching (the keyword arguments of slots.start)
        self._slots = None if call.slots is None else call.slot_kwargs()
        self.prompts_done = 0  # with batch_size: prompts finished so far (steps())
        if self._slots is not None:
            self._state = None
            self._mesh = None
            return
        self._prefill_args = inputs.prefill_kwargs()
        self._sampling = inputs.sampling
        self._prefill = functools.partial(decode.prefill, self.decoder)
        self._step = functools.partial(decode.spec_step, self.decoder)
        self._state: decode.DecodeState | None = None
        mesh = kwargs.get("mesh")
        self._mesh = None if mesh is None else sharding.check_mesh(mesh)

    def _place(self, state):
        """On a mesh, give the state the one layout the compiled step expects."""
        return state if self._mesh is None else sharding.shard_state(state, self._mesh)

    def compile(self) -> float:
        """Compile prefill and the step now; returns the wall seconds spent compiling."""
        start = time.perf_counter()
        if self._slots is not None:
            a = self._slots
            first = slots.start.lower(self.decoder, **a).compile()
            shape = jax.eval_shape(lambda: slots.start(self.decoder, **a))
            step = slots.advance.lower(
                self.decoder, **self._params, prompts=a["prompts"], s=shape
            ).compile()
            self._slot_fns = (first, step)
            return time.perf_counter() - start
        prefill = decode.prefill.lower(self.decoder, **self._prefill_args).compile()
        state_shape = jax.eval_shape(lambda: self._prefill(**self._prefill_args))
        if self._mesh is not None:
            state_shape = sharding.sharded_shapes(state_shape, self._mesh)
        step = decode.spec_step.lower(
            self.decoder, **self._params, sampling=self._sampling, state=state_shape
        ).compile()
        self._prefill = prefill  # compiled: called with the arrays only
        self._step = step
        return time.perf_counter() - start

    def steps(self) -> Iterator[list[list[int]]]:
        """Yield each row's new tokens after every compiled step, until every row is done.

        Ctrl-C while a step runs (or prefill) is held until the step's state is kept, then raised
        as KeyboardInterrupt from ``next()`` instead of yielding: ``result()`` has every step that
        finished, that one included. Between ``next()`` calls SIGINT is the caller's.

        With ``batch_size`` (continuous batching) it yields ``(prompt_index, new_tokens)`` for
        every prompt that got tokens in the step instead (a list per prompt, in slot order).
        """
        if self._slots is not None:
            yield from self._slot_steps()
            return
        with _sigint_recorded() as interrupt:
            state = self._place(self._prefill(**self._prefill_args))
        if interrupt.is_set():
            raise KeyboardInterrupt
        seen = np.zeros(self.batch_size, np.int64)
        while True:
            # The step donates the old state: the new one is kept before anything else can happen.
            with _sigint_recorded() as interrupt:
                state = self._place(
                    self._step(**self._params, sampling=self._sampling, state=state)
                )
                self._state = state
                view = sharding.to_local(
                    (state.num_generated, state.tokens, state.done), self._mesh
                )
                generated = np.asarray(view[0])[: self.batch_size]
                tokens = np.asarray(view[1])
                done = bool(np.all(np.asarray(view[2])))
            if interrupt.is_set():
                raise KeyboardInterrupt
            yield [tokens[b, seen[b] : generated[b]].tolist() for b in range(self.batch_size)]
            seen = generated
            if done:
                return

    def _slot_steps(self) -> Iterator[tuple[int, list[int]]]:
        a = self._slots
        first, step = getattr(self, "_slot_fns", (None, None))
        if first is None:  # not compiled ahead: jit on the first call
            first = functools.partial(slots.start, self.decoder, batch=a["batch"])
            step = functools.partial(slots.advance, self.decoder)
        first_args = {k: v for k, v in a.items() if k != "batch"}
        # Updated as the pairs are yielded (the class docstring): a fresh array per run.
        finished = self.finished = np.zeros(self.batch_size, bool)
        self.prompts_done = self.prompts_started = 0
        self.step_end = False
        with _sigint_recorded() as interrupt:
            s = first(**first_args)
        if interrupt.is_set():
            raise KeyboardInterrupt
        seen = np.zeros(self.batch_size, np.int64)
        while True:
            with _sigint_recorded() as interrupt:
                s = step(**self._params, prompts=a["prompts"], s=s)
                self._state = s
                prompt = np.asarray(s.prompt)
                started = int(s.next)
                generated = np.asarray(s.state.num_generated)
                tokens = np.asarray(s.state.tokens)
                res_len = np.asarray(s.results.num_generated)[: self.batch_size]
                res_tokens = np.asarray(s.results.tokens)
            if interrupt.is_set():
                raise KeyboardInterrupt
            running = np.zeros(self.batch_size, bool)
            running[prompt[prompt >= 0]] = True
            # Prompts that finished in this step (possibly started in it too): from the results.
            new_done = ~running & ~finished & (np.arange(self.batch_size) < started)
            pairs = []  # (prompt, its new tokens, whether they are its last)
            for p in np.flatnonzero(new_done).tolist():
                if res_len[p] > seen[p]:
                    pairs.append((p, res_tokens[p, seen[p] : res_len[p]].tolist(), True))
                    seen[p] = res_len[p]
                else:  # nothing new in its last step: finished as the step's pairs come
                    finished[p] = True
            for slot, p in enumerate(prompt.tolist()):
                if p >= 0 and generated[slot] > seen[p]:
                    pairs.append((p, tokens[slot, seen[p] : generated[slot]].tolist(), False))
                    seen[p] = generated[slot]
            self.prompts_started = started
            self.prompts_done = int(finished.sum())
            for i, (p, new, last) in enumerate(pairs):
                if last:
                    finished[p] = True
                    self.prompts_done = int(finished.sum())
                self.step_end = i == len(pairs) - 1
                yield p, new
            self.step_end = False
            if finished.all():
                return

    def result(self) -> SampleOutput:
        if self._state is None:
            raise RuntimeError("Session.result(): run steps() to completion first")
        if self._slots is not None:
            return _finish(
                self._state.results,
                self.spec,
                self.batch_size,
                self.return_logprobs,
                None,
                self._width,
                self.constraint,
            )
        return _finish(
            self._state,
            self.spec,
            self.batch_size,
            self.return_logprobs,
            self._mesh,
            self._width,
            self.constraint,
        )


def stream(target, draft, prompts, *, key, max_new_tokens, **kwargs) -> Iterator[list[list[int]]]:
    """Like :func:`sample`, one compiled step at a time: yields each row's new tokens per step
    (with ``batch_size``: ``(prompt_index, new_tokens)`` pairs as they come).

    The generator's return value (``StopIteration.value``) is the :class:`SampleOutput`.
    """
    session = Session(target, draft, prompts, key=key, max_new_tokens=max_new_tokens, **kwargs)
    yield from session.steps()
    return session.result()
