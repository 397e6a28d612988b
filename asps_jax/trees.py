"""Fixed-shape padded token trees.

The decode loop scores one tree per row in a single target forward. Its layout is static (it depends
only on the number of drafts K and the draft length n), so it is built with NumPy at trace time:

* node 0 is the *root*: the last emitted token, not yet in the KV cache;
* node ``1 + k*n + i`` is token ``i`` (0-based) of draft chain ``k``; its parent is the previous
  token of the same chain, or the root for ``i == 0``.

Chains are never merged, even when they share a prefix: rows of chains with equal prefixes then get
equal target laws, which is what ``verify_drafts`` expects, and the shape stays fixed. Per-row
validity (drafts shortened by EOS or ``max_new_tokens``) is a ``bool[B, N]`` mask next to the tree;
padded nodes are masked, never dropped, and only ever attend to themselves.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Tree:
    """Static tree structure (NumPy arrays; hashable by its shape parameters)."""

    num_drafts: int  # K
    draft_len: int  # n
    parents: np.ndarray  # int32[N], -1 for the root
    depth: np.ndarray  # int32[N], root at depth 0
    ancestors: np.ndarray  # bool[N, N]; [i, j] true iff j == i or j is an ancestor of i

    @property
    def num_nodes(self) -> int:
        return int(self.parents.shape[0])

    def __hash__(self) -> int:
        return hash((self.num_drafts, self.draft_len))

    def __eq__(self, other) -> bool:
        return isinstance(other, Tree) and (self.num_drafts, self.draft_len) == (
            other.num_drafts,
            other.draft_len,
        )


def chain_node(k, i, draft_len: int):
    """Index of token ``i`` of chain ``k`` (works on ints and arrays)."""
    return 1 + k * draft_len + i


def build_chain_tree(num_drafts: int, draft_len: int) -> Tree:
    """Root plus ``num_drafts`` independent chains of ``draft_len`` tokens each."""
    if num_drafts < 1:
        raise ValueError(f"num_drafts must be >= 1, got {num_drafts}")
    if draft_len < 0:
        raise ValueError(f"draft_len must be >= 0, got {draft_len}")
    n_nodes = 1 + num_drafts * draft_len
    parents = np.full(n_nodes, -1, np.int32)
    depth = np.zeros(n_nodes, np.int32)
    for k in range(num_drafts):
        for i in range(draft_len):
            node = chain_node(k, i, draft_len)
            parents[node] = 0 if i == 0 else node - 1
            depth[node] = i + 1
    ancestors = np.eye(n_nodes, dtype=bool)
    for node in range(n_nodes):
        p = parents[node]
        while p >= 0:
            ancestors[node, p] = True
            p = parents[p]
    return Tree(num_drafts, draft_len, parents, depth, ancestors)


def chain_tokens_to_nodes(root_B: jax.Array, drafts_BKD: jax.Array) -> jax.Array:
    """Lay out ``root[B]`` and ``drafts[B, K, n]`` as the node tokens ``[B, 1 + K*n]``."""
    b = drafts_BKD.shape[0]
    return jnp.concatenate([root_B[:, None], drafts_BKD.reshape(b, -1)], axis=1)


def node_validity(tree: Tree, draft_lengths_BK: jax.Array) -> jax.Array:
    """``bool[B, N]``: the root is always valid; chain ``k`` node ``i`` iff ``i < length[k]``."""
    depth = jnp.asarray(tree.depth)
    chain = jnp.asarray(np.maximum((np.arange(tree.num_nodes) - 1) // max(tree.draft_len, 1), 0))
    lengths_BN = jnp.take(draft_lengths_BK, chain, axis=1)
    return (depth == 0)[None, :] | (depth[None, :] <= lengths_BN)


def path_nodes(tree: Tree, draft_index: jax.Array) -> jax.Array:
    """``int32[..., n+1]``: the root then every node of chain ``draft_index`` (root path order)."""
    draft_index = jnp.asarray(draft_index, jnp.int32)
    i = jnp.arange(tree.draft_len, dtype=jnp.int32).reshape((1,) * draft_index.ndim + (-1,))
    chain = chain_node(draft_index[..., None], i, tree.draft_len)
    root = jnp.zeros(chain.shape[:-1] + (1,), jnp.int32)
    return jnp.concatenate([root, chain.astype(jnp.int32)], axis=-1)


def attention_mask(tree: Tree, valid_BN: jax.Array) -> jax.Array:
    """``bool[B, N, N]`` tree part of the attention mask: ancestors (incl. self) that are valid.

    A padded node attends to itself only, so no softmax row is ever empty.
    """
    anc = jnp.asarray(tree.ancestors)[None]
    eye = jnp.eye(tree.num_nodes, dtype=bool)[None]
    return jnp.where(valid_BN[:, :, None], anc & valid_BN[:, None, :], eye)
