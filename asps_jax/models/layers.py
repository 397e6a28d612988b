"""Building blocks the family modules share: norms, activations, attention over cache + new tokens,
the LM head, input checks and parameter initialisation. Pure functions over arrays.

Numerics follow transformers: norms and attention scores in float32, activations in the
parameters' dtype, logits returned in float32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from asps_jax.models.output import ForwardOut
from asps_jax.models.quant import einsum

# HF ``hidden_act`` / ``activation_function`` names. "gelu_new" is GPT-2's tanh approximation.
ACTIVATIONS = {
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


def activation(name: str, where: str = "config"):
    if name not in ACTIVATIONS:
        raise ValueError(f"{where}: activation {name!r} unsupported ({list(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def rms_norm(x_BTE: jax.Array, scale_E: jax.Array, eps: float) -> jax.Array:
    # Like HF: normalise in float32, cast back to the activation dtype, then scale.
    x = x_BTE.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return _last_axis(scale_E, x.ndim) * x.astype(x_BTE.dtype)


def _last_axis(w: jax.Array, ndim: int) -> jax.Array:
    """A vector shaped to broadcast along the last of ``ndim`` axes (norms over [B, T, E] and,
    for q/k norms, over [B, T, heads, H])."""
    return w.reshape((1,) * (ndim - 1) + (-1,))


def rms_norm_offset(x_BTE: jax.Array, w_E: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMS norm: scale by ``1 + w`` (weights stored as offsets from 1), all in float32,
    then cast back to the activation dtype (transformers' ``Gemma2RMSNorm``)."""
    x = x_BTE.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return (x * (1.0 + _last_axis(w_E, x.ndim).astype(jnp.float32))).astype(x_BTE.dtype)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(x / cap)`` (Gemma 2's logit soft-capping); ``x`` itself when ``cap`` is None."""
    return x if cap is None else jnp.tanh(x / cap) * cap


def layer_norm(x_BTE: jax.Array, scale_E: jax.Array, bias_E: jax.Array, eps: float) -> jax.Array:
    """``torch.nn.LayerNorm`` (biased variance), computed in float32."""
    x = x_BTE.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps)
    scale, bias = scale_E.astype(jnp.float32), bias_E.astype(jnp.float32)
    return (y * scale[None, None, :] + bias[None, None, :]).astype(x_BTE.dtype)


def lookup(table_PE: jax.Array, positions_BT: jax.Array) -> jax.Array:
    """Rows of a learned position table. Positions past its end (only ever reached by padded tree
    nodes or tokens beyond ``max_new_tokens``, whose logits are never used) take the last row."""
    return jnp.take(table_PE, positions_BT, axis=0, mode="clip")


def check_inputs(config, tokens, positions, mask, cache) -> None:
    """The shapes of the forward contract (``base.Forward``); a clear error otherwise."""
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
    B, T = tokens.shape
    if positions.shape != (B, T):
        raise ValueError(f"positions must have shape {(B, T)}, got {positions.shape}")
    S = 0 if cache is None else cache.max_len
    if mask.shape != (B, T, S + T) or mask.dtype != jnp.bool_:
        raise ValueError(f"mask must be bool[{B}, {T}, {S + T}], got {mask.dtype}{mask.shape}")
    if cache is not None:
        want = (config.num_hidden_layers, B, config.num_key_value_heads, S, config.head_dim)
        if cache.shape != want:
            raise ValueError(f"cache.k must have shape {want}, got {cache.shape}")


def window_mask(mask_BTS: jax.Array, positions_BT: jax.Array, window: int) -> jax.Array:
    """``mask`` and ``query position - key position < window`` (a sliding / local window).

    Cache slot ``s`` holds the token at position ``s`` (``kv_cache.commit`` appends in order);
    the new tokens sit at ``positions``. Intersecting with the caller's mask makes the window
    respect a tree mask too: a node sees its ancestors, and of those only the ones in its window.
    A node always sees itself (distance 0), so no row becomes empty.
    """
    B, T, width = mask_BTS.shape
    S = width - T
    cache_pos_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    key_pos_BS = jnp.concatenate([cache_pos_BS, positions_BT.astype(jnp.int32)], axis=1)
    near_BTS = positions_BT[:, :, None] - key_pos_BS[:, None, :] < window
    return mask_BTS & near_BTS


def attention(
    q_BTNH,
    k_BTKH,
    v_BTKH,
    cache_k,
    cache_v,
    mask_BTS,
    scale: float,
    softcap: float | None = None,
    cache_len: jax.Array | None = None,
    layer: jax.Array | None = None,
) -> jax.Array:
    """Grouped-query attention of T new queries over the cache (``cache_k/v [B, KVH, S, H]``, may
    be None) and the T new keys (``[B, T, KVH, H]``).

    Returns ``[B, T, NH, H]`` in the dtype of ``q``. Scores and softmax in float32; masked entries
    get ``finfo.min`` (not -inf) so a fully masked row stays finite. ``softcap``: scaled scores
    pass through :func:`soft_cap` before masking (Gemma 2).

    A new token whose key or value is not finite (a NaN embedding, an overflow) makes NaN exactly
    the queries that see it: per KV head, its key and value become 0 and its visible scores NaN,
    so the queries it is masked from (earlier tokens, sibling tree branches) are not poisoned by
    ``0 * NaN``, and a query that sees it is NaN in that head's group, hence everywhere after the
    output projection. Per head, not per token: the check reads only ``head_dim``, which no mesh
    splits (a check across KV heads was an all-reduce per layer on a ``model`` mesh).
    Cache slots are finite (``kv_cache.commit`` stores non-finite entries as 0; a row that met
    one stops, see ``decode``).

    ``cache_len`` (:func:`visible_cache_len`): read the cache up to it, by blocks; ``layer``:
    ``cache_k/v`` stacked ``[L, ...]``, this layer's read in place (:func:`_attend_cache_blocks`).
    """
    B, T, NH, H = q_BTNH.shape
    KVH = k_BTKH.shape[2]
    dtype = q_BTNH.dtype
    bad_BTK = ~jnp.all(jnp.isfinite(k_BTKH) & jnp.isfinite(v_BTKH), axis=3)
    k_BTKH = jnp.where(bad_BTK[..., None], jnp.zeros((), k_BTKH.dtype), k_BTKH)
    v_BTKH = jnp.where(bad_BTK[..., None], jnp.zeros((), v_BTKH.dtype), v_BTKH)
    q_BTKGH = q_BTNH.reshape(B, T, KVH, NH // KVH, H)
    # The cache and the new tokens are attended separately and only the (small) scores are
    # concatenated: concatenating keys/values would copy the whole cache every step.
    # (keys, values, einsum subscript): the cache [B, KVH, S, H], the new tokens [B, T, KVH, H].
    parts = [(k_BTKH, v_BTKH, "bskh")]
    if cache_k is not None and cache_len is not None and cache_block(cache_k.shape[-2]):
        here = (cache_k, cache_v, layer)
        if layer is None:
            here = (cache_k[None], cache_v[None], jnp.zeros((), jnp.int32))
        return _attend_cache_blocks(
            q_BTKGH, parts[0], here, mask_BTS, bad_BTK, scale, softcap, cache_len
        ).reshape(B, T, NH, H)
    if cache_k is not None and layer is not None:
        cache_k, cache_v = cache_k[layer], cache_v[layer]
    if cache_k is not None:
        parts.insert(0, (cache_k.astype(dtype), cache_v.astype(dtype), "bksh"))
    scores = jnp.concatenate(
        [
            jnp.einsum(f"btkgh,{kv}->bkgts", q_BTKGH, keys, preferred_element_type=jnp.float32)
            for keys, _, kv in parts
        ],
        axis=-1,
    )  # [B, KVH, G, T, S+T]
    scores = soft_cap(scores * scale, softcap)
    scores = jnp.where(mask_BTS[:, None, None], scores, jnp.finfo(jnp.float32).min)
    bad_BKS = jnp.concatenate(
        [jnp.zeros((B, KVH, scores.shape[-1] - T), bool), jnp.swapaxes(bad_BTK, 1, 2)], axis=2
    )
    scores = jnp.where(mask_BTS[:, None, None] & bad_BKS[:, :, None, None], jnp.nan, scores)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out, start = 0, 0
    for _, values, kv in parts:
        width = values.shape[kv.index("s")]
        # Output [B, KVH, G, T, H]: ordered like the cache's batch dims, so XLA reads the cache's
        # values in place (a [B, T, ...] output made it transpose them on every call).
        out = out + jnp.einsum(
            f"bkgts,{kv}->bkgth",
            probs[..., start : start + width],
            values,
            preferred_element_type=jnp.float32,
        )
        start += width
    return jnp.moveaxis(out.astype(dtype), 3, 1).reshape(B, T, NH, H)


CACHE_BLOCK = 64  # cache slots per block of the length-aware attention (a multiple of 8)


def cache_block(S: int) -> int:
    """Slots per block of the length-aware attention over an ``S``-slot cache: ``CACHE_BLOCK``
    where it divides ``S`` into two or more blocks, else 0 (the whole cache is read)."""
    return CACHE_BLOCK if S % CACHE_BLOCK == 0 and S > CACHE_BLOCK else 0


def visible_cache_len(mask_BTS: jax.Array) -> jax.Array:
    """int32 scalar: one past the last cache slot any query of ``mask_BTS`` (``[B, T, S+T]``)
    sees; slots from it on need not be read."""
    B, T, width = mask_BTS.shape
    seen_S = jnp.any(mask_BTS[:, :, : width - T], axis=(0, 1))
    return jnp.max(jnp.where(seen_S, jnp.arange(1, width - T + 1, dtype=jnp.int32), 0))


def _attend_cache_blocks(q_BTKGH, new, cache, mask_BTS, bad_BTK, scale, softcap, n):
    """:func:`attention` reading the cache only up to slot ``n``: an online softmax (running
    max, sum and weighted values in float32) starts from the new tokens' scores and folds in
    one ``cache_block`` of slots per iteration of a ``while`` loop of ``ceil(n / block)`` trips
    (named scope ``cache_blocks``, which ``hlo_census`` counts at a given trip count). A step
    then reads the filled part of the cache, not all of it. Equal to the one-pass softmax to
    float rounding; a visible non-finite new key makes the queries that see it NaN, as there,
    and a query that sees nothing stays finite (a mean of the values read; there, of all).
    ``cache``: ``(k, v, layer)``, the stacked ``[L, B, KVH, S, H]`` caches and the layer read.
    Returns ``[B, T, KVH, G, H]``."""
    B, T, KVH, G, H = q_BTKGH.shape
    cache_k, cache_v, layer = cache
    S, Sb, dtype = cache_k.shape[3], cache_block(cache_k.shape[3]), q_BTKGH.dtype
    lowest = jnp.finfo(jnp.float32).min

    def scores(keys, kv, mask_BTs):
        s = jnp.einsum(f"btkgh,{kv}->bkgts", q_BTKGH, keys, preferred_element_type=jnp.float32)
        return jnp.where(mask_BTs[:, None, None], soft_cap(s * scale, softcap), lowest)

    k_new, v_new, _ = new
    mask_new = mask_BTS[:, :, S:]
    s = scores(k_new, "bskh", mask_new)
    bad_BKS = jnp.swapaxes(bad_BTK, 1, 2)[:, :, None, None]
    s = jnp.where(mask_new[:, None, None] & bad_BKS, jnp.nan, s)  # [B, KVH, G, T, T]
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - m[..., None])
    acc = jnp.einsum(
        "bkgts,bskh->bkgth", p.astype(dtype), v_new, preferred_element_type=jnp.float32
    )

    def block(i, carry):
        m, total, acc = carry
        at = i * Sb
        zero = jnp.zeros((), jnp.int32)
        start, size = (layer, zero, zero, at, zero), (1, B, KVH, Sb, H)
        keys = jax.lax.dynamic_slice(cache_k, start, size)[0].astype(dtype)
        values = jax.lax.dynamic_slice(cache_v, start, size)[0].astype(dtype)
        s = scores(keys, "bksh", jax.lax.dynamic_slice_in_dim(mask_BTS, at, Sb, axis=2))
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        fade = jnp.exp(m - m_new)
        acc = acc * fade[..., None] + jnp.einsum(
            "bkgts,bksh->bkgth", p.astype(dtype), values, preferred_element_type=jnp.float32
        )
        return m_new, total * fade + jnp.sum(p, axis=-1), acc

    with jax.named_scope("cache_blocks"):
        trips = (jnp.minimum(n, S) + Sb - 1) // Sb
        m, total, acc = jax.lax.fori_loop(0, trips, block, (m, jnp.sum(p, axis=-1), acc))
    out = (acc / total[..., None]).astype(dtype)  # [B, KVH, G, T, H]
    return jnp.moveaxis(out, 3, 1)


def project_qkv(h_BTE: jax.Array, p: dict) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``q, k, v [B, T, heads, H]`` of one layer's ``wq/wk/wv``, plus ``bq/bk/bv`` when present."""
    out = []
    for name in ("q", "k", "v"):
        y = einsum("bte,enh->btnh", h_BTE, p["w" + name])
        out.append(y + p["b" + name][None, None] if "b" + name in p else y)
    return tuple(out)


def attention_out(attn_BTNH: jax.Array, p: dict) -> jax.Array:
    """The output projection ``wo`` (+ ``bo`` when present) back to ``[B, T, E]``."""
    y = einsum("btnh,nhe->bte", attn_BTNH, p["wo"])
    return y + p["bo"][None, None] if "bo" in p else y


def dense_mlp(h_BTE: jax.Array, p: dict, act) -> jax.Array:
    """The two-matrix MLP of the learned-position families: ``act(h w_in + b_in) w_out + b_out``."""
    h = act(einsum("bte,ef->btf", h_BTE, p["w_in"]) + p["b_in"][None, None])
    return einsum("btf,fe->bte", h, p["w_out"]) + p["b_out"][None, None]


def gpt_layer_shapes(config, ffn: int, qkv_bias: bool) -> dict:
    """``param_shapes()["layers"]`` of the learned-position families (GPT-2, GPT-Neo, OPT): layer
    norms before attention and MLP, biased output and MLP projections, optional q/k/v biases."""
    L, E, F = config.num_hidden_layers, config.hidden_size, ffn
    NH, H = config.num_attention_heads, config.head_dim
    vec = ((L, E), ("layers", "embed"))
    shapes = {
        "attn_norm": vec,
        "attn_norm_b": vec,
        "wq": ((L, E, NH, H), ("layers", "embed", "heads", "head_dim")),
        "wk": ((L, E, NH, H), ("layers", "embed", "kv_heads", "head_dim")),
        "wv": ((L, E, NH, H), ("layers", "embed", "kv_heads", "head_dim")),
    }
    if qkv_bias:
        shapes["bq"] = ((L, NH, H), ("layers", "heads", "head_dim"))
        shapes["bk"] = ((L, NH, H), ("layers", "kv_heads", "head_dim"))
        shapes["bv"] = ((L, NH, H), ("layers", "kv_heads", "head_dim"))
    shapes.update(
        wo=((L, NH, H, E), ("layers", "heads", "head_dim", "embed")),
        bo=vec,
        mlp_norm=vec,
        mlp_norm_b=vec,
        w_in=((L, E, F), ("layers", "embed", "mlp")),
        b_in=((L, F), ("layers", "mlp")),
        w_out=((L, F, E), ("layers", "mlp", "embed")),
        b_out=vec,
    )
    return shapes


def gpt_param_shapes(config, ffn: int, qkv_bias: bool) -> dict:
    """``param_shapes()`` of GPT-2 and GPT-Neo: token and learned position embeddings, the
    layers of :func:`gpt_layer_shapes`, a final layer norm and an untied head when there is one."""
    E, V = config.hidden_size, config.vocab_size
    shapes = {
        "embed": ((V, E), ("vocab", "embed")),
        "positions": ((config.max_position_embeddings, E), ("positions", "embed")),
        "layers": gpt_layer_shapes(config, ffn, qkv_bias),
        "final_norm": ((E,), ("embed",)),
        "final_norm_b": ((E,), ("embed",)),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head"] = ((E, V), ("embed", "vocab"))
    return shapes


def output_logits(x_BTE: jax.Array, params: dict, tied: bool) -> jax.Array:
    """float32 logits from the tied embedding or the ``lm_head`` of ``params``."""
    return lm_logits(x_BTE, params["embed"] if tied else params["lm_head"], tied)


@functools.partial(jax.jit, static_argnums=0)
def split_layers(L: int, layers: dict) -> tuple:
    """Stacked layers ``{name: [L, ...]}`` as ``L`` per-layer dicts, each array a copy of its
    slice (a run layout: inside a compiled forward a slice of a stacked parameter is a copy on
    every call, a separate array is read in place)."""
    return tuple(jax.tree.map(lambda a, i=i: a[i], layers) for i in range(L))


def scan_layers(layer, x, xs, features: tuple[int, ...]):
    """``lax.scan`` of ``layer(x, xs_i) -> (x, ys_i)`` over the stacked layers: ``(x, ys,
    streams)``, ``streams`` the residual stream entering each layer when ``features`` asks for
    any (else empty), for :func:`with_features`."""
    if not features:
        x, ys = jax.lax.scan(layer, x, xs)
        return x, ys, []

    def body(x, xs):
        out, ys = layer(x, xs)
        return out, (ys, x)

    x, (ys, inputs) = jax.lax.scan(body, x, xs)
    return x, ys, list(inputs)


def with_features(logits, new_kv, streams: list, features: tuple[int, ...]) -> ForwardOut:
    """A forward's result, :class:`~asps_jax.models.output.ForwardOut`: the logits, the new keys
    / values and, when ``features`` asks for any, the residual streams ``streams[i]`` of those
    layers concatenated on the last axis."""
    if not features:
        return ForwardOut(logits, new_kv)
    if any(not 0 <= i < len(streams) for i in features):
        raise ValueError(f"features: layer ids must lie in [0, {len(streams) - 1}], got {features}")
    return ForwardOut(logits, new_kv, jnp.concatenate([streams[i] for i in features], axis=-1))


def lm_logits(x_BTE: jax.Array, head: jax.Array, tied: bool) -> jax.Array:
    """float32 logits from the embedding ``[V, E]`` (tied) or a head ``[E, V]``."""
    spec = "bte,ve->btv" if tied else "bte,ev->btv"
    return jnp.einsum(spec, x_BTE, head, preferred_element_type=jnp.float32).astype(jnp.float32)


def is_spec(x) -> bool:
    """A ``(shape, axes)`` leaf of a family's ``param_shapes``."""
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], tuple)


def axes_of(shapes: dict) -> dict:
    return jax.tree.map(lambda s: s[1], shapes, is_leaf=is_spec)


def init_from_shapes(shapes: dict, key: jax.Array, std: float, dtype, constant) -> dict:
    """Weights ~ N(0, std); leaves for which ``constant(name)`` is a number are filled with it.

    One RNG draw is sliced into every weight: XLA compiles one threefry, not one per weight.
    """
    flat, treedef = jax.tree.flatten(shapes, is_leaf=is_spec)
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_spec)[0]]
    fill = [constant(str(path[-1].key)) for path in paths]
    sizes = [math.prod(shape) for (shape, _), c in zip(flat, fill, strict=True) if c is None]
    noise = std * jax.random.normal(key, (sum(sizes),), jnp.float32)
    leaves, offset = [], 0
    for (shape, _), c in zip(flat, fill, strict=True):
        if c is not None:
            leaves.append(jnp.full(shape, c, dtype))
        else:
            size = math.prod(shape)
            leaves.append(noise[offset : offset + size].reshape(shape).astype(dtype))
            offset += size
    return jax.tree.unflatten(treedef, leaves)


def gpt_constant(name: str) -> float | None:
    """Init of the learned-position families: norm scales 1, biases 0, the rest random."""
    if name.endswith("norm"):
        return 1.0
    if name.endswith("_b") or name in ("bq", "bk", "bv", "bo", "b_in", "b_out"):
        return 0.0
    return None


def check_rope_decoder_sizes(config) -> None:
    """The size checks every RoPE decoder config makes (Llama and the families over
    ``models/decoder.py``): positive sizes, whole KV groups, an even head dim for RoPE."""
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
    ):
        if int(getattr(config, name)) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({config.num_key_value_heads})"
        )
    if config.head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {config.head_dim}")
