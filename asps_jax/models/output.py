"""What every model forward returns: :class:`ForwardOut`, the logits, the new keys / values and,
when asked for, the target's features (the residual streams a learned head reads).

One type for every family (``llama``, ``opt``, ``gpt2``, ``gpt_neo``, the decoder families, a
user's own forward through ``own.py``, the shared-vocabulary view) and for the scoring, prefill
and refill helpers built on them (:mod:`asps_jax.scoring`), so that callers read fields, never
count a tuple's entries.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardOut:
    """A forward's result (a pytree).

    Attributes:
      logits: float32[B, T, V], each query token's next-token logits.
      kv: the new tokens' keys and values, ``KVBlock`` [L, B, T, KVH, H] (the caller commits the
        accepted ones with ``kv_cache.commit``).
      features: float[B, T, F] or None: the residual streams entering the layers the forward was
        asked for (``forward_for(config, features)``), concatenated; None when none were.

    It unpacks as the tuple the forward contract names, ``logits, kv = forward(...)`` (and
    ``logits, kv, features`` when features were asked for).
    """

    logits: jax.Array
    kv: Any
    features: jax.Array | None = None

    def __iter__(self):
        fields = (self.logits, self.kv) if self.features is None else self.astuple()
        return iter(fields)

    def __getitem__(self, index):
        return tuple(self)[index]

    def astuple(self) -> tuple:
        """``(logits, kv, features)``."""
        return self.logits, self.kv, self.features
