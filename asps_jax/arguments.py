"""Argument checks of the sampling entry points (``sample``, ``stream``, ``Session``, ``Sampler``
and :func:`asps_jax.sampler.prepare`) that run before anything is built: keyword names, the
number of rows ``n`` asks for, and the PRNG keys of per-prompt seeds.

- :func:`check_keywords`: a keyword no entry point takes is refused as unknown, in one line naming
  it and the closest valid name (it used to reach the method's options and read "verify_drafts:
  method 'asps' takes no options").
- :func:`check_rows`: ``n`` samples per prompt are at most :data:`MAX_ROWS` rows a call, checked
  before the prompts and keys are repeated (``n=10**9`` used to allocate gigabytes first).
- :func:`prompt_array`: the prompts checked and padded with vectorised NumPy (a Python loop per
  prompt took seconds at 10^5 prompts).
- :func:`seed_keys`: the keys of one seed per prompt, made in one vectorised call, each equal to
  ``jax.random.key(seed)`` (one dispatch per seed took ~13 ms: 10^5 seeds took minutes).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence

import jax
import numpy as np

from asps_jax import drafters, footprint
from asps_jax.checks import check_int, check_keywords  # noqa: F401  (the entry points')
from asps_jax.controls import Sampling
from asps_jax.verify import options as method_options

MAX_ROWS = 1 << 22
"""The most rows (prompts x ``n``) one call samples: past it the call is refused before the
prompts and keys are repeated (split it into several calls, or lower ``n``)."""

OUTPUT_FLAGS = ("return_logprobs",)
"""Keywords of the entry points that shape the output rather than the call (not ``prepare``'s)."""


def call_keywords(prepare) -> frozenset[str]:
    """Every keyword a sampling call takes: ``prepare``'s own, the output flags, the sampling
    arguments, the drafters' options and every verification method's options."""
    own = (
        p.name
        for p in inspect.signature(prepare).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    )
    return frozenset(
        (*own, *OUTPUT_FLAGS, *Sampling.names(), *drafters.OPTIONS, *method_options.NAMES)
    )


def sampling_arguments(sampling, kwargs: dict) -> dict:
    """The sampling arguments of a call, taken out of ``kwargs``: the flat keywords given
    (``temperature=...``), over the fields of ``sampling`` (a :class:`Sampling`, or None) where
    it is given: a flat keyword beside ``sampling=`` replaces that field, as
    ``dataclasses.replace(sampling, ...)`` would (docs/api.md)."""
    given = {name: kwargs.pop(name) for name in Sampling.names() if name in kwargs}
    if sampling is None:
        return given
    if not isinstance(sampling, Sampling):
        raise ValueError(
            f"sampling must be an asps_jax.Sampling (or None), got {type(sampling).__name__}"
        )
    fields = {name: getattr(sampling, name) for name in Sampling.names()}
    return {**{k: v for k, v in fields.items() if v is not None}, **given}


def call_options(options: dict, call: dict) -> dict:
    """A :class:`~asps_jax.session.Sampler` call's keywords over the sampler's ``options``: a
    keyword of the call replaces the sampler's, and the call's ``sampling=`` (a whole
    :class:`Sampling`) replaces every sampling argument of the sampler's, flat or not."""
    if call.get("sampling") is not None:
        dropped = {"sampling", *Sampling.names()}
        options = {k: v for k, v in options.items() if k not in dropped}
    return {**options, **call}


def check_rows(n, num_prompts: int) -> int:
    """``n`` as an int >= 1, refused in one line naming it when ``num_prompts x n`` rows pass
    :data:`MAX_ROWS` (before anything is repeated)."""
    n = check_int("n", n, 1)
    if num_prompts * n > MAX_ROWS:
        raise ValueError(
            f"n={n} samples per prompt x {num_prompts} prompt(s) = {num_prompts * n} rows, past "
            f"the bound of {MAX_ROWS} rows a call: lower n or split the prompts over several calls"
        )
    return n


def _seeds(seed) -> list:
    """The seeds as a list, each checked (an int in ``[0, 2**63)``)."""
    if isinstance(seed, np.ndarray) and seed.ndim > 1:
        raise ValueError(f"seed: give an int or one per prompt (1-D), got shape {seed.shape}")
    seeds = list(np.asarray(seed).reshape(-1).tolist()) if isinstance(seed, np.ndarray) else seed
    seeds = list(seeds) if isinstance(seeds, (list, tuple)) else [seeds]
    if isinstance(seed, np.ndarray) and seed.dtype.kind in "iu" and seed.size:
        low, high = int(seed.min()), int(seed.max())
        if low >= 0 and high < 2**63:  # checked at once: an array of ints needs no per-seed check
            return seeds
    for s in seeds:
        check_int("seed", s, 0)
        if int(s) >= 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {s!r}")
    return seeds


def seed_keys(key, seed, num_prompts: int):
    """The call's key from ``key`` or ``seed`` (exactly one given): a seed ``s`` is
    ``jax.random.key(s)``, one seed per prompt one key per prompt (made at once:
    :func:`keys_of_seeds`)."""
    if (key is None) == (seed is None):
        raise ValueError(
            "give key= (a PRNG key, or one per prompt) or seed= (an int, or one per prompt): "
            + ("both were given" if key is not None else "neither was given")
        )
    if seed is None:
        return key
    seeds = _seeds(seed)
    if not isinstance(seed, (list, tuple, np.ndarray)):
        return jax.random.key(int(seeds[0]))
    if len(seeds) != num_prompts:
        raise ValueError(
            f"seed: give one seed for the call or one per prompt ({num_prompts}), got {len(seeds)}"
        )
    return keys_of_seeds(seeds)


def keys_of_seeds(seeds) -> jax.Array:
    """``[jax.random.key(s) for s in seeds]`` stacked, made in one call: ``jax.random.key`` turns
    an int into ``int64`` and then into the default integer type (its low 32 bits without x64),
    and the default ``threefry2x32`` key of an integer is its high and low 32-bit halves (NumPy
    here); another implementation, or a seed offset, vmaps the seeds through ``jax.random.key``."""
    wide = np.asarray([int(s) for s in seeds] if not isinstance(seeds, np.ndarray) else seeds)
    wide = wide.astype(np.int64).reshape(-1)
    impl = jax.config.jax_default_prng_impl
    if impl != "threefry2x32" or jax.config.jax_random_seed_offset:
        return jax.vmap(jax.random.key)(jax.numpy.asarray(wide))
    high = (wide >> 32) & 0xFFFFFFFF
    if not jax.config.jax_enable_x64:
        high = np.zeros_like(high)  # the seed kept in 32 bits: its high half is 0
    data = np.stack([high, wide & 0xFFFFFFFF], axis=-1).astype(np.uint32)
    return jax.random.wrap_key_data(data, impl=impl)


_PROMPT_BUCKET, _CACHE_BUCKET, _BATCH_BUCKET = footprint.BUCKETS


def prompt_array(prompts, prompt_lengths, vocab_size: int):
    """``(int32[B', P] right-padded prompts, int32[B'] lengths, B)``: the B prompts checked
    (one-line errors), the batch padded to its bucket with rows of length 0 (they start done:
    fewer shapes, fewer compiles). Valid prompts are checked as one flat array; anything else
    goes through :func:`_check_rows`, which names the first prompt at fault."""
    if isinstance(prompts, (list, tuple)) and not prompts and prompt_lengths is None:
        raise ValueError("prompts: the list is empty; give at least one prompt")
    rows, lengths, flat = _rows(prompts, prompt_lengths)
    if lengths.size == 0:
        raise ValueError("prompts: at least one prompt is required")
    fine = flat is not None and flat.ndim == 1 and flat.dtype.kind in "iuf" and lengths.all()
    if fine and flat.size:
        fine = bool(np.all(np.isfinite(flat)) and np.all(flat == np.floor(flat)))
        fine = fine and 0 <= flat.min() and flat.max() < vocab_size
    if not fine:
        rows = rows()
        _check_rows(rows, vocab_size)
        lengths = np.fromiter(map(len, rows), np.int64, len(rows))
        flat = np.asarray([int(t) for t in itertools.chain.from_iterable(rows)], np.int64)
    batch = lengths.size
    padded_rows = footprint.round_up(batch, _BATCH_BUCKET) if batch > 1 else 1
    out_lengths = np.zeros(padded_rows, np.int32)
    out_lengths[:batch] = lengths
    width = footprint.round_up(int(lengths.max()), _PROMPT_BUCKET)
    out = np.zeros((padded_rows, width), np.int32)
    out[np.arange(width)[None, :] < out_lengths[:, None]] = flat.astype(np.int32)
    return out, out_lengths, batch


def _rows(prompts, prompt_lengths):
    """``(rows, int64[B] lengths, flat tokens or None)``: ``rows()`` makes the prompts as lists
    (for :func:`_check_rows`), ``flat`` their tokens in order as one array where NumPy reads
    them as such."""
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
        flat = arr[np.arange(arr.shape[1])[None, :] < lengths[:, None]]
        return (lambda: [arr[b, : lengths[b]].tolist() for b in range(arr.shape[0])]), lengths, flat
    if isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and any(isinstance(p, str) for p in prompts)
    ):
        raise ValueError(
            "prompts must be token ids, not text: encode it first, e.g. "
            "[model.tokenizer.encode(text)]"
        )
    if isinstance(prompts, (np.ndarray, jax.Array)) and np.ndim(prompts) == 2:
        arr = np.asarray(prompts)
        return arr.tolist, np.full(arr.shape[0], arr.shape[1], np.int64), arr.reshape(-1)
    if not isinstance(prompts, Sequence) or not all(
        isinstance(p, Sequence | np.ndarray) for p in prompts
    ):
        raise ValueError("prompts must be a list of token-id lists or an int32[B, P] array")
    rows = [p if type(p) is list else np.asarray(p).reshape(-1).tolist() for p in prompts]
    lengths = np.fromiter(map(len, rows), np.int64, len(rows))
    try:
        flat = np.asarray(list(itertools.chain.from_iterable(rows)))
    except (ValueError, TypeError, OverflowError):  # ragged nesting, huge ints: row by row
        flat = None
    return (lambda: [np.asarray(p).reshape(-1).tolist() for p in prompts]), lengths, flat


def _check_rows(rows: list, vocab_size: int) -> None:
    """The one-line error for the first prompt at fault (empty, non-integer or out of range)."""
    for b, row in enumerate(rows):
        if len(row) == 0:
            raise ValueError(f"prompts[{b}] is empty: every prompt needs at least one token")
        if any(isinstance(t, float) and t != int(t) for t in row):
            raise ValueError(f"prompts[{b}] holds non-integer token ids")
        bad = [t for t in row if not (0 <= int(t) < vocab_size)]
        if bad:
            raise ValueError(f"prompts[{b}] holds token ids outside [0, {vocab_size}): {bad[:5]}")
