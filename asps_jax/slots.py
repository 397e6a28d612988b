"""Continuous batching: many prompts through ``B`` slots of one compiled loop.

The whole prompt set lives on device (:class:`Prompts`, ``N`` rows padded to one prompt-width
bucket; rows of length 0 pad ``N`` to a bucket). The loop carries ``B`` slots, a
:class:`~asps_jax.decode.DecodeState` of batch ``B``, and which prompt each slot runs. After every
step, a slot whose row finished (EOS, its budget, a stop string, its constraint's end, an unusable
law) hands its outputs and statistics to the per-prompt :class:`Results` and is emptied; when some
slot is empty and prompts remain, one ``lax.cond`` refills every empty slot with the next prompts
(:func:`asps_jax.decode._refill`: one prefill forward over the ``B`` slots, the others writing
nothing). Nothing returns to the host until every prompt is done.

Reproducibility: prompt ``i``'s key is ``fold_in(key, i)`` (as for a one-batch call) and each of
its steps is keyed by its own number of generated tokens; its sampling parameters and budget are
its own; nothing a slot computes reads another slot. So a prompt's tokens never depend on
``batch_size``, on its slot, or on the other prompts.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from asps_jax import decode
from asps_jax.controls.processors import SamplingParams
from asps_jax.statistics import DecodeStats

__all__ = ["Prompts", "Results", "SlotState", "advance", "run", "running", "start"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prompts:
    """The prompt set on device.

    Attributes:
      tokens: int32[N, P], right-padded prompts (P: the prompt-width bucket).
      lengths: int32[N]; 0 for the rows that pad N to a bucket (never started).
      keys: typed PRNG keys [N], ``fold_in(key, i)`` for prompt i.
      budget: int32[N], each prompt's ``max_new_tokens``.
      sampling: :class:`~asps_jax.controls.processors.SamplingParams` with one row per prompt.
    """

    tokens: jax.Array
    lengths: jax.Array
    keys: jax.Array
    budget: jax.Array
    sampling: SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Results:
    """Each prompt's outputs, written when its slot finishes (the field names of
    :class:`~asps_jax.decode.DecodeState` that :func:`asps_jax.sampler.finish` reads)."""

    tokens: jax.Array  # int32[N, W]
    logprobs: jax.Array  # float32[N, W]
    num_generated: jax.Array  # int32[N]
    stats: DecodeStats  # N rows
    top_logprobs: tuple[jax.Array, jax.Array]  # [N, W, k] each
    raw_logprobs: jax.Array  # float32[N, W] (float32[N, 0] without Decoder.raw_logprobs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotState:
    """The loop's carry: the ``B`` slots, the prompt each runs (-1: empty), the next prompt to
    start, and the per-prompt results."""

    state: decode.DecodeState
    prompt: jax.Array  # int32[B]
    next: jax.Array  # int32[]
    results: Results


def slot_sampling(sampling: SamplingParams, prompt_B) -> SamplingParams:
    """The sampling parameters of the prompts the slots run (an empty slot reads prompt 0's)."""
    idx = jnp.maximum(prompt_B, 0)
    return dataclasses.replace(
        sampling, **{f: getattr(sampling, f)[idx] for f in SamplingParams.row_fields()}
    )


def _refill(dec, target_params, draft_params, prompts: Prompts, s: SlotState) -> SlotState:
    """Every empty slot takes the next prompt, in slot order, while prompts remain."""
    num = jnp.sum(prompts.lengths > 0).astype(jnp.int32)
    empty = s.prompt < 0
    idx = s.next + jnp.cumsum(empty.astype(jnp.int32)) - 1
    take = empty & (idx < num)

    def fill(s):
        at = jnp.clip(jnp.where(take, idx, 0), 0, prompts.lengths.shape[0] - 1)
        state = decode._refill(
            dec,
            target_params,
            draft_params,
            s.state,
            take,
            prompts.tokens[at],
            prompts.lengths[at],
            prompts.keys[at],
            prompts.budget[at],
        )
        return dataclasses.replace(
            s,
            state=state,
            prompt=jnp.where(take, idx, s.prompt).astype(jnp.int32),
            next=s.next + jnp.sum(take).astype(jnp.int32),
        )

    return jax.lax.cond(jnp.any(take), fill, lambda s: s, s)


def _retire(s: SlotState) -> SlotState:
    """Slots whose row is done hand their outputs to their prompt's results and empty."""
    st = s.state
    n = s.results.num_generated.shape[0]
    finished = st.done & (s.prompt >= 0)
    at = jnp.where(finished, s.prompt, n)  # row n is out of range: dropped

    def put(res, slot):
        return res.at[at].set(slot, mode="drop")

    slot_view = Results(
        tokens=st.tokens,
        logprobs=st.logprobs,
        num_generated=st.num_generated,
        stats=st.stats,
        top_logprobs=st.top_logprobs,
        raw_logprobs=st.raw_logprobs,
    )
    results = jax.tree.map(put, s.results, slot_view)
    return dataclasses.replace(s, results=results, prompt=jnp.where(finished, -1, s.prompt))


def _start(dec, target_params, draft_params, prompts: Prompts, stop, batch: int) -> SlotState:
    width = prompts.tokens.shape[1]
    n = prompts.lengths.shape[0]
    empty = jnp.zeros((batch,), jnp.int32)
    state = decode._prefill(
        dec,
        target_params,
        draft_params,
        jnp.zeros((batch, width), jnp.int32),
        empty,  # length 0: every slot starts done (empty)
        jnp.broadcast_to(prompts.keys[:1], (batch,)),
        stop,
        jnp.ones((batch,), jnp.int32),
        run_forward=False,
    )
    out_width = state.tokens.shape[1]
    top_shape = (n, out_width, dec.top_logprobs)
    results = Results(
        tokens=jnp.full((n, out_width), -1, jnp.int32),
        logprobs=jnp.zeros((n, out_width), jnp.float32),
        num_generated=jnp.zeros((n,), jnp.int32),
        stats=DecodeStats.zeros(n, state.stats.emitted_hist.shape[1] - 2),
        top_logprobs=(jnp.full(top_shape, -1, jnp.int32), jnp.zeros(top_shape, jnp.float32)),
        raw_logprobs=jnp.zeros((n, state.raw_logprobs.shape[1]), jnp.float32),
    )
    return SlotState(
        state=state,
        prompt=jnp.full((batch,), -1, jnp.int32),
        next=jnp.zeros((), jnp.int32),
        results=results,
    )


def _body(dec, target_params, draft_params, prompts: Prompts, s: SlotState) -> SlotState:
    """Empty slots take the next prompts, every slot steps, finished slots retire. (One copy of
    the prefill forward and of the step in the program: the first iteration fills every slot.)"""
    s = _refill(dec, target_params, draft_params, prompts, s)
    sampling = slot_sampling(prompts.sampling, s.prompt)
    state = decode._step(dec, target_params, draft_params, sampling, s.state)
    return _retire(dataclasses.replace(s, state=state))


def _running(prompts: Prompts, s: SlotState) -> jax.Array:
    """Some slot runs a prompt, or some prompt has not started."""
    return jnp.any(s.prompt >= 0) | (s.next < jnp.sum(prompts.lengths > 0))


@functools.partial(jax.jit, static_argnames=("dec", "batch"))
def run(dec, target_params, draft_params, prompts: Prompts, stop, batch: int) -> Results:
    """Every prompt through ``batch`` slots in one ``lax.while_loop``; the per-prompt results."""
    s = _start(dec, target_params, draft_params, prompts, stop, batch)
    s = jax.lax.while_loop(
        functools.partial(_running, prompts),
        functools.partial(_body, dec, target_params, draft_params, prompts),
        s,
    )
    return s.results


@functools.partial(jax.jit, static_argnames=("dec", "batch"))
def start(dec, target_params, draft_params, prompts: Prompts, stop, batch: int) -> SlotState:
    """The step-wise entry point (streaming): ``batch`` empty slots (no forward)."""
    return _start(dec, target_params, draft_params, prompts, stop, batch)


@functools.partial(jax.jit, static_argnames="dec", donate_argnames="s")
def advance(dec, target_params, draft_params, prompts: Prompts, s: SlotState) -> SlotState:
    """Empty slots refilled, one step of every slot, finished slots retired."""
    return _body(dec, target_params, draft_params, prompts, s)


@jax.jit
def running(prompts: Prompts, s: SlotState) -> jax.Array:
    """bool[]: the loop has work left (the streaming loop's condition)."""
    return _running(prompts, s)
