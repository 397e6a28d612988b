"""A sampling call made ready to run (:func:`prepare`), and its output (:func:`finish`): the
host edge under ``asps_jax.sample`` / ``stream`` / ``Session`` (:mod:`asps_jax.session`).

:func:`prepare` validates everything that can be validated before compiling (the method and the
drafter through :mod:`asps_jax.plan`, the sampling arguments through
:class:`asps_jax.controls.sampling.Sampling`, prompts, budgets, context length and memory), pads
ragged prompts to a bucketed width so that calls with different prompt contents and lengths rarely
recompile, derives one key per row, and lowers the call to the static
:class:`~asps_jax.decode.Decoder` and its :class:`DecodeInputs`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax import (
    arguments,
    compile_cache,
    controls,
    decode,
    drafters,
    footprint,
    plan,
    sharding,
    slots,
    statistics,
)
from asps_jax.checks import check_int
from asps_jax.controls import HostConstraint, Sampling, SamplingParams, bad_words_per_prompt
from asps_jax.models.base import run_params
from asps_jax.plan import MAX_TREE_NODES, METHODS, check_memory  # noqa: F401  (the API's names)
from asps_jax.verify import registry

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
      raw_logprobs: float32[B, M] with ``return_logprobs=True, raw_logprobs=True`` (else None):
        each emitted token's log-probability under the *unprocessed* target law,
        ``log_softmax(logits)`` of the target's logits at temperature 1 with no control, filter,
        bias or constraint (the policy's own law, what policy-gradient losses and importance
        ratios need; :attr:`logprobs` is the law the token was actually drawn from). 0.0 after
        ``lengths[b]``.
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
    raw_logprobs: jax.Array | None = None


_round_up = footprint.round_up


_as_prompt_array = arguments.prompt_array


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
            check_int("max_new_tokens", v, 1)
        return [int(v) for v in values]
    return [check_int("max_new_tokens", max_new_tokens, 1)] * batch


def _row_keys(key, batch: int, padded: int) -> jax.Array:
    """One key per row: ``fold_in(key, row)`` for a single key, or the given per-row keys."""
    key = _as_keys(key)
    if key.shape == ():
        return jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(padded))
    if key.shape == (batch,):
        return jnp.concatenate([key, jnp.repeat(key[:1], padded - batch)])
    raise ValueError(
        f"key must be a single PRNG key or one key per prompt ([{batch}]), got {key.shape}"
    )


def _as_keys(key) -> jax.Array:
    """``key`` as typed PRNG key(s) (raw ``uint32`` key data is wrapped)."""
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))
    return key


def _repeated(n: int, num_prompts: int, name: str, value):
    """A per-prompt argument for ``n`` samples per prompt: a list (or array) of one value per
    prompt repeated, each value ``n`` times in a row; a value for every prompt unchanged."""
    per_prompt = isinstance(value, (list, tuple)) or (
        isinstance(value, (np.ndarray, jax.Array)) and np.ndim(value) == 1
    )
    if name == "bad_words":  # a list of words is for every row; a list of such lists per prompt
        per_prompt = bad_words_per_prompt(value)
    if not per_prompt or name == "eos_token_id":  # eos_token_id: a list of ids, for every row
        return value
    if len(value) != num_prompts:
        raise ValueError(
            f"{name}: give one value for all prompts or one per prompt ({num_prompts}), got "
            f"{len(value)}"
        )
    return [v for v in list(value) for _ in range(n)]


def _samples(n, key, seed, prompts, prompt_lengths, max_new_tokens, given, vocab: int):
    """``n`` samples per prompt (``n`` = 1: the call unchanged but for ``seed``): every prompt
    and per-prompt argument repeated, prompt-major (row ``p * n + i`` is prompt p's sample i),
    and one key per row, ``fold_in(k_p, i)`` of prompt p's key ``k_p`` (``fold_in(key, p)`` of a
    single key, or its own), so a prompt's samples depend only on its key and their index.
    Returns ``(prompts, prompt_lengths, max_new_tokens, sampling arguments, key)``."""
    n = check_int("n", n, 1)
    if n == 1 and not isinstance(seed, (list, tuple, np.ndarray)):
        return prompts, prompt_lengths, max_new_tokens, given, arguments.seed_keys(key, seed, 1)
    rows_bp, lengths_b, num = _as_prompt_array(prompts, prompt_lengths, vocab)
    n = arguments.check_rows(n, num)  # before anything is repeated
    key = _as_keys(arguments.seed_keys(key, seed, num))
    if key.shape == ():
        key = jax.vmap(lambda p: jax.random.fold_in(key, p))(jnp.arange(num))
    elif key.shape != (num,):
        raise ValueError(
            f"key must be a single PRNG key or one key per prompt ([{num}]), got {key.shape}"
        )
    if n > 1:
        fold = jax.vmap(jax.vmap(jax.random.fold_in, (None, 0)), (0, None))
        key = fold(key, jnp.arange(n)).reshape(-1)
    rows, lengths = np.repeat(rows_bp[:num], n, axis=0), np.repeat(lengths_b[:num], n)
    budgets = _repeated(n, num, "max_new_tokens", max_new_tokens)
    given = {name: _repeated(n, num, name, value) for name, value in given.items()}
    return rows, lengths, budgets, given, key


def check_logprob_options(top_logprobs, return_logprobs, vocab: int, raw_logprobs=False) -> int:
    """``top_logprobs`` as an int in ``[0, vocab]`` (None: 0), given with ``return_logprobs``
    (and so is ``raw_logprobs=True``)."""
    if not isinstance(return_logprobs, (bool, np.bool_)):
        raise ValueError(f"return_logprobs must be True or False, got {return_logprobs!r}")
    if not isinstance(raw_logprobs, bool):
        raise ValueError(f"raw_logprobs must be True or False, got {raw_logprobs!r}")
    if raw_logprobs and not return_logprobs:
        raise ValueError("raw_logprobs needs return_logprobs=True (the log-probs come with them)")
    k = check_int("top_logprobs", 0 if top_logprobs is None else top_logprobs, 0)
    if k > vocab:
        raise ValueError(f"top_logprobs must be at most the vocabulary size {vocab}, got {k}")
    if k and not return_logprobs:
        raise ValueError("top_logprobs needs return_logprobs=True (the log-probs come with them)")
    return k


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
      sampling: the per-row :class:`~asps_jax.controls.processors.SamplingParams`.
      prompts_BP: int32[B, P], right-padded prompts (``B`` a padded batch).
      prompt_lengths_B: int32[B]; 0 for the padding rows (they start done).
      row_keys_B: one PRNG key per row.
      stop: the call's :class:`~asps_jax.controls.controls.StopStrings`, or None (with
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
    stop: controls.StopStrings | None = _layout(sharding.FIELDS, None)
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


def _placed(decoder, inputs: DecodeInputs, rows: int, mesh, target, draft) -> DecodeInputs:
    """The inputs on the mesh (jit propagates their shardings through the whole loop), the
    parameters in each model's fast run layout for the rows it multiplies per forward
    (:func:`wide_layouts` of ``rows``, the rows each step runs; made once per model and layout).
    Several processes must make the same call (:func:`_check_same_everywhere`)."""
    _check_same_everywhere(mesh, decoder, inputs)
    if mesh is not None:
        inputs = sharding.shard_inputs(
            inputs, mesh, {"target_params": target, "draft_params": draft}
        )
    wide = wide_layouts(decoder.spec, rows)
    changes = {}
    for name, model in (("target_params", target), ("draft_params", draft)):
        if getattr(inputs, name) is not None:
            changes[name] = run_params(model, getattr(inputs, name), wide=wide[name])
    return dataclasses.replace(inputs, **changes)


def wide_layouts(spec: decode.SpecConfig, rows: int) -> dict[str, bool]:
    """Which model runs on its wide layout (:func:`asps_jax.models.base.run_params`): the one for
    forwards of two or more rows. Per step the target scores ``rows`` times the tree's nodes (one
    token each under ``ar``), the draft rolls out ``rows`` times its replicas."""
    if not spec.uses_draft:
        return {"target_params": rows >= 2, "draft_params": False}
    return {"target_params": True, "draft_params": rows * spec.tree.num_chains >= 2}


def prepare(
    target,
    draft,
    prompts,
    *,
    key=None,
    max_new_tokens,
    seed=None,
    n=1,
    method=registry.DEFAULT_METHOD,
    num_draft_tokens=None,
    num_drafts=None,
    tree=None,
    stop=None,
    mesh=None,
    prompt_lengths=None,
    diagnostics=False,
    top_logprobs=0,
    raw_logprobs=False,
    batch_size=None,
    sampling=None,
    **kwargs,
) -> Prepared:
    """Validate the arguments of :func:`asps_jax.sample` and lower them: the :class:`Prepared`
    call (the static :class:`~asps_jax.decode.Decoder`, the :class:`DecodeInputs`, the number of
    rows). Checks (one-line errors, nothing built), lowering, placing (mesh, run layout).

    ``kwargs``: the sampling arguments (:class:`~asps_jax.controls.sampling.Sampling`, one value
    or one per prompt, over ``sampling=``'s fields), drafters' options, the method's options.
    ``key`` or ``seed``: a PRNG key or an int, or one per prompt. ``n``: samples per prompt, rows
    ``p * n + i`` (:func:`_samples`: a prompt's samples depend only on its key and index).
    ``max_new_tokens``: an int or one per prompt, a traced per-row value (the static output width
    is :func:`budget_bucket` of the largest). ``batch_size=B``: continuous batching through B
    slots (:mod:`asps_jax.slots`). ``top_logprobs=k``: the k most likely tokens of each emitted
    token's law; ``raw_logprobs=True``: each emitted token's log-probability under the
    unprocessed target law too (:attr:`SampleOutput.raw_logprobs`); ``diagnostics=True``: the
    root ``optimal_acceptance`` of multi-draft steps.
    ``num_draft_tokens`` defaults to 8 and ``num_drafts`` to 1; ``tree=(w_1, ..., w_D)``: a
    branching tree, ``w_d`` children per node at depth d - 1 (``prod(w)`` root paths). ``stop``:
    at most 16 strings of 1 to 64 UTF-8 bytes; a row ends after the token whose text completes
    one (kept; :mod:`asps_jax.controls.stopping`)."""
    compile_cache.enable_default()  # the persistent cache, as the command line has it
    arguments.check_keywords("prepare", kwargs, arguments.call_keywords(prepare))
    given = arguments.sampling_arguments(sampling, kwargs)  # flat keywords over sampling=
    drafting = drafters.options(kwargs)  # the rest of kwargs: the method's options
    prompts, prompt_lengths, max_new_tokens, given, key = _samples(
        n, key, seed, prompts, prompt_lengths, max_new_tokens, given, target.vocab_size
    )
    batch_size, stop_bytes, largest = _check_call(target, max_new_tokens, batch_size, mesh, stop)
    target, drafter, draft, spec, tau = plan.resolve(
        target, draft, method=method, num_drafts=num_drafts, num_draft_tokens=num_draft_tokens,
        tree=tree, max_new_tokens=budget_bucket(largest), options=kwargs, mesh=mesh, **drafting,
    )  # fmt: skip
    sampling = Sampling(**given)
    top_logprobs = check_logprob_options(top_logprobs, True, target.vocab_size)
    mesh = None if mesh is None else sharding.check_mesh(mesh)
    prompts_bp, lengths_b, batch = _as_prompt_array(prompts, prompt_lengths, target.vocab_size)
    budgets = _budgets(max_new_tokens, batch)
    slot_count = None if batch_size is None else min(batch_size, prompts_bp.shape[0])
    plan.check_fits(target, drafter, draft, spec, lengths_b[:batch], budgets, mesh, slot_count)

    # Lowering: the static decoder and the inputs' arrays.
    prompts_bp, lengths_b = sharding.pad_to_mesh(prompts_bp, lengths_b, mesh)
    params, constraint = sampling.lower(target, batch, prompts_bp.shape[0], draft_stop=tau)
    decoder = plan.decoder(
        target, drafter, spec, prompts_bp.shape[1], mesh, diagnostics, top_logprobs,
        raw_logprobs, samples=n if slot_count is None else 1,  # the slots refill row by row
    )  # fmt: skip
    inputs = _decode_inputs(
        target, draft, params, prompts_bp, lengths_b, key, batch, budgets, stop_bytes, slot_count
    )

    return Prepared(
        decoder=decoder,  # inputs: the same in every process, placed for the rows each step runs
        inputs=_placed(decoder, inputs, slot_count or prompts_bp.shape[0], mesh, target, draft),
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
        check_int("max_new_tokens", max_new_tokens, 1)
    if batch_size is not None:
        batch_size = check_int("batch_size", batch_size, 1)
    stop_bytes = controls.validate_stop(stop)
    if stop_bytes and getattr(target, "tokenizer", None) is None:
        raise ValueError(
            "stop: stop strings are matched against the tokens' text, and the target model was "
            "loaded without a tokenizer"
        )
    largest = max(_budgets(max_new_tokens, len(max_new_tokens) if many else 1))
    return batch_size, stop_bytes, largest


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
        table = controls.cached_table(target.tokenizer, target.vocab_size)
        stop_state = controls.stop_strings(table, stop_bytes, slot_count or padded)
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


def finish(
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
            raw_logprobs=state.raw_logprobs if return_logprobs else None,
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
    raw = None
    if return_logprobs and state.raw_logprobs.shape[-1]:
        raw = cut(whole["raw_logprobs"])
    out = SampleOutput(
        tokens=jax.device_put(tokens),
        lengths=jax.device_put(lengths),
        stats=whole["stats"],
        logprobs=cut(whole["logprobs"]) if return_logprobs else None,
        top_logprobs=top,
        raw_logprobs=raw,
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
