"""One tokenizer, two embedding sizes: the target and the draft as views on a shared vocabulary.

Checkpoints pad their embedding to a round row count, and two sizes of one family may pad it
differently: Qwen2.5-7B has V = 152064 rows, Qwen2.5-0.5B 151936, for one tokenizer of 151665 ids
(Gemma 3: 12B 262208 rows, 1B 262144, for 262144 ids). Rows past the tokenizer are never a token.

Rule (``check_compatible`` and :func:`align_vocabularies`): when the vocabulary sizes differ, the
pair is accepted only if both models carry the *same* tokenizer (equal ``get_vocab()``) with
``n`` ids (its largest id + 1) and ``n <= min(V_target, V_draft)``. Both models are then viewed
with ``V' = min(V_target, V_draft)`` logits whose rows ``n .. V'-1`` are ``-inf``: the padding rows
are masked out of *both* laws, and the output law is exactly the target's law over the
tokenizer's ``n`` ids, renormalised (what transformers samples with those ids suppressed; a trained
model gives them almost no mass). Equal sizes are left as they are (no masking: both laws already
share their support). Without tokenizers, differing sizes are refused: nothing says the ids mean
the same.
"""

from __future__ import annotations

import dataclasses
import types
import weakref
from typing import Any

import jax.numpy as jnp

from asps_jax.models.base import family_for_config


@dataclasses.dataclass(frozen=True)
class SharedVocab:
    """A family config seen with ``vocab_size`` logits of which ids ``>= num_tokens`` are -inf.

    Its params are the inner config's (same shapes, same sharding); only the logits change.
    """

    inner: Any  # the model's own family config
    vocab_size: int  # V': logits per position
    num_tokens: int  # n: ids n .. V'-1 are masked

    def __getattr__(self, name):  # the ModelConfig fields: layers, heads, context, EOS, ...
        if name.startswith("__") or name in ("inner", "vocab_size", "num_tokens"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def to_hf(self) -> dict:
        return self.inner.to_hf()


def _inner_family(config: SharedVocab):
    return family_for_config(config.inner)


def _forward(config: SharedVocab, params, tokens, positions, mask, cache):
    out = _inner_family(config).forward(config.inner, params, tokens, positions, mask, cache)
    logits = out.logits[..., : config.vocab_size]
    real = jnp.arange(config.vocab_size) < config.num_tokens
    return dataclasses.replace(out, logits=jnp.where(real, logits, -jnp.inf))


def _prepare_params(config: SharedVocab, params, wide: bool = False):
    prepare = getattr(_inner_family(config), "prepare_params", None)
    return params if prepare is None else prepare(config.inner, params, wide)


FAMILY = types.SimpleNamespace(
    MODEL_TYPE=None,  # a view, never read from a config.json
    forward=_forward,
    param_shapes=lambda config: _inner_family(config).param_shapes(config.inner),
    prepare_params=_prepare_params,
)
SharedVocab.FAMILY = FAMILY


class IncompatibleModelsError(ValueError):
    """Target and draft cannot be paired (different vocabularies)."""


def check_compatible(target, draft) -> None:
    """Raise unless the draft proposes tokens in the target's vocabulary with the same meaning.

    Equal tokenizers with different embedding row counts (Qwen2.5-7B's 152064 against
    Qwen2.5-0.5B's 151936) pair: ``sample`` masks the padding rows out of both laws
    (``vocab.py``, where the rule is stated).
    """
    shared_size(target, draft)  # raises unless the sizes agree or differ only by padding
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


def num_tokens(tokenizer) -> int:
    """Ids a tokenizer can produce: its largest id + 1 (added special tokens included)."""
    return max(tokenizer.get_vocab().values()) + 1


def shared_size(target, draft) -> tuple[int, int] | None:
    """``(V', n)`` when the two models' sizes differ and they may still pair (the rule above);
    None when the sizes are equal. Raises ``IncompatibleModelsError`` otherwise."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv == dv:
        return None
    why = (
        f"target {target.name!r} has vocab_size {tv} but draft {draft.name!r} has {dv}; "
        "speculative sampling needs one shared vocabulary"
    )
    tt, dt = target.tokenizer, draft.tokenizer
    if tt is None or dt is None:
        raise IncompatibleModelsError(
            f"{why}, and without both tokenizers nothing shows that the extra rows are padding"
        )
    n = num_tokens(tt)
    if n > min(tv, dv):
        raise IncompatibleModelsError(
            f"{why}: the tokenizer has {n} ids, more than the smaller embedding's "
            f"{min(tv, dv)} rows"
        )
    return min(tv, dv), n


# The views of a model, per (V', n), so that repeated calls reuse one Model (its run layout and
# placed parameters are cached per Model object).
_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def view(model, vocab_size: int, n: int):
    """``model`` with :class:`SharedVocab` logits (one object per model and size)."""
    per_model = _VIEWS.setdefault(model, {})
    if (vocab_size, n) not in per_model:
        config = SharedVocab(model.config, vocab_size, n)
        per_model[vocab_size, n] = dataclasses.replace(model, config=config)
    return per_model[vocab_size, n]


def align_vocabularies(target, draft):
    """``(target, draft)`` as :func:`sample` runs them: unchanged when their vocabulary sizes
    agree (or there is no draft), else both viewed on the shared vocabulary (module docstring)."""
    if draft is None:
        return target, draft
    sizes = shared_size(target, draft)
    if sizes is None:
        return target, draft
    return view(target, *sizes), view(draft, *sizes)
