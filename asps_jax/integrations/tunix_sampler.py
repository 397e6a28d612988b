"""The google-tunix back end's sampler: :class:`AspsSampler`, tunix's ``BaseSampler`` on
asps_jax's exact speculative sampler (the sampling law, the outputs and the weights as
:mod:`asps_jax.integrations.tunix` describes them).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.generate import base_sampler
from tunix.generate import tokenizer_adapter as tok_adapter

from asps_jax.controls import Sampling
from asps_jax.integrations.tunix_weights import DEFAULT_MAX_LENGTH, Tracked
from asps_jax.models.base import forward_for, run_params
from asps_jax.session import Sampler

__all__ = ["AspsSampler"]

# The most logits one teacher-forced forward chunk holds (2**28 float32: 1 GiB).
_FORWARD_FLOATS = 1 << 28

# Arguments each call sets from tunix's own (so not fixed options), and the sampling controls
# tunix's samplers do not have (they would change the law away from tunix's).
_SET_PER_CALL = (
    "temperature",
    "top_k",
    "top_p",
    "eos_token_id",
    "logit_bias",
    "return_logprobs",
    "raw_logprobs",
)
_NOT_TUNIX = tuple(  # every other sampling argument (draft_temperature: the law stays), sampling=
    n
    for n in (*Sampling.names(), "stop", "sampling")
    if n not in (*_SET_PER_CALL, "draft_temperature")
)


def _next_power_of_2(x: int) -> int:
    """tunix's ``utils.next_power_of_2`` on the host: the smallest power of two >= x (1 for 0)."""
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def _left_padded(prompts: list, max_prompt_length: int | None, pad: int) -> np.ndarray:
    """The prompts left-padded to ``max_prompt_length`` (tunix's layout), or to the next power
    of two of the longest when that is None or too short."""
    longest = max(len(p) for p in prompts)
    if max_prompt_length is None or max_prompt_length < longest:
        max_prompt_length = _next_power_of_2(longest)
    padded = np.full((len(prompts), int(max_prompt_length)), pad, np.int32)
    for i, p in enumerate(prompts):
        padded[i, padded.shape[1] - len(p) :] = p
    return padded


def _sequences(out, row_prompts: list, eos, P: int, M: int, pad: int):
    """``(generated, seq, valid)``: each row's generated ids without the EOS it stopped at
    (asps_jax keeps it, tunix does not), and the rows as tunix lays them out: the prompt
    left-padded to P, then the generated ids, padded to P + M (``valid`` marks the real ids)."""
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    rows = len(row_prompts)
    generated = []
    for r in range(rows):
        g = tokens[r, : lengths[r]].astype(np.int32)
        if len(g) and int(g[-1]) in eos:
            g = g[:-1]
        generated.append(g)
    seq = np.full((rows, P + M), pad, np.int32)
    valid = np.zeros((rows, P + M), bool)
    for r, (p, g) in enumerate(zip(row_prompts, generated)):
        seq[r, P - len(p) : P] = p
        seq[r, P : P + len(g)] = g
        valid[r, P - len(p) : P + len(g)] = True
    return generated, seq, valid


@functools.partial(jax.jit, static_argnums=(0, 1))
def _score(config, want_logits: bool, params, tokens, valid, temperature, banned):
    """One teacher-forced forward over left-padded ``tokens`` (``valid`` marks the real ones):
    ``(logits that produced each token [B, T, V] or None, log_softmax(banned logits / T) of each
    token [B, T])``, both zero where the previous position is padding (no prefix)."""
    B, T = tokens.shape
    positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0).astype(jnp.int32)
    causal = jnp.tril(jnp.ones((T, T), bool))[None]
    mask = causal & (valid[:, None, :] | jnp.eye(T, dtype=bool)[None])
    logits = forward_for(config)(params, tokens, positions, mask, None).logits.astype(jnp.float32)
    prev = jnp.concatenate([jnp.zeros_like(logits[:, :1]), logits[:, :-1]], axis=1)
    has_prefix = jnp.concatenate([jnp.zeros((B, 1), bool), valid[:, :-1]], axis=1)
    law = jax.nn.log_softmax(jnp.where(banned[None, None, :], -jnp.inf, prev) / temperature)
    logprobs = jnp.take_along_axis(law, tokens[:, :, None], axis=-1)[:, :, 0]
    logprobs = jnp.where(has_prefix, logprobs, 0.0)
    if not want_logits:
        return None, logprobs
    return jnp.where(has_prefix[:, :, None], prev, 0.0), logprobs


def _sampling_kwargs(temperature, top_p, top_k, eos_tokens, forbidden_tokens, seed, default_eos):
    """tunix's sampling arguments as asps_jax's: ``(greedy, filtered, eos ids, banned ids,
    keyword arguments of the call)`` (``top_p=None`` or temperature 0: greedy, as tunix)."""
    greedy = top_p is None or temperature == 0
    kw: dict[str, Any] = {"temperature": 0.0 if greedy else float(temperature)}
    filtered = False
    if not greedy:
        if top_k is not None and top_k > 0:
            kw["top_k"], filtered = int(top_k), True
        if top_p < 1.0:
            kw["top_p"], filtered = float(top_p), True
    eos = [int(e) for e in (eos_tokens or [default_eos]) if e is not None]
    kw["eos_token_id"] = eos if eos else -1
    banned = sorted({int(t) for t in forbidden_tokens or ()})
    if banned:
        kw["logit_bias"] = {t: float("-inf") for t in banned}
    if seed is None:
        kw["seed"] = 0
    elif isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        kw["seed"] = int(seed)
    elif isinstance(seed, (list, tuple)):
        kw["seed"] = [int(s) for s in seed]
    else:
        kw["key"] = seed  # a PRNG key: typed, or jax.random.PRNGKey's uint32[2]
    return greedy, filtered, eos, banned, kw


def _checked_call(input_strings, max_generation_steps, multi_sampling, beam_size, images):
    """One-line errors for what ``AspsSampler`` cannot do; the prompts as a list of strings."""
    if beam_size is not None:
        raise ValueError(
            "AspsSampler: beam_size: beam search is not sampling, and speculative sampling "
            "keeps a sampling law; use tunix.generate.sampler.Sampler for beam search"
        )
    if images is not None:
        raise ValueError("AspsSampler: images: the mapped models (Llama3, Qwen2/3) are text")
    for name, value in (
        ("max_generation_steps", max_generation_steps),
        ("multi_sampling", multi_sampling),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"AspsSampler: {name} must be an int >= 1, got {value!r}")
    strings = [input_strings] if isinstance(input_strings, str) else list(input_strings)
    if not strings:
        raise ValueError("AspsSampler: input_strings is empty")
    return strings


class AspsSampler(base_sampler.BaseSampler):
    """tunix's ``BaseSampler`` sampling with asps_jax's exact speculative sampler.

    ``AspsSampler(transformer, tokenizer, draft=None, *, method=None, max_length=32768,
    **options)``: ``transformer`` a tunix ``Llama3``, ``Qwen2`` or dense ``Qwen3``;
    ``tokenizer`` anything tunix's ``TokenizerAdapter`` takes (or one); ``draft`` as for
    :func:`asps_jax.sample` (``"self:L"``, ``"quant:int8"``, ``"lookup"``, an asps_jax
    ``Model``, None for ``method="ar"``) or another tunix model of the same vocabulary (mapped
    the same way);
    ``method`` defaults to ``"asps"`` with a draft, ``"ar"`` without; ``max_length`` the longest
    prompt plus output accepted; ``options`` the fixed keyword arguments of
    :class:`asps_jax.Sampler` (``num_draft_tokens``, ``num_drafts``, ``batch_size``,
    ``draft_temperature``, a method's options...). The sampling values come from each call, as
    tunix passes them; the controls tunix's samplers lack (penalties, ``min_p``, constraints,
    stop strings) are refused. The module docstring states the output semantics.

    :attr:`sampler` is the long-lived :class:`asps_jax.Sampler` (``.compiles`` counts the
    programs its calls built).
    """

    def __init__(
        self,
        transformer,
        tokenizer,
        draft=None,
        *,
        method: str | None = None,
        max_length: int = DEFAULT_MAX_LENGTH,
        **options,
    ):
        for names, why in (
            (_SET_PER_CALL, "each call sets it from tunix's arguments"),
            (_NOT_TUNIX, "tunix's samplers have no such control, and it would change the law"),
        ):
            bad = sorted(set(options) & set(names))
            if bad:
                raise ValueError(f"AspsSampler: {', '.join(bad)}: {why}")
        self.tokenizer = (
            tokenizer
            if isinstance(tokenizer, tok_adapter.TokenizerAdapter)
            else tok_adapter.TokenizerAdapter(tokenizer)
        )
        hf = self.tokenizer.tokenizer if self.tokenizer._is_hf_tokenizer() else None
        self._target = Tracked(transformer, max_length, "AspsSampler")
        self._draft = None
        if isinstance(draft, nnx.Module):
            self._draft = Tracked(draft, max_length, "AspsSampler draft")
            draft = self._draft.model(hf)
        if method is None:
            method = "ar" if draft is None else "asps"
        self.sampler = Sampler(self._target.model(hf), draft, method=method, **options)

    # -- BaseSampler's interface, and the members tunix's rollout code reads --

    @property
    def transformer(self) -> nnx.Module:
        return nnx.merge(self._target.graphdef, self._target.state)

    @property
    def transformer_state(self):
        return self._target.state

    @transformer_state.setter
    def transformer_state(self, state) -> None:
        self.update_params(state)

    @property
    def _transformer_graphdef(self):  # read by tunix.rl.rollout.vanilla_rollout
        return self._target.graphdef

    def model_def_and_state(self):
        """``(graphdef, flattened variables)``, as tunix's sampler returns them (for
        ``tunix.rl.common.compute_per_token_logps``)."""
        return self._target.graphdef, self._target.flat

    def tokenize(self, input_string: str) -> np.ndarray:
        """tunix's tokenization: the tokenizer's ids after its BOS (when it has a nonzero one),
        repeated leading BOS ids collapsed."""
        ids = self.tokenizer.encode(input_string)
        bos = [self.tokenizer.bos_id()] if self.tokenizer.bos_id() else []
        return np.array(self.tokenizer.dedup_bos_ids(bos + ids), dtype=np.int32)

    def update_params(self, params, draft_params=None) -> None:
        """Swap in new weights: an ``nnx.State`` (or nested dict) of some or all of the tunix
        model's variables (e.g. ``nnx.state(trained_model, nnx.Param)``), and optionally of a
        tunix draft model's. They are mapped on device (no host copy) and the asps_jax sampler
        runs them without recompiling."""
        if draft_params is not None and self._draft is None:
            raise ValueError(
                "update_params: the draft is not a tunix model of its own (a 'self:L' or "
                "'quant:int8' draft follows the target's weights); omit draft_params"
            )
        target = self._target.merged(params, "update_params")
        if draft_params is not None:
            draft = self._draft.merged(draft_params, "update_params draft_params")
            self._draft.set_state(draft, "update_params draft_params")
        self._target.set_state(target, "update_params")
        self._sync()

    def _sync(self) -> None:
        """Re-map the weights whose values changed since they were last mapped."""
        target = self._target.mapped() if self._target.stale() else None
        draft = self._draft.mapped() if self._draft is not None and self._draft.stale() else None
        if target is not None or draft is not None:
            self.sampler.update_params(
                self.sampler.target.params if target is None else target, draft
            )

    def _outputs(
        self, seq, row_prompts, generated, padded, n, P, M, logits, logprobs, echo, pad_output,
        return_logits, return_logprobs,
    ) -> base_sampler.SamplerOutput:  # fmt: skip
        """The native sampler's ``SamplerOutput`` of the rows (``seq``: prompt left-padded to P,
        then the generated tokens), echoed and padded as asked."""
        pad = self.tokenizer.pad_id()
        rows = len(generated)
        starts = [P - len(p) if echo else P for p in row_prompts]
        ends = [P + len(g) for g in generated]
        if pad_output:
            width = P + M if echo else M
            out_tokens = np.full((rows, width), pad, np.int32)
            out_logits = (
                np.zeros((rows, width, logits.shape[-1]), np.float32) if return_logits else None
            )
            out_logprobs = [] if return_logprobs else None
            for r, (s, e) in enumerate(zip(starts, ends)):
                out_tokens[r, : e - s] = seq[r, s:e]
                if return_logits:
                    out_logits[r, : e - s] = logits[r, s:e]
                if return_logprobs:
                    out_logprobs.append(np.pad(logprobs[r, s:e], (0, width - (e - s))).tolist())
            text = [
                self.tokenizer.decode(t[: e - s].tolist())
                for t, s, e in zip(out_tokens, starts, ends)
            ]
            out_logits = jnp.asarray(out_logits) if return_logits else []
        else:
            out_tokens = [seq[r, s:e] for r, (s, e) in enumerate(zip(starts, ends))]
            text = [self.tokenizer.decode(t.tolist()) for t in out_tokens]
            out_logits = (
                [logits[r, s:e] for r, (s, e) in enumerate(zip(starts, ends))]
                if return_logits
                else []
            )
            out_logprobs = (
                [logprobs[r, s:e].tolist() for r, (s, e) in enumerate(zip(starts, ends))]
                if return_logprobs
                else None
            )
        return base_sampler.SamplerOutput(
            text=text,
            logits=out_logits,
            tokens=out_tokens,
            padded_prompt_tokens=np.repeat(padded, n, axis=0),
            logprobs=out_logprobs,
        )

    def _teacher_forced(self, seq, valid, temperature: float, banned, want_logits: bool):
        """:func:`_score` of the target over ``seq`` (NumPy ``[rows, T]``), in chunks of a
        power-of-two number of rows holding at most ``_FORWARD_FLOATS`` logits."""
        target = self.sampler.target
        rows, T = seq.shape
        V = target.vocab_size
        cap = max(1, _FORWARD_FLOATS // (T * V))
        chunk = min(_next_power_of_2(rows), 1 << (cap.bit_length() - 1))
        total = -(-rows // chunk) * chunk
        seq = np.concatenate([seq, np.zeros((total - rows, T), seq.dtype)])
        valid = np.concatenate([valid, np.zeros((total - rows, T), bool)])
        ban = np.zeros(V, bool)
        ban[list(banned)] = True
        params, logits, logprobs = run_params(target, wide=True), [], []  # T-token rows
        for i in range(0, total, chunk):
            lg, lp = _score(
                target.config,
                want_logits,
                params,
                jnp.asarray(seq[i : i + chunk]),
                jnp.asarray(valid[i : i + chunk]),
                jnp.float32(temperature),
                jnp.asarray(ban),
            )
            logprobs.append(np.asarray(lp))
            if want_logits:
                logits.append(np.asarray(lg))
        logits = np.concatenate(logits)[:rows] if want_logits else None
        return logits, np.concatenate(logprobs)[:rows]

    def __call__(
        self,
        input_strings: str | Sequence[str],
        max_generation_steps: int,
        max_prompt_length: int | None = None,
        temperature: float = 0.0,
        top_p: float | None = None,
        top_k: int | None = None,
        beam_size: int | None = None,
        seed=None,
        multi_sampling: int = 1,
        return_logits: bool = False,
        echo: bool = False,
        pad_output: bool = False,
        *,
        return_logprobs: bool = False,
        eos_tokens: Sequence[int] | None = None,
        forbidden_tokens: Sequence[int] | None = None,
        images=None,
    ) -> base_sampler.SamplerOutput:
        """Sample completions of ``input_strings``: tunix's native ``Sampler.__call__``
        arguments and outputs (the module docstring has the semantics), plus tunix's
        ``multi_sampling``. ``beam_size`` and ``images`` are one-line ``ValueError``s."""
        strings = _checked_call(
            input_strings, max_generation_steps, multi_sampling, beam_size, images
        )
        self._sync()

        prompts = [self.tokenize(s) for s in strings]
        pad = self.tokenizer.pad_id()
        padded = _left_padded(prompts, max_prompt_length, pad)
        P, M, n = padded.shape[1], int(max_generation_steps), int(multi_sampling)

        greedy, filtered, eos, banned, kw = _sampling_kwargs(
            temperature, top_p, top_k, eos_tokens, forbidden_tokens, seed, self.tokenizer.eos_id()
        )

        # tunix's logprob of a token is log_softmax(banned logits / T) (T = 1 when greedy): the
        # loop's raw law (T = 1, nothing applied) or processed law (bias, then T) when it is that,
        # else one teacher-forced forward. The loop always gathers both (a log-normalizer per
        # emitted token), so that calls with and without logprobs share one compiled program.
        source = None
        if (greedy or temperature == 1) and not banned:
            source = "raw_logprobs"
        elif not greedy and not filtered:
            source = "logprobs"
        forward = return_logits or (return_logprobs and source is None)
        out = self.sampler(
            [p.tolist() for p in prompts],
            max_new_tokens=M,
            n=n,
            return_logprobs=True,
            raw_logprobs=True,
            **kw,
        )

        rows = len(prompts) * n
        row_prompts = [prompts[r // n] for r in range(rows)]
        generated, seq, valid = _sequences(out, row_prompts, eos, P, M, pad)

        logits = logprobs = None
        if forward:
            logits, logprobs = self._teacher_forced(
                seq, valid, 1.0 if greedy else float(temperature), banned, bool(return_logits)
            )
        if return_logprobs:
            full = np.zeros((rows, P + M), np.float32)  # tunix: 0.0 over the prompt
            loop = None if source is None else np.asarray(getattr(out, source))
            for r, g in enumerate(generated):
                full[r, P : P + len(g)] = (
                    logprobs[r, P : P + len(g)] if loop is None else loop[r, : len(g)]
                )
            logprobs = full

        return self._outputs(
            seq, row_prompts, generated, padded, n, P, M, logits, logprobs, echo, pad_output,
            return_logits, return_logprobs,
        )  # fmt: skip
