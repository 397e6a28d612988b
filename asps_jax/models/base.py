"""The model-family contract, the registry, the ``Model`` record and the target/draft check.

A family is one module (``llama.py``, ``opt.py``, ``gpt2.py``, ``gpt_neo.py``) that satisfies
:class:`Family`: a hashable config satisfying :class:`ModelConfig`, a pure :class:`Forward`, its
parameter shapes with logical axes, and its Hugging Face tensor table (``hf_table.HFTensor``
entries, each owning its layout transform). Nothing outside the module knows the family's names;
adding one is the module, its test, its card and one entry in :data:`FAMILY_MODULES`. A family
may also provide ``prepare_params``, a faster run layout of its stored parameters
(:func:`run_params`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import weakref
from typing import Any, Protocol, runtime_checkable

import jax

from asps_jax import platforms
from asps_jax.kv_cache import KVBlock


@runtime_checkable
class ModelConfig(Protocol):
    """What code outside a family reads from its config (a frozen, hashable dataclass: it is a
    static argument of ``jax.jit``).

    ``kv_cache.init_cache`` reads the layer count and the K/V head shape; the sampler reads
    ``vocab_size`` (prompt check, vocabulary compatibility), ``max_position_embeddings`` (the
    context) and ``eos_token_id``; the loader reads ``tie_word_embeddings`` through the family's
    ``param_shapes`` and writes ``to_hf()`` as ``config.json`` (its keys are the ones model cards
    name under ``"architecture"``).
    """

    vocab_size: int  # V, rows of the embedding (may exceed the tokenizer's size, e.g. OPT)
    num_hidden_layers: int  # L
    num_key_value_heads: int  # KVH
    head_dim: int  # H
    max_position_embeddings: int  # positions 0 .. this - 1 are valid
    eos_token_id: int | tuple[int, ...] | None
    tie_word_embeddings: bool

    def to_hf(self) -> dict: ...


class FirstLayers:
    """A config whose first ``L`` layers, final norm and head make a model of their own (the
    draft of ``draft="self:L"``, :mod:`asps_jax.drafters.self_layers`): families mix it in, and
    override its methods where a layer has per-layer fields or an attention window."""

    def first_layers(self, layers: int):
        """This config cut to its first ``layers`` layers."""
        return dataclasses.replace(self, num_hidden_layers=layers)

    def has_window(self) -> bool:
        """Whether some layer attends through a sliding window (its key positions come from slot
        indices, so a draft of these layers cannot read the target's cache in scratch slots)."""
        return False


class Forward(Protocol):
    """``forward(config, params, tokens, positions, mask, cache) -> (logits, new_kv)``.

    * ``tokens`` int32[B, T] and ``positions`` int32[B, T] come from the caller: a tree node at
      depth d after a prefix of length n has position n + d (``scoring.score_tree``);
    * ``mask`` bool[B, T, S+T] (the S cache slots, then the T new tokens; bool[B, T, T] without a
      cache): ``mask[b, t, j]`` lets token t see key j. Every row has a True entry. Cache slot s
      holds the token at position s, so a family with a local window can derive key positions;
    * ``cache`` a ``KVCache`` [L, B, KVH, S, H] or None; it is only read;
    * returns float32 logits [B, T, V] and the new keys/values ``KVBlock`` [L, B, T, KVH, H],
      which the caller commits (only the accepted path) with ``kv_cache.commit``.
    """

    def __call__(
        self, config, params, tokens: jax.Array, positions: jax.Array, mask: jax.Array, cache
    ) -> tuple[jax.Array, KVBlock]: ...


class Family(Protocol):
    """The module-level names of a family module."""

    MODEL_TYPE: str  # config.json "model_type"
    ARCHITECTURE: str  # config.json "architectures"[0] when we write a checkpoint
    CONFIG_CLASS: type
    HF_PREFIX: str  # the base model's prefix ("model.", "transformer."), absent in bare checkpoints
    HF_TENSORS: tuple  # of hf_table.HFTensor
    HF_IGNORED: tuple  # regexes (full match) of HF buffers that are not parameters

    def config_from_hf(self, d: dict) -> ModelConfig: ...
    def param_shapes(self, config) -> dict: ...  # {name: (shape, logical axes)}, nested
    def init_params(self, config, key, dtype=...) -> dict: ...

    forward: Forward


# The registry: adding a family is one more name here (a module of asps_jax.models).
FAMILY_MODULES = (
    "llama",
    "opt",
    "gpt2",
    "gpt_neo",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma2",
    "gemma3_text",
)
_REQUIRED = (
    "MODEL_TYPE ARCHITECTURE CONFIG_CLASS HF_PREFIX HF_TENSORS HF_IGNORED "
    "config_from_hf param_shapes init_params forward"
).split()


def _register(names) -> dict:
    families = {}
    for name in names:
        module = importlib.import_module(f"asps_jax.models.{name}")
        missing = [a for a in _REQUIRED if not hasattr(module, a)]
        if missing:
            raise TypeError(f"model family {name!r} lacks {missing} (see base.Family)")
        families[module.MODEL_TYPE] = module
    return families


FAMILIES = _register(FAMILY_MODULES)


def family_for_type(model_type: str | None, where: str = "config"):
    if model_type not in FAMILIES:
        raise ValueError(
            f"{where}: model_type {model_type!r} is not supported; supported: {sorted(FAMILIES)}"
        )
    return FAMILIES[model_type]


def family_for_config(config):
    """The family module of ``config``; a config class outside the registry (a view such as
    ``vocab.SharedVocab``, a user's own model, ``own.OwnConfig``) names its family object in a
    ``FAMILY`` class attribute."""
    family = getattr(type(config), "FAMILY", None)
    if family is not None:
        return family
    for family in FAMILIES.values():  # the exact class first: family configs may share a base
        if type(config) is family.CONFIG_CLASS:
            return family
    for family in FAMILIES.values():
        if isinstance(config, family.CONFIG_CLASS):
            return family
    raise ValueError(f"config: no model family for {type(config).__name__}")


@functools.lru_cache(maxsize=64)
def forward_for(config, features: tuple[int, ...] = ()):
    """``forward(params, tokens, positions, mask, cache)`` with the static config bound.

    Cached, so equal configs give the *same* function object: passing it as a static argument of
    ``jax.jit`` then hits the compilation cache instead of recompiling per call. ``features``
    (layer ids): the forward also returns the residual stream entering those layers, as a third
    value (every family; a user's own forward without a ``features`` argument is a one-line
    error).
    """
    family = family_for_config(config)
    if not features:
        return functools.partial(family.forward, config)
    if "features" not in inspect.signature(family.forward).parameters:
        raise ValueError(
            f"a learned head reads the target's hidden states, which the forward of "
            f"{type(config).__name__} does not return (it takes no features= argument)"
        )
    return functools.partial(family.forward, config, features=tuple(features))


# Test / benchmark override of :func:`scan_layout_for`: "scan" or "unrolled" (unset: the devices).
LAYOUT_ENV = "ASPS_JAX_LAYOUT"
LAYOUTS = ("scan", "unrolled")


def scan_layout_for(params) -> bool:
    """Whether the layers of ``params`` run as one ``lax.scan`` over the stored stacked layout
    (True) rather than unrolled over a family's per-layer run layout (False), decided from the
    devices the parameters live on, so from the devices the call runs on (never from the host
    process's default backend): an accelerator scans (one compiled layer, weights and cache read
    in place, per-layer fields as scan inputs), XLA:CPU unrolls (``docs/design.md``, models).
    Parameters with no placement (NumPy arrays, shapes without a sharding) run on the default
    device. The environment variable ``ASPS_JAX_LAYOUT`` (``scan`` / ``unrolled``) forces a
    layout: tests and benchmarks use it to run the scan path on CPU."""
    forced = os.environ.get(LAYOUT_ENV, "")
    if forced:
        if forced not in LAYOUTS:
            raise ValueError(f"{LAYOUT_ENV}={forced!r}: must be one of {LAYOUTS} or unset")
        return forced == "scan"
    return platforms.of(None, params) != "cpu"


def prepare_params(config, params, wide: bool = False, scan: bool | None = None):
    """``params`` in the layout the decoding loop runs: on a CPU device the family's run layout
    (its ``prepare_params``; unchanged if it has none), on an accelerator the stored stacked
    layout itself (``scan``, default :func:`scan_layout_for`). ``wide``: for calls that multiply
    two or more rows per forward (a family may lay its matrices out differently for those; Llama
    does)."""
    prepare = getattr(family_for_config(config), "prepare_params", None)
    scan = scan_layout_for(params) if scan is None else scan
    if prepare is None or scan:
        return params
    return prepare(config, params, wide)


# Run-layout copies, per model and orientation (weak keys: dropping the Model frees its copies).
_RUN_PARAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def run_params(model, params=None, *, wide: bool = False):
    """:func:`prepare_params` of ``params`` (default ``model.params``; or e.g. its copy placed
    on a mesh), made once and remembered per model, ``wide`` and layout for the last ``params``
    seen.

    The stored layout stays what checkpoints, sharding rules and ``param_shapes`` describe; on a
    CPU device this is the copy the decoding loop runs on (e.g. Llama's per-layer weights,
    ``llama.py``); on an accelerator the stored parameters themselves (:func:`scan_layout_for`).
    ``wide``: the copy for calls of two or more rows per forward (a target scoring a chain or a
    tree, a batch); one model used both ways holds both copies. Abstract parameters
    (``jax.ShapeDtypeStruct``, to lower a call without weights: ``benchmarks/bench_tpu.py``) give
    the run layout's shapes.
    """
    params = model.params if params is None else params
    per_model = _RUN_PARAMS.setdefault(model, {})
    # The layout is chosen from the parameters' placement (before ``eval_shape`` traces them),
    # and a copy is remembered per layout: a forced layout (tests) does not reuse the other's.
    scan = scan_layout_for(params)
    cached = per_model.get((wide, scan))
    if cached is None or cached[0] is not params:
        prepare = functools.partial(prepare_params, model.config, wide=wide, scan=scan)
        abstract = any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(params))
        cached = (params, jax.eval_shape(prepare, params) if abstract else prepare(params))
        per_model[(wide, scan)] = cached
    return cached[1]


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    name: str  # the alias, repo id or path it was loaded as
    path: str  # the checkpoint folder
    config: Any  # a family config (ModelConfig), e.g. LlamaConfig
    params: Any  # pytree of arrays
    tokenizer: Any = None  # a transformers tokenizer, or None

    @property
    def family(self):
        return family_for_config(self.config)

    @property
    def forward(self):
        """Pure ``forward(params, tokens, positions, mask, cache) -> (logits, new_kv)``."""
        return forward_for(self.config)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size
