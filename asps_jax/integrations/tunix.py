"""google-tunix back end: tunix's ``BaseSampler``, and an RL rollout engine, sampling with
asps_jax's exact speculative sampler over a tunix NNX model.

::

    from asps_jax.integrations.tunix import AspsSampler

    sampler = AspsSampler(transformer, tokenizer, "self:1", num_draft_tokens=4)
    out = sampler(["Q: 2 + 2 =", "Hello"], max_generation_steps=64, temperature=0.9, top_p=1.0)
    out.text, out.tokens, out.padded_prompt_tokens  # tunix's SamplerOutput

**Models.** tunix's ``Llama3``, ``Qwen2`` and dense ``Qwen3`` (``tunix.models.*.model``) run on
asps_jax's own ports of those families: :func:`asps_model` maps the module's ``nnx.Param``
values into the family's stored layout (layers stacked on a leading axis; tunix already stores
every projection ``[in, out]`` with the head axes split, so the map is a stack, plus a reshape of
Qwen2's flat q/k/v biases) and its config into the family config, so the draft may be
``"self:L"`` (the target's first L layers), another tunix model, an asps_jax ``Model``, or
``"lookup"``. The RoPE base is the one tunix's forward uses: its Llama3 and Qwen3 attention call
``apply_rope`` without the config's ``rope_theta``, so they rotate with that function's default
(1e6), and so does the port (``tests/test_tunix.py`` checks the logits against tunix's forward).

**Sampling.** The law is tunix's native ``Sampler``'s: ``top_p=None`` is greedy (whatever the
temperature, as tunix does), otherwise temperature, then ``top_k`` (None or <= 0: off), then
``top_p`` (>= 1: off), with ``forbidden_tokens`` banned first; every method keeps it exactly.
Temperature 0 with a ``top_p`` is greedy here (tunix's native sampler divides by it). tunix
keeps a token whose preceding sorted mass equals ``top_p`` exactly, transformers' rule (used
here) drops it: they differ only on exact ties. Outputs follow the native sampler field by
field: ``tokens`` without the EOS, ``padded_prompt_tokens`` left-padded to ``max_prompt_length``
(or the next power of two >= the longest prompt when that is longer), ``pad_output`` and
``echo`` as there, ``logprobs`` the native ones: ``log_softmax(logits / T)`` of each token
(``T = 1`` when greedy; forbidden tokens banned; no top-k / top-p), 0.0 over an echoed prompt.
They come from the laws the sampling loop already computed when those are that law (the loop
always gathers them, so calls with and without logprobs share one compiled program), otherwise
(greedy with ``forbidden_tokens``; top-k / top-p with a temperature other than 1 or with
``forbidden_tokens``) from one teacher-forced forward of the target over prompt and output (in
chunks of rows holding at most 2**28 logits); so do ``return_logits``' logits
(the target's raw logits that produced each token; zeros for the first token of a row, which has
no prefix). ``seed=None`` is seed 0, as in tunix; an int seeds row ``b`` with ``fold_in(key(seed),
b)``, a PRNG key is used as the call's key, a list gives one seed per prompt.
``multi_sampling=k`` returns ``k`` samples per prompt, prompt-major (row ``p * k + i``), each
prompt's padded tokens repeated ``k`` times. ``beam_size`` and ``images`` are refused.

**Weights.** The module's variables are held as tunix's sampler holds them (the live
``nnx.Variable`` objects): a call first re-maps them if any value changed (an optimizer step
applied to the module in place), and :meth:`AspsSampler.update_params` takes a new state (all
parameters or some; assigning ``transformer_state`` is the same). The re-map is one compiled
stack, and the asps_jax sampler swaps the weights without recompiling.

**RL.** :class:`AspsRollout` is a ``tunix.rl.rollout.base_rollout.BaseRollout``: pass
``rollout_engine=functools.partial(AspsRollout, draft="self:1", num_draft_tokens=4)`` in
``tunix.rl.rl_cluster.ClusterConfig`` and tunix's GRPO / PPO learners sample with it. ``RLCluster``
gives a custom engine the trained actor itself, so the learner finds the rollout model sharing
its weights and never calls ``sync_weights``: each rollout re-maps the weights the last optimizer
step wrote into the module (one compiled stack per step, no recompile); where ``sync_weights``
does run, it calls :meth:`AspsRollout.update_params`. The rollout runs on one device: a model on a
mesh is gathered onto its first device by the map.
"""

from __future__ import annotations

try:
    from flax import nnx
    from tunix.rl import common as rl_common
    from tunix.rl import reshard
    from tunix.rl.rollout import base_rollout
except ImportError as e:  # pragma: no cover - exercised only without tunix
    raise ImportError(
        f"asps_jax.integrations.tunix needs google-tunix ({e}): pip install google-tunix, or "
        "without its training data stack: pip install --no-deps google-tunix google-metrax clu "
        "tensorboardX jaxtyping wadler-lindig sentencepiece perfetto pandas"
    ) from None

from asps_jax.integrations.tunix_sampler import AspsSampler
from asps_jax.integrations.tunix_weights import DEFAULT_MAX_LENGTH, asps_config, asps_model

__all__ = ["DEFAULT_MAX_LENGTH", "AspsRollout", "AspsSampler", "asps_config", "asps_model"]


# --- The RL rollout engine --------------------------------------------------------------------


class AspsRollout(base_rollout.BaseRollout):
    """tunix's RL rollout engine on :class:`AspsSampler`: tunix's ``VanillaRollout`` with the
    sampler swapped. ``RLCluster`` builds it as ``engine(rollout_actor=..., tokenizer=...,
    mesh=..., rollout_config=...)``; give the asps_jax options through ``functools.partial``
    (``rollout_engine=functools.partial(AspsRollout, draft="self:1", num_draft_tokens=4)``).
    The rollout runs on the default device (``mesh`` is not used); ``max_length`` defaults to the
    config's ``kv_cache_size``, the native sampler's bound."""

    def __init__(
        self,
        rollout_actor,
        tokenizer,
        mesh=None,
        rollout_config: base_rollout.RolloutConfig | None = None,
        *,
        draft=None,
        max_length: int | None = None,
        **options,
    ):
        del mesh
        if max_length is None:
            size = getattr(rollout_config, "kv_cache_size", None)
            max_length = DEFAULT_MAX_LENGTH if size is None else int(size)
        self._sampler = AspsSampler(
            rollout_actor, tokenizer, draft, max_length=max_length, **options
        )

    @property
    def sampler(self) -> AspsSampler:
        return self._sampler

    def generate(self, prompts, rollout_config, **kwargs) -> base_rollout.RolloutOutput:
        """VanillaRollout's ``generate``: the same sampler call, the same output."""
        output = self._sampler(
            input_strings=prompts,
            max_generation_steps=rollout_config.max_tokens_to_generate,
            max_prompt_length=rollout_config.max_prompt_length,
            echo=False,
            temperature=rollout_config.temperature,
            top_p=rollout_config.top_p,
            top_k=rollout_config.top_k,
            seed=rollout_config.seed,
            pad_output=False,
            eos_tokens=rollout_config.eos_tokens,
            return_logprobs=rollout_config.return_logprobs,
        )
        return base_rollout.RolloutOutput(
            text=output.text,
            logits=output.logits,
            tokens=output.tokens,
            left_padded_prompt_tokens=output.padded_prompt_tokens,
            logprobs=output.logprobs,
        )

    def get_per_token_logps(self, prompt_tokens, completion_tokens):
        """The rollout policy's per-token log-probabilities, by tunix's own forward."""
        graphdef, state = self._sampler.model_def_and_state()
        return rl_common.compute_per_token_logps(
            graphdef,
            state,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            pad_id=self.pad_id(),
            eos_id=self.eos_id(),
            stop_gradient=True,
            return_logits=False,
        )

    def update_params(self, params, filter_types=None) -> None:
        """New weights (``RLCluster.sync_weights``): resharded onto the rollout's variables as
        VanillaRollout does, then :meth:`AspsSampler.update_params`."""
        if filter_types is not None:
            params = reshard.reshard_pytree(params, nnx.state(self.model(), filter_types))
        self._sampler.update_params(params)

    def pad_id(self) -> int:
        return self._sampler.tokenizer.pad_id()

    def eos_id(self) -> int:
        return self._sampler.tokenizer.eos_id()

    def model(self) -> nnx.Module:
        return self._sampler.transformer
