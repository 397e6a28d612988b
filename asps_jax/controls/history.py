"""The row history: each row's committed text as the controls read it (a pytree of device
arrays carried by the decoding loop, ``DecodeState.history``).

The path-dependent controls (:mod:`~asps_jax.controls.penalties`) read the counts, the seen-mask
and the text; the constraints (:mod:`~asps_jax.controls.automaton`) the committed DFA state. A step
appends the tokens it emitted and advances the DFA state once, in
:func:`asps_jax.controls.commit`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class History:
    """The committed text of each row, as the controls read it (a pytree of device arrays).

    Attributes:
      counts: int32[B, V], how often each token was generated (the prompt not counted).
      seen: bool[B, V], the token occurs in the prompt or among the generated tokens.
      tokens: int32[B, H], the prompt then the generated tokens (the root last), -1 after.
      length: int32[B], the number of tokens in ``tokens``.
      dfa: int32[B], each row's constraint state after its generated tokens (-1: none generated
        yet, the row's start state; see :mod:`asps_jax.controls.automaton`).
    """

    counts: jax.Array
    seen: jax.Array
    tokens: jax.Array
    length: jax.Array
    dfa: jax.Array

    @classmethod
    def init(cls, prompts_BP, prompt_lengths_B, vocab: int, extra: int) -> History:
        """From right-padded prompts; ``extra`` columns hold the generated tokens."""
        batch, width = prompts_BP.shape
        valid_BP = jnp.arange(width)[None, :] < prompt_lengths_B[:, None]
        tokens_BP = jnp.where(valid_BP, prompts_BP, -1).astype(jnp.int32)
        rows = jnp.arange(batch)[:, None]
        seen = (
            jnp.zeros((batch, vocab), bool)
            .at[rows, jnp.where(valid_BP, tokens_BP, vocab)]
            .set(True, mode="drop")
        )
        return cls(
            counts=jnp.zeros((batch, vocab), jnp.int32),
            seen=seen,
            tokens=jnp.concatenate([tokens_BP, jnp.full((batch, extra), -1, jnp.int32)], 1),
            length=prompt_lengths_B.astype(jnp.int32),
            dfa=jnp.full((batch,), -1, jnp.int32),
        )

    def append(self, block_BT, num_B) -> History:
        """The first ``num_B`` tokens of each row's ``block_BT`` appended (they were emitted)."""
        batch, width = block_BT.shape
        vocab = self.counts.shape[1]
        keep_BT = jnp.arange(width)[None, :] < num_B[:, None]
        idx_BT = jnp.where(keep_BT, block_BT, vocab)
        rows = jnp.arange(batch)[:, None]

        def write(row, block, start, count):
            window = jax.lax.dynamic_slice(row, (start,), (width,))
            window = jnp.where(jnp.arange(width) < count, block, window)
            return jax.lax.dynamic_update_slice(row, window, (start,))

        return History(
            counts=self.counts.at[rows, idx_BT].add(1, mode="drop"),
            seen=self.seen.at[rows, idx_BT].set(True, mode="drop"),
            tokens=jax.vmap(write)(self.tokens, block_BT, self.length, num_B),
            length=self.length + num_B,
            dfa=self.dfa,
        )

    def repeat(self, k: int) -> History:
        """The history of rows ``b * k + j`` (K draft replicas per row)."""
        return jax.tree.map(lambda a: jnp.repeat(a, k, axis=0), self)
