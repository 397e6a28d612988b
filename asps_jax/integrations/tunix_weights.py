"""The google-tunix back end's weight map (:mod:`asps_jax.integrations.tunix`): a tunix
``Llama3``, ``Qwen2`` or dense ``Qwen3`` NNX module as an asps_jax :class:`~asps_jax.models.Model`
of the matching family.

:func:`asps_config` maps the module's config into the family config (the RoPE base tunix's
forward actually uses), :func:`asps_model` its ``nnx.Param`` values into the family's stored
layout (layers stacked on a leading axis, one compiled stack per map; Qwen2's flat q/k/v biases
reshaped), and :class:`Tracked` holds the live ``nnx.Variable`` objects as tunix's sampler does,
re-mapping them when a value changed.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from asps_jax.models import LlamaConfig, Model, Qwen2Config, Qwen3Config

__all__ = ["DEFAULT_MAX_LENGTH", "Tracked", "asps_config", "asps_model"]

# The longest prompt plus output a mapped model accepts: tunix's models have no context length of
# their own (RoPE without scaling); the native sampler's bound is its KV cache size.
DEFAULT_MAX_LENGTH = 32768

# tunix class (module, name) -> (the asps_jax config class, tunix's tied-embedding field).
_FAMILIES = {
    ("tunix.models.llama3.model", "Llama3"): (LlamaConfig, "weight_tying"),
    ("tunix.models.qwen2.model", "Qwen2"): (Qwen2Config, "use_tied_embedding"),
    ("tunix.models.qwen3.model", "Qwen3"): (Qwen3Config, "use_tied_embedding"),
}


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
    return Tracked(transformer, max_length, "asps_model").model(tokenizer)


class Tracked:
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
