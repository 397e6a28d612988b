"""The decode step's one door to verification: a method's verifier on the step's node-indexed
draft tree (:class:`~asps_jax.trees.DraftTree`).

The step hands every method the same thing, the tree's nodes: their tokens, the draft law each was
drawn from, the target law after each, and which nodes hold a usable draft token. Chain and
multi-draft verifiers (``verify_chain``, ``verify_drafts``) read the tree's root paths, one chain
per draft replica; tree verifiers (``verify_tree``) the node table itself. Either way the answer is
a :class:`~asps_jax.verify.api.Verdict` whose ``draft_index`` is the draft replica that drew the
accepted path (the one the others sync to), and the accepted path as nodes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from asps_jax import trees
from asps_jax.verify.verdict import Verdict


def scored_slots(method, tree: trees.DraftTree, node_tokens_BN, valid_BN, merge: bool):
    """int32[B, N]: the slot whose target law stands for each slot (-1: none, the slot holds no
    usable draft token). A method whose verifier merges siblings that drew the same token
    (``method.merges_siblings``) reads one law per merged node, so with ``merge`` only those are
    scored; every other method reads each slot's own law."""
    if merge and method.merges_siblings:
        canonical_BN, _, _ = jax.vmap(lambda x, v: trees.merge_duplicates(tree.nodes, x, v))(
            node_tokens_BN, valid_BN
        )
        return canonical_BN
    return jnp.where(valid_BN, jnp.arange(tree.nodes.num_nodes, dtype=jnp.int32)[None, :], -1)


def verify_step(
    method,
    tree: trees.DraftTree,
    key,
    node_tokens_N,
    draft_lp_NV,
    target_lp_NV,
    valid_N,
    options: dict,
    axis_name: str | None = None,
) -> tuple[Verdict, jax.Array]:
    """One row's verification. Returns the :class:`Verdict` (``draft_index``: the replica that
    drew the accepted path) and the accepted path's nodes, int32[D + 1] (the root, then one node
    per accepted draft token; entries from ``num_tokens`` on are never read).

    Args:
      method: the :class:`~asps_jax.verify.registry.Method`; its verifier is called directly
        (the step's inputs are well-formed by construction, and the options were validated once
        by the caller: nothing here goes back through the public, validating entry points).
      node_tokens_N: int32[N] (entry 0 the root); draft_lp_NV: float32[N, V], node i's draft law;
      target_lp_NV: float32[N, V], the target law after node i; valid_N: bool[N].
      options: the method's options (plain values).
      axis_name: the ``vmap`` axis over the batch's rows, for verifiers that fit a level race
        only where some row needs it (``method.rows_option``).
    """
    if axis_name is not None and method.rows_option is not None:
        options = method.rows_option(options, axis_name)
    layout = tree.layout
    if method.kind == "tree":
        found = method.verifier(
            key, tree.nodes, node_tokens_N, draft_lp_NV, target_lp_NV, valid_N, **options
        )
        deepest = found.path[found.num_tokens - 1]
        verdict = Verdict(
            tokens=found.tokens,
            num_tokens=found.num_tokens,
            draft_index=jnp.asarray(layout.first_chain)[deepest],
            num_fallbacks=jnp.zeros_like(found.num_tokens),
        )
        return verdict, jnp.maximum(found.path, 0)
    # Chains: replica l's root path, its draft tokens and laws, and the target along it.
    tokens_LD = node_tokens_N[layout.chain_nodes]
    draft_lp_LDV = draft_lp_NV[layout.chain_nodes]
    target_lp_LTV = target_lp_NV[layout.chain_paths]
    lengths_L = jnp.sum(valid_N[layout.chain_nodes], axis=-1, dtype=jnp.int32)
    if method.kind == "chain":
        verdict = method.verifier(
            key, tokens_LD[0], draft_lp_LDV[0], target_lp_LTV[0], lengths_L[0]
        )
    else:
        verdict = method.verifier(key, tokens_LD, draft_lp_LDV, target_lp_LTV, lengths_L, **options)
    return verdict, jnp.asarray(layout.chain_paths)[verdict.draft_index]


__all__ = ["scored_slots", "verify_step"]
