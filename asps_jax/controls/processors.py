"""The one logits processor: logits -> float32 log-probabilities.

Draft sampling, target verification and the bonus token all go through :func:`process_logits`, so
the law a draft token was sampled from is exactly the law verification compares against. The order
is transformers' (``TemperatureLogitsWarper`` -> ``TopKLogitsWarper`` -> ``TopPLogitsWarper`` ->
``MinPLogitsWarper`` -> ``TypicalLogitsWarper``): temperature, then top-k (ties at the k-th value
are kept), then top-p (the smallest set of most likely tokens whose mass reaches ``top_p``, keeping
at least one token), then min-p (tokens less likely than ``min_p`` times the most likely one go),
then typical-p (the tokens whose surprisal is closest to the entropy, up to ``typical_p`` of mass).
Each numeric control is declared once, in :data:`CONTROLS`. The path-dependent controls
(logit bias, penalties, n-grams) come before all of these, in :mod:`asps_jax.controls.penalties`.

``temperature``, ``top_k`` and ``top_p`` may be Python numbers or traced scalars: changing them does
not recompile. ``temperature == 0`` gives a point mass on the (first) argmax; ``top_k <= 0`` or
``top_k >= V`` disables top-k; ``top_p >= 1`` disables top-p. :class:`SamplingParams` holds them
per row for the decoding loop.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax.checks import known_keywords
from asps_jax.draws import draw_categorical
from asps_jax.logspace import NEG_INF, log_normalize


def validate_sampling_args(temperature=None, top_k=None, top_p=None, min_p=None) -> None:
    """Raise ``ValueError`` for sampling parameters outside their domain (host-side check, by
    their declarations: :data:`CONTROLS`)."""
    given = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    for name, value in given.items():
        if value is not None and not CONTROL[name].check(float(value)):
            raise ValueError(f"{name} must be {CONTROL[name].expected}, got {value!r}")


@known_keywords()
def process_logits(
    logits_V: jax.Array,
    temperature: float | jax.Array = 1.0,
    top_k: int | jax.Array | None = None,
    top_p: float | jax.Array | None = None,
    min_p: float | jax.Array | None = None,
    typical_p: float | jax.Array | None = None,
) -> jax.Array:
    """Map logits ``[..., V]`` to float32 log-probabilities ``[..., V]`` (``-inf`` = excluded).

    NaN logits are treated as ``-inf``; a row with every logit ``-inf`` stays all ``-inf`` (callers
    that sample from it must check, see ``decode``); ``+inf`` counts as the largest logit (its law
    is unusable by :func:`logits_ok`).
    """
    logits, scaled, greedy = _scaled(logits_V, temperature)
    vocab = logits.shape[-1]

    # --- Step 2: top-k; keep every logit >= the k-th largest (ties kept, as transformers) ---
    # Both filters find their threshold by bisection over the logits' order-preserving 32-bit
    # keys (32 passes of a compare and a sum over V) instead of sorting V logits: the same
    # threshold, far cheaper at real vocabularies.
    keys = _order_keys(scaled)
    if top_k is not None:
        k_eff = _k_eff(top_k, vocab)
        # The k-th largest: the largest key with at least k logits at or above it.
        kth = _from_key(_bisect(keys, lambda t: jnp.sum(keys >= t[..., None], -1) >= k_eff, True))
        scaled = jnp.where(scaled < kth[..., None], NEG_INF, scaled)

    # --- Step 3: top-p over the (top-k filtered) law; transformers removes a token when the
    # ascending cumulative mass up to and including it is <= 1 - top_p, always keeping the top one.
    if top_p is not None:
        p = jnp.asarray(top_p, jnp.float32)
        probs = jnp.exp(log_normalize(scaled))
        # Threshold: the smallest logit with less than top_p of mass strictly above it (the
        # same cut as transformers' ascending mass <= 1 - top_p, without rounding 1 - top_p: a
        # tiny top_p keeps the top logit alone); everything strictly below it goes. Ties with it
        # are kept (transformers scatters by index; identical ties straddling the cut are a
        # measure-zero event for real logits). Key 0 (nothing above 0) keeps every logit.
        cut = _bisect(
            keys, lambda t: jnp.sum(jnp.where(keys > t[..., None], probs, 0.0), -1) < p, False
        )
        threshold = jnp.where(cut == 0, NEG_INF, _from_key(cut))[..., None]
        scaled = jnp.where((scaled < threshold) & (p < 1.0), NEG_INF, scaled)

    return _finish(logits, scaled, greedy, min_p, typical_p)


def process_logits_from_top(
    logits_V: jax.Array,
    temperature: float | jax.Array = 1.0,
    top_k: int | jax.Array | None = None,
    top_p: float | jax.Array | None = None,
    min_p: float | jax.Array | None = None,
    typical_p: float | jax.Array | None = None,
    *,
    width: int = 64,
) -> tuple[jax.Array, jax.Array]:
    """:func:`process_logits` from the ``width`` largest logits of each row, and whether that is
    exact, bool ``[...]``.

    The top-k and top-p thresholds are read off ``lax.top_k(·, width)`` (one partial sort)
    instead of 64 passes over V. That is the same cut whenever it lies among those candidates:
    top-k with ``k <= width`` (or disabled), and top-p when the mass strictly above the
    ``width``-th largest logit already reaches ``top_p``. A row where it may not is flagged not
    exact (its output is then wrong): callers fall back to :func:`process_logits` for the batch
    (``SamplingParams.process``). The k-th largest value is the same bit for bit; the top-p mass
    sums the same nonzero terms in another order, so a cut can differ only when the mass above a
    logit is within float32 rounding of ``top_p``.
    """
    logits, scaled, greedy = _scaled(logits_V, temperature)
    vocab = logits.shape[-1]
    width = min(width, vocab)
    values, index = jax.lax.top_k(scaled, width)  # descending
    rows = values.shape[:-1]
    exact = jnp.ones(rows, bool)
    if top_k is not None:
        k_eff = jnp.broadcast_to(_k_eff(top_k, vocab), rows)
        kth = jnp.take_along_axis(values, jnp.minimum(k_eff, width)[..., None] - 1, -1)
        kth = jnp.where(k_eff[..., None] >= vocab, NEG_INF, kth)  # disabled: keeps everything
        exact &= (k_eff <= width) | (k_eff >= vocab)
        scaled = jnp.where(scaled < kth, NEG_INF, scaled)
        values = jnp.where(values < kth, NEG_INF, values)
    if top_p is not None:
        p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), rows)
        probs = jnp.exp(jnp.take_along_axis(log_normalize(scaled), index, -1))
        # The mass strictly above each candidate; every logit above one is a candidate.
        above = jnp.sum(
            jnp.where(values[..., None, :] > values[..., :, None], probs[..., None, :], 0.0), -1
        )
        # The smallest candidate with less than top_p above it; past the last candidate the
        # cut would lie outside them unless the mass above the last reaches top_p.
        threshold = jnp.min(jnp.where(above < p[..., None], values, jnp.inf), -1, keepdims=True)
        exact &= (p >= 1.0) | (above[..., -1] >= p)
        scaled = jnp.where((scaled < threshold) & (p[..., None] < 1.0), NEG_INF, scaled)
    finished = _finish(logits, scaled, greedy, min_p, typical_p)
    return finished, exact | jnp.broadcast_to(greedy, rows)


def _scaled(logits_V, temperature):
    """The logits as float32 (NaN -> -inf), divided by the temperature, and the greedy flag."""
    logits = jnp.asarray(logits_V, jnp.float32)
    logits = jnp.where(jnp.isnan(logits), NEG_INF, logits)
    temperature = jnp.asarray(temperature, jnp.float32)
    greedy = temperature <= 0.0
    # --- Step 1: temperature (guarded so the greedy branch never divides by zero; finite logits
    # that overflow when divided stay finite, so the largest one keeps its mass) ---
    scaled = logits / jnp.where(greedy, 1.0, temperature)
    return logits, jnp.minimum(scaled, jnp.finfo(jnp.float32).max), greedy


def _k_eff(top_k, vocab):
    """The number of logits top-k keeps at least (V when disabled: k <= 0 or k >= V)."""
    k = jnp.asarray(top_k, jnp.int32)
    return jnp.where((k <= 0) | (k >= vocab), vocab, k)


def _finish(logits, scaled, greedy, min_p, typical_p=None):
    """Normalise the filtered logits, apply min-p and typical-p, and the greedy point mass."""
    vocab = logits.shape[-1]
    logprobs = log_normalize(scaled)

    # --- Step 4: min-p (transformers' MinPLogitsWarper): drop every token whose probability is
    # below min_p times the most likely one's; the most likely token always stays.
    if min_p is not None:
        mp = jnp.asarray(min_p, jnp.float32)
        cut = jnp.max(logprobs, axis=-1, keepdims=True) + jnp.log(jnp.where(mp > 0, mp, 1.0))
        logprobs = log_normalize(jnp.where((logprobs < cut) & (mp > 0), NEG_INF, logprobs))
    if typical_p is not None:
        logprobs = _typical(logprobs, typical_p)

    # --- Greedy: point mass on the first argmax of the raw logits ---
    # (a row with no finite logit has no argmax: it stays all -inf, as at temperature > 0).
    argmax = jnp.argmax(logits, axis=-1)
    # (NaN is -inf here; a row with +inf logits fails `logits_ok` and emits nothing.)
    has_finite = jnp.max(logits, axis=-1, keepdims=True) > NEG_INF
    point = jnp.where(jax.nn.one_hot(argmax, vocab, dtype=bool) & has_finite, 0.0, NEG_INF)
    return jnp.where(greedy, point, logprobs)


def _typical(logprobs, typical_p):
    """--- Step 5: typical-p (transformers' ``TypicalLogitsWarper``, ``min_tokens_to_keep`` 1):
    rank the tokens by how far their surprisal is from the law's entropy, ``|-log p - H|``
    ascending, and keep them up to the first at which their mass reaches ``typical_p`` (ties at
    its distance kept); 1 keeps the law as it is. The distance at the cut is found by bisection
    over its order keys (no sort over V): the smallest with at least ``typical_p`` of mass at or
    below it."""
    mass = jnp.asarray(typical_p, jnp.float32)
    probs = jnp.exp(logprobs)
    entropy = -jnp.sum(jnp.where(probs > 0, probs * logprobs, 0.0), -1, keepdims=True)
    keys = _order_keys(jnp.abs(-logprobs - entropy))  # +inf (excluded tokens) last
    cut = _bisect(
        keys, lambda t: jnp.sum(jnp.where(keys <= t[..., None], probs, 0.0), -1) >= mass, False
    )  # (never reached, in float32 rounding: 2**32 - 1, every token kept)
    typical = log_normalize(jnp.where(keys <= cut[..., None], logprobs, NEG_INF))
    return jnp.where(mass < 1.0, typical, logprobs)


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys of float32 ``x`` in the same order (-inf lowest; -0.0 just below +0.0)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    flipped = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
    return jax.lax.bitcast_convert_type(flipped, jnp.uint32) ^ jnp.uint32(0x80000000)


def _from_key(key: jax.Array) -> jax.Array:
    """The float32 of an :func:`_order_keys` key."""
    bits = jax.lax.bitcast_convert_type(key ^ jnp.uint32(0x80000000), jnp.int32)
    return jax.lax.bitcast_convert_type(
        jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits), jnp.float32
    )


def _bisect(keys: jax.Array, holds, largest: bool) -> jax.Array:
    """uint32[...]: the largest key t with ``holds(t)`` (``largest``; holds is monotone
    non-increasing and true at 0), or the smallest (holds non-decreasing; 2**32 - 1 when it
    never holds), over all 2**32 keys: 32 halvings of ``[lo, hi]``."""
    lo = jnp.zeros(keys.shape[:-1], jnp.uint32)
    hi = jnp.full(keys.shape[:-1], 0xFFFFFFFF, jnp.uint32)

    def halve(_, bounds):
        lo, hi = bounds
        gap = hi - lo
        if largest:  # the upper middle, so lo moves up
            mid = lo + (gap >> 1) + (gap & 1)
            ok = holds(mid)
            new = jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)
        else:
            mid = lo + (gap >> 1)
            ok = holds(mid)
            new = jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)
        done = gap == 0  # converged: stays (no step past the ends of the key range)
        return jnp.where(done, lo, new[0]), jnp.where(done, hi, new[1])

    lo, hi = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return lo


def logits_ok(logits_V: jax.Array) -> jax.Array:
    """bool ``[...]``: the law of ``logits[..., V]`` is usable, i.e. no logit is NaN or ``+inf``
    and at least one is finite (``-inf`` masks a token and is fine). The decoding loop stops a row
    at the first law that is not."""
    # One reduction (one all-reduce where the vocabulary is split over chips): the largest logit
    # is NaN when any is (max propagates NaN), +inf when any is, and -inf when none is finite.
    return jnp.isfinite(jnp.max(jnp.asarray(logits_V), axis=-1))


def sample_token(key: jax.Array, logprobs_V: jax.Array) -> jax.Array:
    """Draw one token per row from log-probs ``[..., V]``, exactly from their normalised law (no
    far-tail cut-off; ``-inf`` is never drawn; see :mod:`asps_jax.draws`)."""
    return draw_categorical(key, logprobs_V)


def ngram_window(sizes) -> int:
    """The static bound of the n-gram comparison for the largest ``no_repeat_ngram_size``: 0 when
    no row uses n-grams, else a power of two >= 4, so that most changes of n do not recompile."""
    largest = int(max(sizes, default=0))
    return 0 if largest <= 0 else max(4, 1 << (largest - 1).bit_length())


_F32_MAX = float(np.finfo(np.float32).max)


def _in_float32(v: float) -> bool:
    """``v`` stays finite in float32."""
    return math.isfinite(v) and abs(v) <= _F32_MAX


def _integral(v: float) -> bool:
    return math.isfinite(v) and v == int(v)


@dataclasses.dataclass(frozen=True)
class Control:
    """One per-row numeric sampling control, declared once: the :class:`SamplingParams` field and
    the :class:`~asps_jax.controls.sampling.Sampling` field of that name (whose metadata "control"
    it is).

    Attributes:
      name: the keyword (``sample(top_p=...)``), the ``Sampling`` and ``SamplingParams`` field.
      dtype: the dtype of its per-row array in the loop.
      neutral: the value that turns it off, which a call that does not give it gets (a name:
        that control's value, ``draft_temperature``'s is the temperature's).
      check: valid(v) for each value as a Python float, checked when a ``Sampling`` is made, in
        float32 where that matters (what the device uses: 1e39 is finite here and inf there).
      expected: what a valid value is, the end of the one-line error "NAME must be EXPECTED, got
        VALUE".
      role: "filter": a filter of :func:`process_logits`, compiled only when the call gives it
        (:attr:`SamplingParams.filters`); "penalty": a path-dependent penalty of
        :mod:`asps_jax.controls.penalties` (:attr:`SamplingParams.penalized`); "limit": a length
        control (:attr:`SamplingParams.limited`); "" for the rest.
    """

    name: str
    dtype: type
    neutral: float | str
    check: Callable[[float], bool]
    expected: str
    role: str = ""


_TEMPERATURE = "a finite number >= 0 (at most 3.4e38)"
_FLOAT32 = "a finite number that float32 holds (0 disables it; |value| at most 3.4e38)"

CONTROLS = (
    Control("temperature", jnp.float32, 1.0, lambda v: 0.0 <= v <= _F32_MAX, _TEMPERATURE),
    Control("draft_temperature", jnp.float32, "temperature", lambda v: 0.0 <= v <= _F32_MAX,
            _TEMPERATURE),
    Control("top_k", jnp.int32, 0, lambda v: _integral(v) and v >= 0,
            "an integer >= 0 (0 or None disables it)", "filter"),
    Control("top_p", jnp.float32, 1.0, lambda v: 0.0 < v <= 1.0 and np.float32(v) > 0,
            "in (0, 1]", "filter"),
    Control("min_p", jnp.float32, 0.0, lambda v: 0.0 <= v <= 1.0, "in [0, 1] (0 disables it)",
            "filter"),
    Control("typical_p", jnp.float32, 1.0, lambda v: 0.0 < v <= 1.0 and np.float32(v) > 0,
            "in (0, 1] (1 disables it)", "filter"),
    Control("repetition_penalty", jnp.float32, 1.0,
            lambda v: 0.0 < v <= _F32_MAX and np.float32(v) > 0,
            "a finite number > 0 that float32 holds (1 disables it; at most 3.4e38)", "penalty"),
    Control("presence_penalty", jnp.float32, 0.0, _in_float32, _FLOAT32, "penalty"),
    Control("frequency_penalty", jnp.float32, 0.0, _in_float32, _FLOAT32, "penalty"),
    Control("no_repeat_ngram_size", jnp.int32, 0, lambda v: _integral(v) and v >= 0,
            "an integer >= 0 (0 disables it)"),
    Control("min_tokens", jnp.int32, 0, lambda v: _integral(v) and 0 <= v < 2**31,
            "an integer >= 0 and at most 2**31 - 1 (0 disables it; from max_new_tokens on it "
            "bans EOS throughout)", "limit"),
)  # fmt: skip
"""Every per-row numeric sampling control, in the order they are checked. Adding one: a
:class:`Control` here, its field in :class:`SamplingParams` and in
:class:`~asps_jax.controls.sampling.Sampling`, and the code that applies it (docs/design.md)."""

CONTROL = {c.name: c for c in CONTROLS}


def _some_row_uses(*filters) -> jax.Array:
    """bool[]: some row uses one of the compiled filters, each given as ``(its per-row values, or
    None when not compiled, the test of a row that uses it)``: a batch-level predicate that lets
    :meth:`SamplingParams.process` skip the filters no row uses at run time."""
    used = jnp.zeros((), bool)
    for values, uses in filters:
        if values is not None:
            used |= jnp.any(uses(values))
    return used


def _laid_out(sharding: str):
    """An array field (no default) with its layout over the batch: ``dataclasses.field``
    metadata "sharding", in the vocabulary of :func:`asps_jax.sharding.shard_inputs`."""
    return dataclasses.field(metadata=dict(sharding=sharding))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling parameters and the EOS ids, passed as arrays: changing them never
    recompiles, and rows of one batch may sample with different settings.

    Attributes:
      temperature: float32[B], the target's temperature (0 = greedy).
      draft_temperature: float32[B], the temperature the draft samples at.
      top_k: int32[B], 0 disables.
      top_p: float32[B], 1 disables.
      eos_ids: int32[num_eos]; a row stops at its first token in this set; -1 entries unused.
      min_p: float32[B], 0 disables.
      repetition_penalty: float32[B], 1 disables.
      presence_penalty, frequency_penalty: float32[B], 0 disables.
      no_repeat_ngram_size: int32[B], 0 disables.
      logit_bias: float32[B, V] added to the logits first (-inf bans), or float32[B, 1] zeros
        when no row has a bias.
      ngram_window: static int, :func:`ngram_window` of the rows' n-gram sizes (0: none; the
        n-gram code is then not compiled at all).
      dfa_classes: int32[V], each token's class in the stacked constraint DFAs, or int32[1]
        when no row is constrained.
      dfa_next: int32[S, C], the stacked constraint DFAs over the token classes (-1 = forbidden;
        state 0 the sink, 1 the free state of unconstrained rows), or int32[1, 1].
      dfa_final: bool[S], the accepting states.
      dfa_start: int32[B], each row's start state.
      constrained: static bool, some row has a constraint (else none of its code is compiled).
      filters: static, the names of the filters the call gives (``"top_k"``, ``"top_p"``,
        ``"min_p"``, ``"typical_p"``): only their code is compiled (their values stay arrays:
        changing one does not recompile; giving one the call did not give compiles once).
      penalized: static bool, the call gives a repetition, presence or frequency penalty or a
        logit bias (else none of that code is compiled).
      draft_stop: float32[B], the confidence stop τ of each row (``draft_stop="confidence:τ"``:
        a draft chain stops growing at the first draft law whose top probability is below τ;
        read only by a draft model's rollout built with the stop,
        ``drafters.ModelDraft(confidence_stop=True)``; 0 never stops).
      min_tokens: int32[B], the EOS ids are banned while a row has generated fewer tokens
        (transformers' ``MinNewTokensLengthLogitsProcessor``, vLLM's ``min_tokens``), and stop
        strings are not matched before; 0 disables.
      bad_words: int32[B, W, L], token sequences (-1 padded on the left, so each ends in the
        last column) a row never generates: a one-token one is banned everywhere, a longer one's
        last token wherever the text ends with its other tokens (transformers'
        ``NoBadWordsLogitsProcessor``); int32[B, 0, 1] when no row has one.
      limited: static bool, the call gives ``min_tokens`` (else none of its code is compiled;
        ``bad_words`` is compiled when W > 0, its shape).
      typical_p: float32[B], 1 disables.
    See :mod:`asps_jax.controls.constraints`.
    The controls (bias, penalties, n-grams) depend on each node's path: they are applied by
    :mod:`asps_jax.controls.penalties`; :meth:`process` does temperature, top-k, top-p, min-p and
    typical-p.
    """

    # Each array field declares its layout (read by :meth:`row_fields` and by
    # :func:`asps_jax.sharding.shard_inputs`): "rows" = one entry per row (split along the batch,
    # repeated per draft), "replicated" = one value for all rows.
    temperature: jax.Array = _laid_out("rows")
    draft_temperature: jax.Array = _laid_out("rows")
    top_k: jax.Array = _laid_out("rows")
    top_p: jax.Array = _laid_out("rows")
    eos_ids: jax.Array = _laid_out("replicated")
    min_p: jax.Array = _laid_out("rows")
    repetition_penalty: jax.Array = _laid_out("rows")
    presence_penalty: jax.Array = _laid_out("rows")
    frequency_penalty: jax.Array = _laid_out("rows")
    no_repeat_ngram_size: jax.Array = _laid_out("rows")
    logit_bias: jax.Array = _laid_out("rows")
    dfa_classes: jax.Array = _laid_out("replicated")
    dfa_next: jax.Array = _laid_out("replicated")
    dfa_final: jax.Array = _laid_out("replicated")
    dfa_start: jax.Array = _laid_out("rows")
    draft_stop: jax.Array = _laid_out("rows")
    min_tokens: jax.Array = _laid_out("rows")
    bad_words: jax.Array = _laid_out("rows")
    typical_p: jax.Array = _laid_out("rows")
    ngram_window: int = dataclasses.field(default=0, metadata=dict(static=True))
    constrained: bool = dataclasses.field(default=False, metadata=dict(static=True))
    filters: tuple[str, ...] = dataclasses.field(default=(), metadata=dict(static=True))
    penalized: bool = dataclasses.field(default=False, metadata=dict(static=True))
    limited: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @classmethod
    def make(
        cls,
        batch,
        temperature=1.0,
        top_k=None,
        top_p=None,
        draft_temperature=None,
        eos_ids=(),
        *,
        logit_bias=None,
        constraint=None,
        draft_stop=None,
        bad_words=None,
        **controls,
    ):
        """``controls``: the other numeric controls of :data:`CONTROLS` (``min_p=...``), each a
        scalar or one per row. ``constraint``: None, or ``(classes int32[V], next int32[S, C],
        final bool[S], start int32[B])`` from :func:`asps_jax.controls.constraints.stack`. A
        control or filter left None is absent: its code is not compiled (:attr:`filters`,
        :attr:`penalized`, :attr:`limited`)."""
        unknown = sorted(set(controls) - set(CONTROL))
        if unknown:
            raise TypeError(f"SamplingParams.make() got an unexpected keyword {unknown[0]!r}")
        given = dict(temperature=temperature, top_k=top_k, top_p=top_p, **controls)
        given.update(draft_temperature=draft_temperature)

        def rows(value, dtype, default):
            value = default if value is None else value
            return jnp.broadcast_to(jnp.asarray(value, dtype), (batch,))

        values = {}
        for c in CONTROLS:  # a neutral value that names a control: that control's rows
            off = isinstance(c.neutral, str) and given.get(c.name) is None
            values[c.name] = (
                values[c.neutral] if off else rows(given.get(c.name), c.dtype, c.neutral)
            )

        def role(name):
            return tuple(
                c.name for c in CONTROLS if c.role == name and given.get(c.name) is not None
            )

        bias = jnp.zeros((batch, 1), jnp.float32)
        if logit_bias is not None:
            bias = jnp.asarray(logit_bias, jnp.float32)
            bias = jnp.broadcast_to(bias, (batch, bias.shape[-1]))
        words = jnp.zeros((batch, 0, 1), jnp.int32)
        if bad_words is not None and np.asarray(bad_words).size:
            words = jnp.asarray(bad_words, jnp.int32)
            words = jnp.broadcast_to(words, (batch,) + words.shape[-2:])
        ngram = values["no_repeat_ngram_size"]
        return cls(
            **values,
            eos_ids=jnp.asarray(list(eos_ids) or [-1], jnp.int32),
            logit_bias=bias,
            dfa_classes=jnp.zeros((1,), jnp.int32) if constraint is None else constraint[0],
            dfa_next=jnp.full((1, 1), -1, jnp.int32) if constraint is None else constraint[1],
            dfa_final=jnp.zeros((1,), bool) if constraint is None else constraint[2],
            dfa_start=rows(None if constraint is None else constraint[3], jnp.int32, 0),
            draft_stop=rows(draft_stop, jnp.float32, 0.0),
            bad_words=words,
            ngram_window=ngram_window(np.asarray(ngram).reshape(-1).tolist()),
            constrained=constraint is not None,
            filters=role("filter"),
            penalized=bool(role("penalty")) or logit_bias is not None,
            limited=bool(role("limit")),
        )

    @classmethod
    def array_fields(cls) -> tuple[str, ...]:
        """The names of the array fields (the static ``ngram_window`` left out)."""
        return tuple(f.name for f in dataclasses.fields(cls) if not f.metadata.get("static"))

    @classmethod
    def row_fields(cls) -> tuple[str, ...]:
        """The names of the per-row array fields (the others hold one value for all rows)."""
        fields = dataclasses.fields(cls)
        return tuple(f.name for f in fields if f.metadata.get("sharding") == "rows")

    def process(self, logits_BV: jax.Array, *, draft: bool = False) -> jax.Array:
        """Row-wise :func:`process_logits` of ``logits[B, ..., V]`` with each row's parameters
        (temperature, top-k, top-p, min-p, typical-p; the path-dependent controls come first, see
        :func:`asps_jax.controls.penalties.process`)."""
        temperature = self.draft_temperature if draft else self.temperature
        # Only the filters the call gives are compiled (static); among those, batch-level
        # predicates skip the ones no row uses at run time (real branches: a per-row cond under
        # vmap would run both sides).
        top_k = self.top_k if "top_k" in self.filters else None
        top_p = self.top_p if "top_p" in self.filters else None
        min_p = self.min_p if "min_p" in self.filters else None
        typical_p = self.typical_p if "typical_p" in self.filters else None
        cuts = (min_p, typical_p)  # applied to the normalised law, after top-k and top-p

        def filtered(logits):
            # The thresholds from each row's 64 largest logits (one partial sort), and where
            # some row's cut may lie past them (top-k over 64, a top-p nucleus wider than 64
            # tokens) the 64 passes of process_logits' bisection for the batch.
            fast, exact = jax.vmap(process_logits_from_top)(
                logits, temperature, top_k, top_p, *cuts
            )

            def bisected(logits):
                return jax.vmap(process_logits)(logits, temperature, top_k, top_p, *cuts)

            return jax.lax.cond(jnp.all(exact), lambda _: fast, bisected, logits)

        def cuts_only(logits):  # min-p and typical-p need no sort
            return jax.vmap(process_logits)(logits, temperature, None, None, *cuts)

        def temperature_only(logits):  # no V-sized sort: the common case, and much cheaper
            return jax.vmap(process_logits)(logits, temperature)

        def unsorted(logits):
            if min_p is None and typical_p is None:
                return temperature_only(logits)
            used = _some_row_uses((min_p, lambda v: v > 0.0), (typical_p, lambda v: v < 1.0))
            return jax.lax.cond(used, cuts_only, temperature_only, logits)

        if top_k is None and top_p is None:
            return unsorted(logits_BV)
        any_filter = _some_row_uses((top_k, lambda v: v > 0), (top_p, lambda v: v < 1.0))
        return jax.lax.cond(any_filter, filtered, unsorted, logits_BV)

    def repeat(self, k: int) -> SamplingParams:
        """The parameters of rows ``b * k + j`` (K draft replicas per row)."""
        rep = functools.partial(jnp.repeat, repeats=k, axis=0)
        return dataclasses.replace(
            self, **{name: rep(getattr(self, name)) for name in self.row_fields()}
        )
