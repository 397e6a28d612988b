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

import dataclasses
import functools
import inspect
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

try:
    from flax import nnx, traverse_util
    from tunix.generate import base_sampler
    from tunix.generate import tokenizer_adapter as tok_adapter
    from tunix.rl import common as rl_common
    from tunix.rl import reshard
    from tunix.rl.rollout import base_rollout
except ImportError as e:  # pragma: no cover - exercised only without tunix
    raise ImportError(
        f"asps_jax.integrations.tunix needs google-tunix ({e}): pip install google-tunix, or "
        "without its training data stack: pip install --no-deps google-tunix google-metrax clu "
        "tensorboardX jaxtyping wadler-lindig sentencepiece perfetto pandas"
    ) from None

from asps_jax.controls.sampling import Sampling
from asps_jax.models import LlamaConfig, Model, Qwen2Config, Qwen3Config
from asps_jax.models.base import forward_for, run_params
from asps_jax.session import Sampler

# The longest prompt plus output a mapped model accepts: tunix's models have no context length of
# their own (RoPE without scaling); the native sampler's bound is its KV cache size.
DEFAULT_MAX_LENGTH = 32768

# The most logits one teacher-forced forward chunk holds (2**28 float32: 1 GiB).
_FORWARD_FLOATS = 1 << 28

# tunix class (module, name) -> (the asps_jax config class, tunix's tied-embedding field).
_FAMILIES = {
    ("tunix.models.llama3.model", "Llama3"): (LlamaConfig, "weight_tying"),
    ("tunix.models.qwen2.model", "Qwen2"): (Qwen2Config, "use_tied_embedding"),
    ("tunix.models.qwen3.model", "Qwen3"): (Qwen3Config, "use_tied_embedding"),
}

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


# --- The parameter and config map -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What the map needs to know of a tunix model's parameters (hashable: a static argument)."""

    qkv_bias: bool  # Qwen2: flat q/k/v biases
    qk_norm: bool  # Qwen3: per-head RMS norms of q and k
    tied: bool  # no lm_head: the embedding is the head


def _tunix_class(transformer) -> tuple[type, Any, str]:
    """``(tunix class, asps_jax config class, tied field)`` of ``transformer``, or a one-line
    error naming the families that map."""
    for cls in type(transformer).__mro__:
        family = _FAMILIES.get((cls.__module__, cls.__name__))
        if family is not None:
            return cls, *family
    names = ", ".join(f"{m}.{c}" for m, c in _FAMILIES)
    raise ValueError(
        f"asps_jax's tunix back end maps {names}; got {type(transformer).__qualname__} "
        f"from {type(transformer).__module__}"
    )


def _rope_theta(cls, config) -> float:
    """The RoPE base ``cls``'s forward actually uses: a module whose attention calls its
    ``apply_rope`` without ``rope_theta`` rotates with that function's default."""
    module = sys.modules[cls.__module__]
    rope = getattr(module, "apply_rope", None)
    attention = getattr(getattr(module, "Attention", None), "block", None)
    if rope is None or attention is None:
        return float(config.rope_theta)
    try:
        passed = "rope_theta" in inspect.getsource(attention)
        default = inspect.signature(rope).parameters["rope_theta"].default
    except (OSError, TypeError, KeyError):
        return float(config.rope_theta)
    return float(config.rope_theta if passed or default is inspect.Parameter.empty else default)


def asps_config(transformer, *, max_length: int = DEFAULT_MAX_LENGTH, eos_token_id=None):
    """The asps_jax family config (``LlamaConfig`` / ``Qwen2Config`` / ``Qwen3Config``) whose
    forward is ``transformer``'s (a tunix ``Llama3``, ``Qwen2`` or dense ``Qwen3``)."""
    cls, config_class, tied = _tunix_class(transformer)
    c = transformer.config
    if getattr(c, "num_experts", None):
        raise ValueError(
            f"asps_jax's tunix back end maps dense models; {cls.__name__} has "
            f"num_experts={c.num_experts} (mixture of experts)"
        )
    return config_class(
        vocab_size=int(c.vocab_size),
        hidden_size=int(c.embed_dim),
        intermediate_size=int(c.hidden_dim),
        num_hidden_layers=int(c.num_layers),
        num_attention_heads=int(c.num_heads),
        num_key_value_heads=int(c.num_kv_heads),
        head_dim=int(c.head_dim),
        rms_norm_eps=float(c.norm_eps),
        rope_theta=_rope_theta(cls, c),
        max_position_embeddings=int(max_length),
        tie_word_embeddings=bool(getattr(c, tied)),
        bos_token_id=None,
        eos_token_id=eos_token_id,
    )


def _layout(config) -> _Layout:
    return _Layout(
        qkv_bias=getattr(config, "QKV_BIAS", False),
        qk_norm=getattr(config, "QK_NORM", False),
        tied=config.tie_word_embeddings,
    )


def _stored(layout: _Layout, tree: dict) -> dict:
    """The family's stored parameters from tunix's (``nnx.to_pure_dict`` of the module's
    variables), on the first device holding them (:func:`_mapper`). Arrays spread over several
    devices (a model on a mesh) are gathered there first, device to device."""
    leaves = jax.tree.leaves(tree)
    devices = set().union(*(x.sharding.device_set for x in leaves if hasattr(x, "sharding")))
    device = min(devices, key=lambda d: d.id) if devices else jax.devices()[0]
    if len(devices) > 1:
        tree = jax.device_put(tree, jax.sharding.SingleDeviceSharding(device))
    return _mapper(layout, device)(tree)


@functools.cache
def _mapper(layout: _Layout, device):
    """The compiled map for ``layout`` whose outputs live on ``device``: the sampler runs on
    one device, and the outputs of a model on a one-device mesh (as ``RLCluster`` places it) are
    laid out as those of a model never placed on a mesh, so the sampler's compiled programs
    serve both."""
    return jax.jit(
        functools.partial(_stack, layout), out_shardings=jax.sharding.SingleDeviceSharding(device)
    )


def _stack(layout: _Layout, tree: dict) -> dict:
    """Per-layer arrays stacked on a leading axis; tunix's projections are already ``[in, out]``
    with the head axes split, as the stored layout keeps them."""
    layers = [tree["layers"][i] for i in sorted(tree["layers"])]

    def stack(get):
        return jnp.stack([get(layer) for layer in layers])

    out = {
        "attn_norm": stack(lambda p: p["input_layernorm"]["w"]),
        "wq": stack(lambda p: p["attn"]["q_proj"]["w"]),  # [E, NH, H]
        "wk": stack(lambda p: p["attn"]["k_proj"]["w"]),  # [E, KVH, H]
        "wv": stack(lambda p: p["attn"]["v_proj"]["w"]),
        "wo": stack(lambda p: p["attn"]["o_proj"]["w"]),  # [NH, H, E]
        "mlp_norm": stack(lambda p: p["post_attention_layernorm"]["w"]),
        "w_gate": stack(lambda p: p["mlp"]["gate_proj"]["kernel"]),  # [E, F]
        "w_up": stack(lambda p: p["mlp"]["up_proj"]["kernel"]),
        "w_down": stack(lambda p: p["mlp"]["down_proj"]["kernel"]),  # [F, E]
    }
    if layout.qkv_bias:  # tunix keeps them flat, [heads * head_dim]
        for x in "qkv":
            shape = out[f"w{x}"].shape[2:]  # [heads, head_dim]
            out[f"b{x}"] = stack(lambda p, x=x, s=shape: p["attn"][f"{x}_bias"].reshape(s))
    if layout.qk_norm:
        out["q_norm"] = stack(lambda p: p["attn"]["q_norm"]["w"])
        out["k_norm"] = stack(lambda p: p["attn"]["k_norm"]["w"])
    params = {
        "embed": tree["embedder"]["input_embedding"],
        "layers": out,
        "final_norm": tree["final_norm"]["w"],
    }
    if not layout.tied:
        params["lm_head"] = tree["lm_head"]["w"]  # [E, V]
    return params


def _check_variables(state, where: str) -> None:
    """A one-line error for LoRA variables (the port runs base weights only)."""
    lora = getattr(nnx, "LoRAParam", None)
    for path, var in nnx.to_flat_state(state):
        if lora is not None and isinstance(var, lora):
            raise ValueError(
                f"{where}: {'/'.join(map(str, path))} is a LoRA parameter; asps_jax runs the base "
                "weights only: merge the LoRA weights into them first"
            )


def asps_model(transformer, tokenizer=None, *, max_length: int = DEFAULT_MAX_LENGTH) -> Model:
    """The asps_jax :class:`~asps_jax.models.Model` running ``transformer``'s weights (a tunix
    ``Llama3``, ``Qwen2`` or dense ``Qwen3``): its forward gives tunix's logits to float
    tolerance. ``tokenizer``: a transformers tokenizer for stop strings, or None."""
    return _Tracked(transformer, max_length, "asps_model").model(tokenizer)


class _Tracked:
    """One tunix model: its graph, its state (the live ``nnx.Variable`` objects, as tunix's
    sampler holds them), its asps_jax config, and the values it last mapped."""

    def __init__(self, transformer, max_length: int, where: str):
        self.name = f"tunix:{type(transformer).__name__}"
        self.config = asps_config(transformer, max_length=max_length)
        self.layout = _layout(self.config)
        self.graphdef = nnx.graphdef(transformer)
        self.set_state(nnx.variables(transformer), where)
        self.dtypes = None  # the mapped parameters' dtypes, fixed by the first map

    def set_state(self, state, where: str) -> None:
        _check_variables(state, where)
        self.state = state
        self.flat = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        self.seen = None

    def values(self) -> tuple:
        return tuple(v.get_value() if isinstance(v, nnx.Variable) else v for v in self.flat)

    def stale(self) -> bool:
        return self.seen is None or any(a is not b for a, b in zip(self.values(), self.seen))

    def mapped(self) -> dict:
        """The stored parameters of the current values, in the first map's dtypes."""
        self.seen = self.values()
        new = _stored(self.layout, nnx.to_pure_dict(self.state))
        if self.dtypes is None:
            self.dtypes = jax.tree.map(lambda x: x.dtype, new)
        return jax.tree.map(lambda x, d: x if x.dtype == d else x.astype(d), new, self.dtypes)

    def model(self, tokenizer) -> Model:
        """The asps_jax Model of the current values."""
        return Model(self.name, "", self.config, self.mapped(), tokenizer)

    def merged(self, params, where: str):
        """The state with ``params`` (an ``nnx.State`` or nested dict of some or all of the
        model's variables, arrays or ``nnx.Variable``) in place of those variables."""
        old = dict(nnx.to_flat_state(self.state))
        if isinstance(params, nnx.State):
            new = dict(nnx.to_flat_state(params))
        elif isinstance(params, dict):
            new = traverse_util.flatten_dict(params)
        else:
            raise ValueError(
                f"{where}: give an nnx.State (or nested dict) of the model's variables, "
                f"got {type(params).__name__}"
            )
        for path, value in new.items():
            name = "/".join(map(str, path))
            if path not in old:
                raise ValueError(f"{where}: {name} is not a variable of the model")
            if not isinstance(value, nnx.Variable):
                value = old[path].replace(value=value)
            got, want = np.shape(value.get_value()), np.shape(old[path].get_value())
            if got != want:
                raise ValueError(f"{where}: {name} is {list(got)}, the model's is {list(want)}")
            old[path] = value
        return nnx.from_flat_state(list(old.items()))


# --- The sampler ------------------------------------------------------------------------------


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
    logits, _ = forward_for(config)(params, tokens, positions, mask, None)
    logits = logits.astype(jnp.float32)
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
        self._target = _Tracked(transformer, max_length, "AspsSampler")
        self._draft = None
        if isinstance(draft, nnx.Module):
            self._draft = _Tracked(draft, max_length, "AspsSampler draft")
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
