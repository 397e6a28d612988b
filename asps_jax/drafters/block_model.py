"""The model of a parallel block drafter (``draft="block:PATH"``, :mod:`asps_jax.drafters.block`):
one forward gives the laws of the next n positions at once, from the target's own features.

Inputs (DFlash-style; Chen et al. 2025, "DFlash: block diffusion for flash speculative decoding",
and P-EAGLE's parallel drafting): the *context* is the target's residual streams entering three of
its layers at every committed position (``BlockConfig.feature_layers``, EAGLE-3's low / middle /
high ones), fused by ``fc`` and normalised (``hidden_norm``) into one vector per position; each
decoder layer projects it into keys and values of its own (RoPE at the position), so the context is
a KV cache of the drafter's over the committed prefix and is never run through the layers. The
*block* is ``N + 1`` entries at positions ``p .. p + N``: the embedding of the bonus token x_p (the
last emitted one, not yet seen by the target) and N learned mask embeddings, each normalised
(``embed_norm``) plus the context vector of the last committed position ``p - 1`` (zeros when
nothing is committed). A few Llama decoder layers run over the block; each entry attends to every
context slot before ``p`` and to every entry of the block (bidirectional within the block). Entry
``i >= 1``'s output h_i becomes the draft law of the token at position ``p + i`` over a draft
vocabulary of ``V_d <= V`` tokens (``d2t`` maps each to its target id) through the readout
(``block_config.readout``, :mod:`~asps_jax.drafters.block_readout`): ``"position"``, ``norm`` and
``lm_head`` of h_i alone (a law of the committed text only, DFlash's), or ``"recurrent"``, a small
map of h_i, the token drawn at the parent node and the parent's state, run over the depths (a law
of the node's own path too).

Checkpoints: ``config.json`` (``"architectures": ["AspsBlockDrafter"]``, the Llama sizes, and
``block_config``: ``block_size``, ``target_layer_ids``, ``readout`` (``"position"`` when absent)
and ``readout_size``) and ``model.safetensors`` (``fc``, ``hidden_norm``, ``embed_norm``,
``mask_embedding``, ``layers.{i}.*`` in Hugging Face's Llama names, ``norm``, ``lm_head``, the
recurrent readout's ``readout.*``, ``d2t`` offsets as EAGLE-3 writes them, ``t2d``; optionally
``embed_tokens``, else the target's embedding). The DFlash layout maps onto ``variant="dflash"``
(raw block embeddings, per-head q / k norms; the position-wise readout); P-EAGLE's is an EAGLE-3
head's, not this model's (:mod:`asps_jax.drafters.block_layouts`, :mod:`asps_jax.drafters.peagle`).
"""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax import kv_cache
from asps_jax.drafters import block_readout as br
from asps_jax.models import loader
from asps_jax.models.eagle3 import AXES as HEAD_AXES
from asps_jax.models.eagle3 import check_matches as head_check
from asps_jax.models.eagle3 import default_feature_layers, drafter_family, random_params
from asps_jax.models.eagle3 import trainable as trainable  # the same learned subset
from asps_jax.models.layers import rms_norm
from asps_jax.models.rope import RopeScaling, apply_rope, rope_tables

ARCHITECTURE = "AspsBlockDrafter"
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """The block drafter's static sizes (hashable: a field of the drafter, static under jit).

    ``hidden_size`` E, heads and MLP are the drafter's layers' (by default the target's);
    ``num_hidden_layers`` its decoder layers; ``target_hidden_size`` the target's (``fc`` maps
    ``len(feature_layers) * target_hidden_size`` to E); ``vocab_size`` V the target's and
    ``draft_vocab_size`` V_d its own; ``block_size`` N the positions one forward drafts;
    ``variant`` "asps" (ours) or "dflash" (DFlash's layers: each block entry its raw embedding,
    no ``embed_norm`` and no context vector added; per-head RMS norms ``q_norm`` / ``k_norm`` on
    queries and keys before RoPE, context keys included: :mod:`asps_jax.drafters.block_layouts`);
    ``readout`` ``"position"`` or ``"recurrent"`` (:mod:`~asps_jax.drafters.block_readout`) and
    ``readout_size`` the recurrent readout's width.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    feature_layers: tuple[int, ...]
    block_size: int
    variant: str = "asps"  # or "dflash": DFlash's layer math (block_layouts.py)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    readout: str = "position"
    readout_size: int = 0

    @classmethod
    def for_target(cls, target_config, *, draft_vocab_size=None, layers=None, block_size=8,
                   num_layers=1, readout="position", readout_size=None):  # fmt: skip
        """A drafter of ``num_layers`` Llama layers of the target's width, heads and MLP size,
        RoPE and norm settings the target's where it has them (a recurrent readout of
        ``readout_size``, by default the width)."""
        br.check(readout, readout_size or 1, "readout")
        c = target_config
        heads = c.num_attention_heads
        ffn = getattr(c, "intermediate_size", None) or getattr(c, "ffn_dim", None)
        return cls(
            hidden_size=c.hidden_size,
            intermediate_size=ffn or 4 * c.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", heads),
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            num_hidden_layers=num_layers,
            vocab_size=c.vocab_size,
            draft_vocab_size=draft_vocab_size or c.vocab_size,
            target_hidden_size=c.hidden_size,
            feature_layers=tuple(layers or default_feature_layers(c.num_hidden_layers)),
            block_size=block_size,
            rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
            rope_theta=getattr(c, "rope_theta", 10000.0),
            rope_scaling=getattr(c, "rope_scaling", None),
            max_position_embeddings=c.max_position_embeddings,
            readout=readout,
            readout_size=(readout_size or c.hidden_size) if readout == "recurrent" else 0,
        )

    @classmethod
    def from_hf(cls, d: dict, target_config, where: str = CONFIG_FILE) -> BlockConfig:
        """From a block drafter's ``config.json`` for ``target_config``."""
        arch = d.get("architectures") or []
        if ARCHITECTURE not in arch:
            raise ValueError(
                f"{where}: not a block drafter (architectures {arch}); expected {ARCHITECTURE!r}"
            )
        try:
            heads, hidden = int(d["num_attention_heads"]), int(d["hidden_size"])
            block = d["block_config"]
            variant = block.get("variant", "asps")
            ids = block.get("target_layer_ids")
            layers = ids or default_feature_layers(target_config.num_hidden_layers)
            max_pos = int(d.get("max_position_embeddings", 2048))
            rope = d.get("rope_scaling")
            config = cls(
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                num_hidden_layers=int(d["num_hidden_layers"]),
                vocab_size=int(d["vocab_size"]),
                draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
                target_hidden_size=int(d.get("target_hidden_size") or hidden),
                feature_layers=tuple(int(i) for i in layers),
                block_size=int(block["block_size"]),
                variant=variant,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(d.get("rope_theta", 10000.0)),
                rope_scaling=RopeScaling.from_hf(rope, max_pos),
                max_position_embeddings=max_pos,
                readout=block.get("readout", "position"),
                readout_size=int(block.get("readout_size") or 0),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{where}: not a valid block drafter config ({e!r})") from None
        if config.block_size < 1 or config.num_hidden_layers < 1:
            raise ValueError(f"{where}: block_size and num_hidden_layers must be >= 1")
        if config.variant not in VARIANTS:
            raise ValueError(
                f"{where}: block_config.variant {config.variant!r} is not one of {list(VARIANTS)}"
            )
        br.check(config.readout, config.readout_size, where)
        return config

    def to_hf(self) -> dict:
        """The ``config.json`` of this drafter."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "block_config": {
                "block_size": self.block_size,
                "target_layer_ids": list(self.feature_layers),
                **({"variant": self.variant} if self.variant != "asps" else {}),
                "readout": self.readout,
                **({"readout_size": self.readout_size} if self.readout == "recurrent" else {}),
            },
        }


# --- Parameters -------------------------------------------------------------------------------

LAYER_TENSORS = {  # ours (stacked over layers) -> Hugging Face's Llama name under layers.{i}.
    "input_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "post_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}
QK_NORMS = {  # the "dflash" variant's per-head norms (Qwen3's), under layers.{i}.
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}
VARIANTS = ("asps", "dflash")
TENSORS = {
    "fc": "fc.weight",
    "hidden_norm": "hidden_norm.weight",
    "embed_norm": "embed_norm.weight",
    "mask_embed": "mask_embedding",
    "norm": "norm.weight",
    "lm_head": "lm_head.weight",
}


def param_shapes(c: BlockConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every learned parameter (layer ones stacked ``[L, ...]``); the "dflash"
    variant has per-head ``q_norm`` / ``k_norm`` ``[L, H]`` and no ``embed_norm``."""
    E, F, L = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {
        "fc": (E, len(c.feature_layers) * c.target_hidden_size),
        "hidden_norm": (E,),
        "embed_norm": (E,),
        "mask_embed": (c.block_size, E),
        "input_norm": (L, E),
        "wq": (L, q, E),
        "wk": (L, kv, E),
        "wv": (L, kv, E),
        "wo": (L, E, q),
        "post_norm": (L, E),
        "w_gate": (L, F, E),
        "w_up": (L, F, E),
        "w_down": (L, E, F),
        "norm": (E,),
        "lm_head": (c.draft_vocab_size, E),
        **br.shapes(c),
    }
    if c.variant == "dflash":  # raw embeddings into the block; Qwen3's per-head norms
        del shapes["embed_norm"]
        shapes.update({name: (L, c.head_dim) for name in QK_NORMS})
    return shapes


def layer_names(c: BlockConfig) -> dict[str, str]:
    """Our stacked layer tensors -> their Hugging Face names under ``layers.{i}.``."""
    return {**LAYER_TENSORS, **(QK_NORMS if c.variant == "dflash" else {})}


def init_params(c: BlockConfig, key, embed, d2t, std: float = 0.02, dtype=jnp.float32) -> dict:
    """Random weights ~ N(0, std), norm scales 1, with the target's ``embed [V, E]`` and ``d2t``
    (the head's :func:`~asps_jax.models.eagle3.random_params` of :func:`param_shapes`)."""
    return random_params(param_shapes(c), key, embed, d2t, std, dtype)


# --- Forward ----------------------------------------------------------------------------------


def prepare_params(c: BlockConfig, params: dict, wide: bool = False) -> dict:
    """The run layout of ``params`` on a CPU device (``models.base.run_params``; an accelerator
    runs the stored layout): ``"layers"`` a tuple of L per-layer dicts of the layer tensors, every
    matrix ``[in, out]``, and ``fc`` ``[in, out]`` too; the rest (embedding, norms, mask
    embeddings, the readout and ``lm_head``, which multiply one row a depth) as stored.

    The block forward multiplies ``n + 1`` rows per chain, and so does the context's write: sliced
    out of a stacked ``[L, ...]`` parameter inside the step, each layer's weights were copied on
    every call (XLA cannot alias a slice of an input buffer), and XLA:CPU's product of 2 to 17 rows
    runs ~1.6x faster on an ``[in, out]`` matrix (the Llama run layout's reason, ``llama.py``).
    Made once per loaded drafter (``wide`` is irrelevant: the block is always several rows);
    idempotent; the same math as the stored layout to float tolerance."""
    del wide
    if "layers" in params:
        return params
    names = layer_names(c)
    run = {k: v for k, v in params.items() if k not in names}
    run["fc"] = params["fc"].T
    run["layers"] = tuple(
        {name: _run_tensor(params[name][i]) for name in names} for i in range(c.num_hidden_layers)
    )
    return run


def _run_tensor(a):
    """A layer tensor in the run layout: a matrix ``[in, out]`` (stored ``[out, in]``)."""
    return a.T if a.ndim == 2 else a


def _layers(c: BlockConfig, params: dict) -> tuple[bool, list[dict]]:
    """``(run, per-layer tensors)``: the run layout's dicts (``[in, out]`` matrices), or the stored
    layout's slices (``[out, in]``)."""
    if "layers" in params:
        return True, list(params["layers"])
    names = layer_names(c)
    return False, [{n: params[n][i] for n in names} for i in range(c.num_hidden_layers)]


def _project(x, w, run: bool):
    """``x [..., in]`` times a weight matrix in either layout (``[in, out]`` when ``run``)."""
    return jnp.einsum("...i,io->...o" if run else "...i,oi->...o", x, w)


def dtype_of(params: dict):
    """The drafter's compute dtype (its weights')."""
    return params["fc"].dtype


def context(c: BlockConfig, params: dict, features_BSF) -> jax.Array:
    """The context vectors ``[B, S, E]``: the target's features ``[B, S, F]`` fused by ``fc`` and
    normalised (``hidden_norm``)."""
    fused = _project(features_BSF.astype(dtype_of(params)), params["fc"], "layers" in params)
    return rms_norm(fused, params["hidden_norm"], c.rms_norm_eps)


def context_kv(c: BlockConfig, params: dict, features_BSF, positions_BS) -> kv_cache.KVBlock:
    """Every layer's keys / values of the context at ``positions_BS`` from the target's features
    ``[B, S, F]``: ``KVBlock`` of ``[L, B, S, KVH, H]`` (what the drafter's cache stores)."""
    B, S = positions_BS.shape
    ctx = context(c, params, features_BSF)
    cos, sin = rope_tables(
        c.rope_theta, c.head_dim, c.rope_scaling, c.max_position_embeddings, positions_BS
    )
    shape = (B, S, c.num_key_value_heads, c.head_dim)
    run, layers = _layers(c, params)
    keys, values = [], []
    for p in layers:
        k = _project(ctx, p["wk"], run).reshape(shape)
        keys.append(apply_rope(_head_norm(c, p, "k_norm", k), cos, sin))
        values.append(_project(ctx, p["wv"], run).reshape(shape))
    return kv_cache.KVBlock(k=jnp.stack(keys), v=jnp.stack(values))


def _head_norm(c: BlockConfig, p: dict, name: str, x):
    """The "dflash" variant's per-head RMS norm ``name`` (of one layer's tensors ``p``) on
    queries / keys ``[..., heads, H]`` (before RoPE, as Qwen3's); ``x`` itself for ours."""
    if c.variant != "dflash":
        return x
    return rms_norm(x, p[name], c.rms_norm_eps)


def _attend(q, k, v, ctx_k, ctx_v, ctx_valid_BAS, scale: float):
    """Block queries ``q [B, A, T, NH, H]`` over the context (``ctx_k/v [B, KVH, S, H]``, visible
    where ``ctx_valid``) and every key of their own block (``k/v [B, A, T, KVH, H]``):
    ``[B, A, T, NH * H]``."""
    B, A, T, NH, H = q.shape
    KVH = k.shape[3]
    qg = q.reshape(B, A, T, KVH, NH // KVH, H)
    f32 = jnp.float32
    s_ctx = jnp.einsum("batkgh,bksh->batkgs", qg, ctx_k.astype(q.dtype), preferred_element_type=f32)
    s_ctx = jnp.where(ctx_valid_BAS[:, :, None, None, None, :], s_ctx * scale, jnp.finfo(f32).min)
    s_blk = jnp.einsum("batkgh,baukh->batkgu", qg, k, preferred_element_type=f32) * scale
    probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1).astype(q.dtype)
    S = ctx_k.shape[2]
    out = jnp.einsum("batkgs,bksh->batkgh", probs[..., :S], ctx_v.astype(q.dtype),
                     preferred_element_type=f32)  # fmt: skip
    out = out + jnp.einsum("batkgu,baukh->batkgh", probs[..., S:], v, preferred_element_type=f32)
    return out.astype(q.dtype).reshape(B, A, T, NH * H)


def forward(c: BlockConfig, params: dict, ctx_k, ctx_v, ctx_valid_BAS, last_BAE, tokens_BA,
            positions_BA, parents_BAN=None):  # fmt: skip
    """The draft logits ``float32[B, A, N, V_d]`` of A blocks per row (:func:`hidden`, then the
    readout; a recurrent one teacher-forced on ``parents_BAN``, depth i's parent token)."""
    h = hidden(c, params, ctx_k, ctx_v, ctx_valid_BAS, last_BAE, tokens_BA, positions_BA)
    return br.logits(c, params, h, parents_BAN)


def hidden(c: BlockConfig, params: dict, ctx_k, ctx_v, ctx_valid_BAS, last_BAE, tokens_BA,
           positions_BA):  # fmt: skip
    """The block's output states ``[B, A, N, E]`` of A blocks per row: block a starts with token
    ``tokens_BA[:, a]`` at position ``positions_BA[:, a]``, sees the context slots where
    ``ctx_valid_BAS`` (``ctx_k/v``: the cache's, ``[L, B, KVH, S, H]`` or a tuple of L ``[B, KVH,
    S, H]`` with the run layout's parameters: read in place), and every entry adds
    ``last_BAE[:, a]``, the context vector of the last committed position (zeros if none); entry
    i of its N reads out the token at position ``positions + 1 + i``."""
    B, A = tokens_BA.shape
    N, E, H = c.block_size, c.hidden_size, c.head_dim
    NH, KVH, eps = c.num_attention_heads, c.num_key_value_heads, c.rms_norm_eps
    dtype = dtype_of(params)
    first = params["embed"][tokens_BA].astype(dtype)[:, :, None]
    masks = jnp.broadcast_to(params["mask_embed"].astype(dtype), (B, A, N, E))
    x = jnp.concatenate([first, masks], axis=2)  # [B, A, T = N + 1, E]
    if c.variant == "asps":  # DFlash's entries are the raw embeddings
        x = rms_norm(x, params["embed_norm"], eps) + last_BAE.astype(dtype)[:, :, None, :]
    T = N + 1
    positions = positions_BA[:, :, None] + jnp.arange(T, dtype=jnp.int32)[None, None, :]
    cos, sin = rope_tables(
        c.rope_theta, H, c.rope_scaling, c.max_position_embeddings, positions.reshape(B, A * T)
    )

    run, layers = _layers(c, params)

    def heads(h, w, n):  # [B, A, T, E] -> [B, A, T, n, H], RoPE'd when n is a key / query
        return _project(h, w, run).reshape(B, A, T, n, H)

    def rope(x):
        return apply_rope(x.reshape(B, A * T, -1, H), cos, sin).reshape(x.shape)

    for layer, p in enumerate(layers):
        h = rms_norm(x, p["input_norm"], eps)
        q = rope(_head_norm(c, p, "q_norm", heads(h, p["wq"], NH)))
        k = rope(_head_norm(c, p, "k_norm", heads(h, p["wk"], KVH)))
        v = heads(h, p["wv"], KVH)
        attn = _attend(q, k, v, ctx_k[layer], ctx_v[layer], ctx_valid_BAS, H**-0.5)
        x = x + _project(attn, p["wo"], run)
        h = rms_norm(x, p["post_norm"], eps)
        gate = jax.nn.silu(_project(h, p["w_gate"], run))
        x = x + _project(gate * _project(h, p["w_up"], run), p["w_down"], run)
    return x[:, :, 1:]


# Logical axes (a mesh places the drafter's parameters like the head's): a layer tensor's are the
# head's with its stacked layer axis first, whole on every chip.
AXES = {
    **HEAD_AXES,
    **{name: (None, *HEAD_AXES[name]) for name in LAYER_TENSORS},
    "embed_norm": ("embed",),
    "mask_embed": (None, "embed"),
    **{name: (None, None) for name in QK_NORMS},
    **br.AXES,
}

# The family the models' helpers look up (``models.base.family_for_config``), with its CPU run
# layout (``prepare_params``).
BlockConfig.FAMILY = types.SimpleNamespace(
    **vars(drafter_family(forward, param_shapes, AXES)), prepare_params=prepare_params
)


# --- Checkpoints ------------------------------------------------------------------------------


def tensor_names(c: BlockConfig) -> dict[tuple[str, int | None], str]:
    """``(our name, layer or None) -> the checkpoint's tensor name``."""
    shapes = param_shapes(c)
    names = {(ours, None): theirs for ours, theirs in TENSORS.items() if ours in shapes}
    for layer in range(c.num_hidden_layers):
        for ours, theirs in layer_names(c).items():
            names[(ours, layer)] = f"layers.{layer}.{theirs}"
    names.update({(ours, None): br.TENSORS[ours] for ours in br.shapes(c)})
    return names


def read_config(folder: Path, target_config, where: str) -> BlockConfig:
    """The folder's ``config.json`` as a :class:`BlockConfig` (one-line errors)."""
    expected = f"a block drafter folder with {CONFIG_FILE} and {WEIGHTS_FILE}"
    raw = loader.folder_config(folder, where, expected)
    return BlockConfig.from_hf(raw, target_config, where=f"{where}: {CONFIG_FILE}")


def read_params(folder: Path, c: BlockConfig, dtype, where: str) -> dict:
    """The learned parameters of ``folder`` stacked as :func:`param_shapes` says, and its
    ``d2t`` (target ids) and optional ``embed_tokens`` as host arrays (one-line errors)."""
    try:
        tensors = {n.removeprefix("model."): a for n, a in loader.iter_tensors(folder)}
    except loader.CheckpointError as e:
        raise ValueError(f"{where}: {e}") from None
    shapes = param_shapes(c)
    parts: dict[str, list] = {name: [] for name in shapes}
    for (ours, layer), theirs in tensor_names(c).items():
        a = tensors.get(theirs)
        want = shapes[ours] if layer is None else shapes[ours][1:]
        if a is None:
            raise ValueError(f"{where}: the weights lack tensor {theirs!r}")
        if tuple(a.shape) != want:
            raise ValueError(
                f"{where}: tensor {theirs!r} has shape {list(a.shape)}, the config says "
                f"{list(want)}"
            )
        parts[ours].append(np.asarray(a, np.float32))
    params = {
        name: jnp.asarray(a[0] if len(shapes[name]) == a[0].ndim else np.stack(a), dtype)
        for name, a in parts.items()
    }
    return dict(params, d2t=_d2t(tensors.get("d2t"), c, where)), tensors.get("embed_tokens.weight")


def _d2t(offsets, c: BlockConfig, where: str) -> np.ndarray:
    """The target id of each draft id from the checkpoint's ``d2t`` offsets (checked)."""
    if offsets is None:
        if c.draft_vocab_size != c.vocab_size:
            raise ValueError(f"{where}: the weights lack 'd2t' (the draft-to-target map)")
        offsets = np.zeros(c.vocab_size, np.int64)
    if offsets.shape != (c.draft_vocab_size,) or offsets.dtype.kind not in "iu":
        raise ValueError(
            f"{where}: 'd2t' must be {c.draft_vocab_size} integer offsets (one per draft id), "
            f"got {offsets.dtype} of shape {list(offsets.shape)}"
        )
    ids = np.arange(c.draft_vocab_size) + offsets.astype(np.int64)
    if ids.min() < 0 or ids.max() >= c.vocab_size:
        raise ValueError(
            f"{where}: 'd2t' must map each of the {c.draft_vocab_size} draft ids to a target id "
            f"in [0, {c.vocab_size})"
        )
    if len(np.unique(ids)) != len(ids):
        raise ValueError(f"{where}: 'd2t' maps two draft ids to one target id")
    return ids.astype(np.int32)


def save(path, config: BlockConfig, params: dict, *, embed: bool = False) -> Path:
    """Write the drafter (``config.json`` + ``model.safetensors``, ``d2t`` as offsets and the
    ``t2d`` mask; ``embed``: also its embedding), each file replaced whole."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    host = {k: np.asarray(jax.device_get(v), np.float32) for k, v in params.items() if k != "d2t"}
    tensors = {
        theirs: host[ours] if layer is None else host[ours][layer]
        for (ours, layer), theirs in tensor_names(config).items()
    }
    ids = np.asarray(jax.device_get(params["d2t"])).astype(np.int64)
    tensors["d2t"] = ids - np.arange(config.draft_vocab_size, dtype=np.int64)
    t2d = np.zeros(config.vocab_size, bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    if embed:
        tensors["embed_tokens.weight"] = host["embed"]
    tmp = folder / (WEIGHTS_FILE + ".tmp")
    loader.write_safetensors(tmp, list(tensors.items()))
    tmp.replace(folder / WEIGHTS_FILE)
    tmp = folder / (CONFIG_FILE + ".tmp")
    tmp.write_text(json.dumps(config.to_hf(), indent=2) + "\n")
    tmp.replace(folder / CONFIG_FILE)
    return folder


def check_matches(c: BlockConfig, target, where: str) -> None:
    """A one-line error unless the drafter ``c`` fits ``target`` (feature width, layers, vocab:
    the head's checks, :func:`asps_jax.models.eagle3.check_matches`)."""
    head_check(c, target, where, noun="drafter", kind="a block drafter")
