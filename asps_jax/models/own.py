"""Your own JAX model as a :class:`~asps_jax.models.Model`: a forward and its parameters.

``own_model(forward, params, ...)`` wraps any pure function with the forward contract of
``docs/design.md`` (Models)::

    forward(params, tokens int32[B, T], positions int32[B, T], mask bool[B, T, S+T], cache)
        -> (logits float32[B, T, V], new_kv)

* ``positions``, ``mask`` and ``cache`` come from the caller (prefill, a draft chain, a whole
  tree of drafts); the forward must use them as given: token t sees key j iff ``mask[b, t, j]``,
  the keys being the ``S`` cache slots, then the ``T`` new tokens;
* ``cache`` is a ``KVCache`` (read layer ``i`` with ``cache.layer(i)``: keys and values
  ``[B, KVH, S, H]``) or None; the forward only *reads* it;
* ``new_kv`` holds the keys and values of the ``T`` new tokens, ``KVBlock(k, v)`` or ``(k, v)``,
  each ``[L, B, T, KVH, H]``; the decoding loop commits the accepted ones itself.

``nnx_model(module, ...)`` does the same for a Flax NNX module whose ``__call__(tokens, positions,
mask, cache)`` keeps that contract: its ``nnx.Param`` variables become the parameters (a plain
nested dict), the rest of its state is held fixed.

Every call is checked while it is traced (shapes and dtypes are static, so nothing runs per
token): a broken rule is a :class:`ContractError` of one line naming it. ``param_axes`` (the
params' structure, each leaf a tuple of logical axis names of ``sharding.ShardingRules`` or None)
lets ``sample(..., mesh=...)`` shard the parameters; without it they are replicated.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax.kv_cache import KVBlock, KVCache
from asps_jax.models.layers import check_inputs
from asps_jax.models.output import ForwardOut

RULE = "the forward contract (docs/design.md, Models)"


class ContractError(ValueError):
    """A user's forward broke the forward contract; the message names the rule."""


@dataclasses.dataclass(frozen=True)
class OwnConfig:
    """The numbers the decoding loop reads (``base.ModelConfig``) and the user's forward.

    Hashable (a static argument of ``jax.jit``): the forward compares by identity, the
    parameter layout by its tree structure and ``(shape, axes)`` leaves.
    """

    # forward(params, tokens, positions, mask, cache) -> (logits, new_kv). Not in the repr: a
    # function's address differs between processes, which compare the decoder's repr.
    apply: Callable = dataclasses.field(repr=False)
    vocab_size: int
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    eos_token_id: int | tuple[int, ...] | None = None
    treedef: Any = None  # of the params
    specs: tuple = ()  # ((shape, axes), ...) per params leaf, in tree order
    tie_word_embeddings: bool = False  # not used; part of base.ModelConfig

    def __post_init__(self):
        for name in (
            "vocab_size",
            "num_hidden_layers",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not callable(self.apply):
            raise TypeError(f"forward must be callable, got {type(self.apply).__name__}")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    def to_hf(self) -> dict:
        return {"model_type": None, "vocab_size": self.vocab_size}


def check_output(config: OwnConfig, out, tokens: jax.Array, cache) -> tuple[jax.Array, KVBlock]:
    """``out`` of a user's forward, checked against the contract (at trace time)."""
    B, T = tokens.shape
    L, KVH, H, V = (
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
        config.vocab_size,
    )
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ContractError(
            f"own model: the forward must return (logits, new_kv), got {type(out).__name__} "
            f"({RULE})"
        )
    logits, new_kv = out
    if isinstance(new_kv, KVCache):
        raise ContractError(
            "own model: the forward returned a KVCache, i.e. wrote the cache; return only the "
            f"new tokens' keys and values, KVBlock [L, B, T, KVH, H], the caller commits ({RULE})"
        )
    if isinstance(new_kv, (tuple, list)) and len(new_kv) == 2:
        new_kv = KVBlock(k=new_kv[0], v=new_kv[1])
    if not isinstance(new_kv, KVBlock):
        raise ContractError(
            f"own model: new_kv must be KVBlock(k, v) or (k, v), got {type(new_kv).__name__} "
            f"({RULE})"
        )
    want = (L, B, T, KVH, H)
    for name in ("k", "v"):
        a = getattr(new_kv, name)
        shape = tuple(getattr(a, "shape", ()))
        if shape != want:
            S = 0 if cache is None else cache.max_len
            slots = {S, S + T}
            wrote = cache is not None and len(shape) == 5 and bool(slots & {shape[2], shape[3]})
            hint = " (the cache's S slots: the cache was written)" if wrote else ""
            raise ContractError(
                f"own model: new_kv.{name} must be [L, B, T, KVH, H] = {list(want)} for the T new "
                f"tokens only, got {list(shape)}{hint} ({RULE})"
            )
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ContractError(f"own model: new_kv.{name} must be floating, got {a.dtype}")
    shape = tuple(getattr(logits, "shape", ()))
    if shape != (B, T, V):
        raise ContractError(
            f"own model: logits must be [B, T, V] = {[B, T, V]}, got {list(shape)} ({RULE})"
        )
    if logits.dtype != jnp.float32:
        raise ContractError(
            f"own model: logits must be float32 (verification math is float32), got "
            f"{logits.dtype}; return logits.astype(jnp.float32) ({RULE})"
        )
    return logits, new_kv


def _forward(config: OwnConfig, params, tokens, positions, mask, cache):
    check_inputs(config, tokens, positions, mask, cache)
    out = config.apply(params, tokens, positions, mask, cache)
    return ForwardOut(*check_output(config, out, tokens, cache))


def _param_shapes(config: OwnConfig):
    if config.treedef is None:
        raise ValueError("own model: no parameter layout recorded")
    return jax.tree.unflatten(config.treedef, list(config.specs))


FAMILY = types.SimpleNamespace(MODEL_TYPE=None, forward=_forward, param_shapes=_param_shapes)
OwnConfig.FAMILY = FAMILY


def _specs(params, param_axes) -> tuple[Any, tuple]:
    leaves, treedef = jax.tree.flatten(params)
    if not leaves:
        raise ValueError("params: the model has no parameters (an empty pytree)")
    for a in leaves:
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise ValueError(f"params: every leaf must be an array, got {type(a).__name__}")
    if param_axes is None:
        axes = [(None,) * a.ndim for a in leaves]
    else:
        try:  # one tuple (or None) per parameter
            axes = treedef.flatten_up_to(param_axes)
        except (ValueError, TypeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"param_axes must have the structure of params ({first})") from None
        for i, (a, ax) in enumerate(zip(leaves, axes, strict=True)):
            ax = (None,) * a.ndim if ax is None else tuple(ax)
            if len(ax) != a.ndim:
                raise ValueError(
                    f"param_axes: leaf {i} names {len(ax)} axes {ax} for an array of shape "
                    f"{tuple(a.shape)}"
                )
            axes[i] = ax
    return treedef, tuple((tuple(a.shape), tuple(ax)) for a, ax in zip(leaves, axes, strict=True))


def own_model(
    forward: Callable,
    params,
    *,
    vocab_size: int,
    num_hidden_layers: int,
    num_key_value_heads: int,
    head_dim: int,
    max_position_embeddings: int,
    eos_token_id: int | tuple[int, ...] | None = None,
    param_axes=None,
    tokenizer=None,
    name: str = "own model",
):
    """A :class:`~asps_jax.models.Model` that ``sample`` runs with ``forward`` and ``params``.

    ``num_hidden_layers``, ``num_key_value_heads`` and ``head_dim`` size the KV cache (``L``,
    ``KVH``, ``H`` of ``new_kv``); ``max_position_embeddings`` bounds prompt + new tokens.
    """
    from asps_jax.models.base import Model

    sizes = dict(
        vocab_size=vocab_size,
        num_hidden_layers=num_hidden_layers,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
    )
    for key, value in sizes.items():
        bad = isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
        if bad or value < 1:
            raise ValueError(f"own model: {key} must be an integer >= 1, got {value!r}")
        sizes[key] = int(value)
    vocab_size = sizes["vocab_size"]
    if tokenizer is not None and vocab_size > len(tokenizer):
        raise ValueError(
            f"own model: vocab_size={vocab_size} exceeds the tokenizer's {len(tokenizer)} tokens, "
            f"so ids {len(tokenizer)}..{vocab_size - 1} would be sampled with no text; give "
            f"vocab_size={len(tokenizer)} (the forward's logits cut to it) or a tokenizer that "
            "has them"
        )
    treedef, specs = _specs(params, param_axes)
    config = OwnConfig(
        apply=forward,
        **sizes,
        eos_token_id=eos_token_id,
        treedef=treedef,
        specs=specs,
    )
    return Model(name=name, path="", config=config, params=params, tokenizer=tokenizer)


def nnx_model(module, **kwargs):
    """:func:`own_model` of a Flax NNX module whose ``__call__(tokens, positions, mask, cache)``
    keeps the forward contract. Its ``nnx.Param`` variables are the parameters (a nested dict,
    as ``nnx.to_pure_dict`` gives; ``param_axes`` follows that structure); its other state is held
    fixed, and a call that changes any of the module's state (a cache or counter kept in an
    ``nnx.Variable``) is a :class:`ContractError`."""
    try:
        import flax
        from flax import nnx
    except ImportError as e:
        raise ImportError(
            f"nnx_model needs Flax ({e}); pip install 'asps_jax[nnx]' (or flax>=0.12)"
        ) from None

    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    params = nnx.to_pure_dict(params)

    wrote = ContractError(
        "own model: the NNX module changed its own state during the forward (e.g. a KV cache "
        f"kept in an nnx.Variable); keep the cache outside and return the new tokens' keys and "
        f"values ({RULE})"
    )

    def forward(params, tokens, positions, mask, cache):
        m = nnx.merge(graphdef, params, rest)
        try:
            out = m(tokens, positions, mask, cache)
        except flax.errors.TraceContextError:  # a non-parameter Variable assigned inside jit
            raise wrote from None
        before = jax.tree.leaves((params, rest))
        after = jax.tree.leaves(nnx.split(m, nnx.Param, ...)[1:])
        if len(before) != len(after) or any(a is not b for a, b in zip(before, after)):
            raise wrote
        return out

    return own_model(forward, params, **kwargs)
