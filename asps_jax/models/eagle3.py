"""The EAGLE-3 head's model (``draft="eagle3:PATH"``): its config, parameters, forward and
checkpoints; the drafter that runs it is :mod:`asps_jax.drafters.head`.

The head (Li et al. 2025, EAGLE-3) reads, at position t, the target's residual stream entering
three of its layers (a low, a middle and a high one: ``HeadConfig.feature_layers``) fused by
``fc`` into one hidden vector, and the embedding of token t + 1. One Llama decoder layer whose
attention reads both (``[input_norm(embed); hidden_norm(hidden)]``, 2E wide) and keeps its own
small KV cache over the committed text; its output hidden vector, through ``norm`` and its own
``lm_head`` over a draft vocabulary of ``V_d <= V`` tokens (``d2t`` maps each to its target id),
gives the law of token t + 2. Drafting deeper, the head feeds its own output hidden vector in
place of the target's features (as it was trained: :mod:`asps_jax.drafters.train`).

On a mesh its parameters follow the target's rules (``asps_jax.sharding.ShardingRules``,
:data:`AXES`): the attention projections split by heads, the MLP by its width, ``lm_head`` and
the target's embedding by the vocabulary, everything else (``fc`` over the target's features, the
norms, the draft -> target id map) whole on every chip. A rule falls back to whole where the mesh
axis does not divide the size, as for the target. The features the head reads come from the
target's scoring pass, laid out as the target's activations.

Checkpoints are in the EAGLE-3 layout (SpecForge, the EAGLE repository, vLLM and SGLang read
it): ``config.json`` with ``"architectures": ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``
and ``eagle_config.eagle_aux_hidden_state_layer_ids``, and ``model.safetensors`` with ``fc``,
``midlayer.*``, ``norm``, ``lm_head``, ``d2t`` (offsets: target id = draft id + ``d2t[id]``),
``t2d`` and optionally ``embed_tokens`` (else the target's embedding is used); a head's files are
checked field by field and tensor by tensor (:mod:`asps_jax.models.eagle3_checks`).
"""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax import kv_cache
from asps_jax.models import eagle3_checks, loader
from asps_jax.models.base import Model
from asps_jax.models.layers import attention, rms_norm
from asps_jax.models.output import ForwardOut
from asps_jax.models.rope import RopeScaling, apply_rope, rope_tables

PREFIX = "eagle3:"
ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """The head's static sizes (hashable: a field of the drafter, static under jit).

    ``hidden_size`` E is the head's (EAGLE-3 heads use the target's); ``target_hidden_size`` the
    target's (``fc`` maps ``3 * target_hidden_size`` to E); ``vocab_size`` V the target's and
    ``draft_vocab_size`` V_d the head's own; ``feature_layers`` the target layers whose input
    streams it reads (Hugging Face's ``hidden_states[i]``).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    feature_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    num_hidden_layers: int = 1  # the head's cache has one layer (kv_cache reads this)

    @classmethod
    def for_target(cls, target_config, draft_vocab_size: int | None = None, layers=None):
        """A head for ``target_config`` (any family: the head is a Llama layer of the target's
        width, heads and MLP size; RoPE and RMS norm settings the target's where it has them),
        the default feature layers (:func:`default_feature_layers`) and ``V_d`` (default: V)."""
        c = target_config
        heads = c.num_attention_heads
        ffn = getattr(c, "intermediate_size", None) or getattr(c, "ffn_dim", None)
        return cls(
            hidden_size=c.hidden_size,
            intermediate_size=ffn or 4 * c.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", heads),
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            vocab_size=c.vocab_size,
            draft_vocab_size=draft_vocab_size or c.vocab_size,
            target_hidden_size=c.hidden_size,
            feature_layers=tuple(layers or default_feature_layers(c.num_hidden_layers)),
            rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
            rope_theta=getattr(c, "rope_theta", 10000.0),
            rope_scaling=getattr(c, "rope_scaling", None),
            max_position_embeddings=c.max_position_embeddings,
        )

    @classmethod
    def from_hf(cls, d: dict, target_config, where: str = "config.json") -> HeadConfig:
        """From an EAGLE-3 ``config.json`` (SpecForge / EAGLE layout) for ``target_config``, its
        fields checked (:func:`asps_jax.models.eagle3_checks.config_fields`)."""
        fields = eagle3_checks.config_fields(d, where)
        layers = fields.pop("feature_layers")
        layers = layers or default_feature_layers(target_config.num_hidden_layers)
        return cls(**fields, feature_layers=layers)

    def to_hf(self) -> dict:
        """The ``config.json`` of this head in the EAGLE-3 layout."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.feature_layers)},
        }


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers: ``(2, L // 2, L - 3)`` (vLLM and SpecForge's
    default); a target of fewer than 8 layers gets ``(1, L // 2, L - 1)``."""
    if num_layers >= 8:
        return (2, num_layers // 2, num_layers - 3)
    return (min(1, num_layers - 1), num_layers // 2, max(num_layers - 1, 0))


# --- Parameters -------------------------------------------------------------------------------

# Our name -> the EAGLE-3 checkpoint's (HF nn.Linear orientation [out, in], kept as is).
TENSORS = {
    "fc": "fc.weight",
    "input_norm": "midlayer.input_layernorm.weight",
    "hidden_norm": "midlayer.hidden_norm.weight",
    "wq": "midlayer.self_attn.q_proj.weight",
    "wk": "midlayer.self_attn.k_proj.weight",
    "wv": "midlayer.self_attn.v_proj.weight",
    "wo": "midlayer.self_attn.o_proj.weight",
    "post_norm": "midlayer.post_attention_layernorm.weight",
    "w_gate": "midlayer.mlp.gate_proj.weight",
    "w_up": "midlayer.mlp.up_proj.weight",
    "w_down": "midlayer.mlp.down_proj.weight",
    "norm": "norm.weight",
    "lm_head": "lm_head.weight",
}


def param_shapes(c: HeadConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every learned parameter (``embed`` and ``d2t`` come with the head)."""
    E, F, NH, KVH, H = (
        c.hidden_size,
        c.intermediate_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
    )
    return {
        "fc": (E, len(c.feature_layers) * c.target_hidden_size),
        "input_norm": (E,),
        "hidden_norm": (E,),
        "wq": (NH * H, 2 * E),
        "wk": (KVH * H, 2 * E),
        "wv": (KVH * H, 2 * E),
        "wo": (E, NH * H),
        "post_norm": (E,),
        "w_gate": (F, E),
        "w_up": (F, E),
        "w_down": (E, F),
        "norm": (E,),
        "lm_head": (c.draft_vocab_size, E),
    }


def init_params(c: HeadConfig, key, embed, d2t, std: float = 0.02, dtype=jnp.float32) -> dict:
    """Random weights (:func:`random_params` of :func:`param_shapes`)."""
    return random_params(param_shapes(c), key, embed, d2t, std, dtype)


def random_params(shapes: dict, key, embed, d2t, std: float = 0.02, dtype=jnp.float32) -> dict:
    """Weights of ``shapes`` ~ N(0, std), norm scales 1, with the target's ``embed [V, E]`` and
    ``d2t`` (int32[V_d], the target id of each draft id); the block drafter's too."""
    keys = jax.random.split(key, len(shapes))
    params = {
        name: jnp.ones(shape, dtype)
        if name.endswith("norm")
        else (std * jax.random.normal(k, shape)).astype(dtype)
        for k, (name, shape) in zip(keys, shapes.items())
    }
    return dict(params, embed=jnp.asarray(embed), d2t=jnp.asarray(d2t, jnp.int32))


def trainable(params: dict) -> dict:
    """The learned parameters (everything but the target's embedding and the vocabulary map)."""
    return {k: v for k, v in params.items() if k not in ("embed", "d2t")}


# --- Forward ----------------------------------------------------------------------------------


def fuse(params: dict, features_BTF) -> jax.Array:
    """``fc``: the target's concatenated features ``[B, T, 3 * E_t]`` -> ``[B, T, E]``."""
    w = params["fc"]
    return jnp.einsum("btf,ef->bte", features_BTF.astype(w.dtype), w)


def forward(c: HeadConfig, params: dict, hidden_BTE, tokens_BT, positions_BT, mask, cache):
    """One head layer over T entries, a :class:`~asps_jax.models.output.ForwardOut`: ``logits``
    float32[B, T, V_d] (the draft vocabulary's), ``kv`` [1, B, T, KVH, H] and ``features`` the
    hidden out [B, T, E] (what the next depth reads in place of the target's features).

    Entry t reads ``hidden_BTE[:, t]`` (the fused target features, or the head's own output of
    the previous depth) and the embedding of ``tokens_BT[:, t]``; ``mask`` is ``bool[B, T, S + T]``
    over the head's cache (``cache``, may be None with a ``[B, T, T]`` mask) and the new entries.
    """
    B, T = tokens_BT.shape
    NH, KVH, H = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    dtype = params["wq"].dtype
    hidden = hidden_BTE.astype(dtype)
    embeds = params["embed"][tokens_BT].astype(dtype)
    x = jnp.concatenate(
        [
            rms_norm(embeds, params["input_norm"], c.rms_norm_eps),
            rms_norm(hidden, params["hidden_norm"], c.rms_norm_eps),
        ],
        axis=-1,
    )

    def proj(h, name):
        return jnp.einsum("bti,oi->bto", h, params[name])

    cos, sin = rope_tables(c.rope_theta, H, c.rope_scaling, c.max_position_embeddings, positions_BT)
    q = apply_rope(proj(x, "wq").reshape(B, T, NH, H), cos, sin)
    k = apply_rope(proj(x, "wk").reshape(B, T, KVH, H), cos, sin)
    v = proj(x, "wv").reshape(B, T, KVH, H)
    cache_kv = (None, None) if cache is None else cache.layer(0)
    attn = attention(q, k, v, *cache_kv, mask, H**-0.5)
    hidden = hidden + proj(attn.reshape(B, T, NH * H), "wo")
    h = rms_norm(hidden, params["post_norm"], c.rms_norm_eps)
    hidden = hidden + proj(jax.nn.silu(proj(h, "w_gate")) * proj(h, "w_up"), "w_down")
    out = rms_norm(hidden, params["norm"], c.rms_norm_eps)
    logits = jnp.einsum("bte,ve->btv", out, params["lm_head"], preferred_element_type=jnp.float32)
    new_kv = kv_cache.KVBlock(k=k[None], v=v[None])
    return ForwardOut(logits.astype(jnp.float32), new_kv, features=hidden)


def target_logits(params: dict, logits_BTD, vocab_size: int) -> jax.Array:
    """The draft logits placed on the target's vocabulary: ``-inf`` (probability 0) at every
    token outside the draft vocabulary, ``float32[B, T, V]``."""
    full = jnp.full(logits_BTD.shape[:-1] + (vocab_size,), -jnp.inf, jnp.float32)
    return full.at[..., params["d2t"]].set(logits_BTD)


# --- Logical axes (a mesh places the head's parameters like the target's) -----------------

AXES = {
    "fc": (None, "embed"),
    "input_norm": ("embed",),
    "hidden_norm": ("embed",),
    "wq": ("heads", None),
    "wk": ("kv_heads", None),
    "wv": ("kv_heads", None),
    "wo": (None, "heads"),
    "post_norm": ("embed",),
    "w_gate": ("mlp", None),
    "w_up": ("mlp", None),
    "w_down": (None, "mlp"),
    "norm": ("embed",),
    "lm_head": ("vocab", "embed"),
    "embed": ("vocab", "embed"),
    "d2t": (None,),
}


def drafter_family(forward, shapes_of, axes=AXES):
    """The namespace ``models.base.family_for_config`` finds for a learned drafter's config (the
    head's; the block drafter's): its ``forward``, and ``param_shapes(c)``, ``{name: (shape,
    logical axes)}`` of every parameter (``shapes_of(c)``: the learned ones' shapes; ``axes``:
    each one's logical axes) with the target's embedding and the vocabulary map, which
    ``sharding.shard_params`` reads. No run layout (no ``prepare_params``)."""

    def param_shapes(c) -> dict:
        shapes = dict(
            shapes_of(c), embed=(c.vocab_size, c.target_hidden_size), d2t=(c.draft_vocab_size,)
        )
        return {name: (shape, axes[name]) for name, shape in shapes.items()}

    return types.SimpleNamespace(forward=forward, param_shapes=param_shapes)


# The family the models' helpers look up (``models.base.family_for_config``): no run layout.
HeadConfig.FAMILY = drafter_family(forward, param_shapes)


@dataclasses.dataclass(frozen=True, eq=False)
class Head(Model):
    """A loaded head as the draft :class:`~asps_jax.models.Model` (``params`` are the head's;
    ``config`` a :class:`HeadConfig`)."""


# --- Checkpoints ------------------------------------------------------------------------------


def _tensors(folder: Path, where: str) -> dict[str, np.ndarray]:
    """Every tensor of the head's weight files (safetensors, sharded or not, or a PyTorch
    ``.bin``: ``models.loader``'s readers, any dtype), names without a ``model.`` prefix."""
    try:
        return {name.removeprefix("model."): a for name, a in loader.iter_tensors(folder)}
    except loader.CheckpointError as e:
        raise ValueError(f"{where}: {e}") from None


def check_matches(c, target, where: str, noun: str = "head", kind: str = "a learned head") -> None:
    """A one-line error unless the ``noun`` of config ``c`` (a head, or the block drafter's
    config: the same fields) fits ``target`` (feature width, layers, vocab)."""
    t = target.config
    if not hasattr(t, "hidden_size") or not hasattr(t, "num_hidden_layers"):
        raise ValueError(f"{where}: {kind} needs a decoder target, got {type(t).__name__}")
    if c.target_hidden_size != t.hidden_size:
        raise ValueError(
            f"{where}: the {noun} reads features of width {c.target_hidden_size}, the target "
            f"{target.name!r} has hidden size {t.hidden_size}; it was trained for another target"
        )
    if c.vocab_size != t.vocab_size:
        raise ValueError(
            f"{where}: the {noun} maps to a vocabulary of {c.vocab_size} tokens, the target "
            f"{target.name!r} has {t.vocab_size}; it was trained for another target"
        )
    if any(not 0 <= i < t.num_hidden_layers for i in c.feature_layers):
        raise ValueError(
            f"{where}: the {noun} reads target layers {list(c.feature_layers)}, the target has "
            f"{t.num_hidden_layers} (ids 0 .. {t.num_hidden_layers - 1})"
        )


def load_head(path, target, *, dtype=None) -> Head:
    """The EAGLE-3-layout head in folder ``path`` for ``target`` (one-line errors for a missing
    or corrupt file, a missing tensor, a wrong shape, or a head made for another target)."""
    folder = Path(path)
    where = f"draft={PREFIX}{path}"
    expected = (
        f"an EAGLE-3 head folder with {CONFIG_FILE} and {WEIGHTS_FILE} (or {loader.BIN_FILE})"
    )
    raw = loader.folder_config(folder, where, expected)
    nested = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    if True in (raw.get("parallel_drafting"), nested.get("parallel_drafting")):
        raise ValueError(
            f'{where}: a P-EAGLE head ("parallel_drafting": true) drafts all n positions in one '
            f'forward, which draft="eagle3:..." would not do; load it as draft="block:{path}"'
        )
    c = HeadConfig.from_hf(raw, target.config, where=f"{where}: {CONFIG_FILE}")
    check_matches(c, target, where)
    tensors = _tensors(folder, where)
    want_dtype = np.dtype(dtype or jnp.dtype(jax.tree.leaves(target.params)[0].dtype))
    params = {}
    for name, shape in param_shapes(c).items():
        a = tensors.get(TENSORS[name])
        if a is None:
            raise ValueError(f"{where}: the weights lack tensor {TENSORS[name]!r}")
        if tuple(a.shape) != shape:
            raise ValueError(
                f"{where}: tensor {TENSORS[name]!r} has shape {list(a.shape)}, the config "
                f"says {list(shape)}"
            )
        eagle3_checks.check_weight(TENSORS[name], a, where)
        params[name] = jnp.asarray(a.astype(np.float32), want_dtype)
    ids = eagle3_checks.target_ids(tensors, c.draft_vocab_size, c.vocab_size, where)
    embed = tensors.get("embed_tokens.weight")
    target_embed = target.params["embed"]
    if embed is None:
        embed = target_embed
    elif tuple(embed.shape) != tuple(target_embed.shape):
        raise ValueError(
            f"{where}: tensor 'embed_tokens.weight' has shape {list(embed.shape)}, the "
            f"target's embedding {list(target_embed.shape)}"
        )
    else:
        eagle3_checks.check_weight("embed_tokens.weight", embed, where)
    params["embed"] = jnp.asarray(np.asarray(embed, np.float32), want_dtype)
    params["d2t"] = jnp.asarray(ids, jnp.int32)
    return Head(
        name=f"{PREFIX}{path}",
        path=str(folder),
        config=c,
        params=params,
        tokenizer=target.tokenizer,
    )


def save_head(path, config: HeadConfig, params: dict, *, embed: bool = False) -> Path:
    """Write the head in the EAGLE-3 layout (``config.json`` + ``model.safetensors``, with
    ``d2t`` offsets and the ``t2d`` mask; ``embed``: also its embedding), each file replaced
    only once both are written."""
    folder = Path(path)
    host = {k: np.asarray(jax.device_get(v)) for k, v in params.items()}
    tensors = {TENSORS[name]: host[name].astype(np.float32) for name in param_shapes(config)}
    ids = host["d2t"].astype(np.int64)
    tensors["d2t"] = ids - np.arange(config.draft_vocab_size, dtype=np.int64)
    t2d = np.zeros(config.vocab_size, bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    if embed:
        tensors["embed_tokens.weight"] = host["embed"].astype(np.float32)
    return loader.write_checkpoint(
        folder, list(tensors.items()), config.to_hf(), WEIGHTS_FILE, CONFIG_FILE
    )


__all__ = [
    "ARCHITECTURE",
    "AXES",
    "drafter_family",
    "CONFIG_FILE",
    "PREFIX",
    "TENSORS",
    "WEIGHTS_FILE",
    "Head",
    "HeadConfig",
    "check_matches",
    "default_feature_layers",
    "forward",
    "fuse",
    "init_params",
    "load_head",
    "param_shapes",
    "random_params",
    "save_head",
    "target_logits",
    "trainable",
]
