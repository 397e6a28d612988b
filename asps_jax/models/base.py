"""The model-family registry, the ``Model`` record, and the target/draft compatibility check.

A family is a module exposing ``MODEL_TYPE``, ``CONFIG_CLASS``, ``config_from_hf(dict)``,
``init_params``, ``param_shapes``, ``param_axes``, ``forward(config, params, tokens, positions,
mask, cache)``, ``HF_TENSORS`` (and optionally ``HF_IGNORED`` and ``prepare_params``, a faster
layout of the stored parameters for its forward). Adding OPT or GPT-2 means one more
module and one more entry in ``FAMILIES``.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

from asps_jax.models import llama

FAMILIES = {llama.MODEL_TYPE: llama}


def family_for_type(model_type: str | None, where: str = "config"):
    if model_type not in FAMILIES:
        raise ValueError(
            f"{where}: model_type {model_type!r} is not supported; supported: {sorted(FAMILIES)}"
        )
    return FAMILIES[model_type]


def family_for_config(config):
    for family in FAMILIES.values():
        if isinstance(config, family.CONFIG_CLASS):
            return family
    raise ValueError(f"config: no model family for {type(config).__name__}")


@functools.lru_cache(maxsize=64)
def forward_for(config):
    """``forward(params, tokens, positions, mask, cache)`` with the static config bound.

    Cached, so equal configs give the *same* function object: passing it as a static argument of
    ``jax.jit`` then hits the compilation cache instead of recompiling per call.
    """
    return functools.partial(family_for_config(config).forward, config)


def prepare_params(config, params):
    """``params`` in the family's run layout (its ``prepare_params``; unchanged if it has none)."""
    prepare = getattr(family_for_config(config), "prepare_params", None)
    return params if prepare is None else prepare(config, params)


# Run-layout copies, one per model (weak keys: dropping the Model frees its copy).
_RUN_PARAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def run_params(model, params=None):
    """:func:`prepare_params` of ``params`` (default ``model.params``; or e.g. its copy placed
    on a mesh), made once and remembered per model for the last ``params`` seen.

    The stored layout stays what checkpoints, sharding rules and ``param_shapes`` describe; this
    is the copy the decoding loop runs on (e.g. Llama's per-layer weights, ``llama.py``).
    """
    params = model.params if params is None else params
    cached = _RUN_PARAMS.get(model)
    if cached is None or cached[0] is not params:
        cached = (params, prepare_params(model.config, params))
        _RUN_PARAMS[model] = cached
    return cached[1]


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    name: str  # the alias, repo id or path it was loaded as
    path: str  # the checkpoint folder
    config: Any  # a family config, e.g. LlamaConfig
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


class IncompatibleModelsError(ValueError):
    """Target and draft cannot be paired (different vocabularies)."""


def check_compatible(target: Model, draft: Model) -> None:
    """Raise unless the draft proposes tokens in the target's vocabulary with the same meaning."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise IncompatibleModelsError(
            f"target {target.name!r} has vocab_size {tv} but draft {draft.name!r} has {dv}; "
            "speculative sampling needs one shared vocabulary"
        )
    tt, dt = target.tokenizer, draft.tokenizer
    if tt is None or dt is None:
        return  # nothing more to compare; equal sizes is all we can check
    t_vocab, d_vocab = tt.get_vocab(), dt.get_vocab()
    if t_vocab != d_vocab:
        differ = sorted(set(t_vocab.items()) ^ set(d_vocab.items()), key=lambda kv: kv[1])[:5]
        raise IncompatibleModelsError(
            f"target {target.name!r} and draft {draft.name!r} have different tokenizers "
            f"({len(t_vocab)} vs {len(d_vocab)} entries; first differences: {differ})"
        )
