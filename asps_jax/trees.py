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

General trees (:class:`TokenTree`) are described by their parents alone, a static tuple: one chain,
K chains (the layout above) or a fixed branching shape such as widths ``(4, 2, 1, 1)`` per depth.
The tokens drawn into such a tree may repeat among siblings (drafts drawn with replacement);
:func:`merge_duplicates` maps it, on device and with the same fixed node table, to the tree in which
siblings with equal tokens are one node (its canonical *slot* is the first of them), and
:func:`merge_chains` does so for K drawn chains ``int32[K, n]``. Sibling order is the order of first
appearance, i.e. slot order (docs/algorithms.md §7).
"""

from __future__ import annotations

import dataclasses
import functools
import math

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


def merged_attention_mask(tree, canonical_BN: jax.Array) -> jax.Array:
    """``bool[B, N, N]`` tree part of the attention mask of the *merged* tree: a node of the merged
    tree (a slot that is its own canonical node) attends to the canonical nodes of its root path
    (itself included); any other slot attends only to itself.

    ``canonical_BN`` is :func:`merge_duplicates`' ``node`` per row (-1 for an invalid slot).
    """
    n_nodes = tree.num_nodes
    anc = jnp.asarray(tree.ancestors, jnp.float32)  # [i, j]
    onehot_BNN = jax.nn.one_hot(canonical_BN, n_nodes, dtype=jnp.float32)  # [b, j, c]; -1: none
    reach_BNN = jnp.einsum("ij,bjc->bic", anc, onehot_BNN) > 0
    is_node_BN = canonical_BN == jnp.arange(n_nodes)[None, :]
    eye = jnp.eye(n_nodes, dtype=bool)[None]
    return jnp.where(is_node_BN[:, :, None], reach_BNN, eye)


# --------------------------------------------------------------------------------------------
# General static trees
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TokenTree:
    """A static token tree, hashable by its parents (usable as a static ``jit`` argument).

    ``parents[0] == -1`` is the root; every other node's parent has a smaller index, so index
    order is a topological order and siblings are ordered by index (first appearance).
    """

    parents: tuple[int, ...]

    def __post_init__(self):
        parents = tuple(int(p) for p in self.parents)
        object.__setattr__(self, "parents", parents)
        if not parents or parents[0] != -1:
            raise ValueError(f"TokenTree: node 0 must be the root (parent -1), got {parents[:1]}")
        bad = [i for i, p in enumerate(parents[1:], 1) if not 0 <= p < i]
        if bad:
            raise ValueError(
                f"TokenTree: node {bad[0]} has parent {parents[bad[0]]}; every non-root node "
                "needs a parent with a smaller index"
            )

    @property
    def num_nodes(self) -> int:  # N
        return len(self.parents)

    @functools.cached_property
    def depth(self) -> np.ndarray:
        """int32[N], root at depth 0."""
        depth = np.zeros(self.num_nodes, np.int32)
        for i in range(1, self.num_nodes):
            depth[i] = depth[self.parents[i]] + 1
        return depth

    @property
    def max_depth(self) -> int:  # D
        return int(self.depth.max())

    @functools.cached_property
    def paths(self) -> np.ndarray:
        """int32[N, D+1]: ``paths[i, t]`` is the ancestor of node i at depth t (i itself at its
        depth), -1 beyond its depth."""
        out = np.full((self.num_nodes, self.max_depth + 1), -1, np.int32)
        for i in range(self.num_nodes):
            node = i
            while node >= 0:
                out[i, self.depth[node]] = node
                node = self.parents[node]
        return out

    @functools.cached_property
    def ancestors(self) -> np.ndarray:
        """bool[N, N]; ``[i, j]`` true iff j == i or j is an ancestor of i."""
        out = np.zeros((self.num_nodes, self.num_nodes), bool)
        rows, cols = np.nonzero(self.paths >= 0)
        out[rows, self.paths[rows, cols]] = True
        return out

    @functools.cached_property
    def sibling_rank(self) -> np.ndarray:
        """int32[N]: position of each node among its parent's children (first appearance)."""
        rank = np.zeros(self.num_nodes, np.int32)
        count: dict[int, int] = {}
        for i, p in enumerate(self.parents[1:], 1):
            rank[i] = count.get(p, 0)
            count[p] = rank[i] + 1
        return rank

    @functools.cached_property
    def num_children(self) -> np.ndarray:
        """int32[N]."""
        return np.bincount(np.asarray(self.parents[1:], np.int64), minlength=self.num_nodes).astype(
            np.int32
        )

    @functools.cached_property
    def postorder(self) -> tuple[int, ...]:
        """Depth-first post-order, children in sibling order; the root comes last."""
        children: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i, p in enumerate(self.parents[1:], 1):
            children[p].append(i)
        order: list[int] = []
        stack = [(0, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            stack.append((node, True))
            stack.extend((c, False) for c in reversed(children[node]))
        return tuple(order)


def chain_token_tree(draft_len: int) -> TokenTree:
    """The root and one chain of ``draft_len`` tokens."""
    return chains_token_tree(1, draft_len)


def chains_token_tree(num_drafts: int, draft_len: int) -> TokenTree:
    """The root and ``num_drafts`` chains, node ``1 + k*n + i`` = token i of chain k (the layout
    of :func:`build_chain_tree`)."""
    return TokenTree(tuple(int(p) for p in build_chain_tree(num_drafts, draft_len).parents))


def branching_token_tree(widths) -> TokenTree:
    """Every node at depth d has ``widths[d]`` children, e.g. ``(4, 2, 1, 1)``; nodes are numbered
    depth by depth, the children of a node consecutively."""
    widths = tuple(int(w) for w in widths)
    if any(w < 1 for w in widths):
        raise ValueError(f"branching_token_tree: widths must be >= 1, got {widths}")
    parents, level = [-1], [0]
    for w in widths:
        nxt = []
        for node in level:
            for _ in range(w):
                nxt.append(len(parents))
                parents.append(node)
        level = nxt
    return TokenTree(tuple(parents))


def token_tree_of(tree: Tree) -> TokenTree:
    """The :class:`TokenTree` with the same parents as a chain :class:`Tree`."""
    return TokenTree(tuple(int(p) for p in tree.parents))


# --------------------------------------------------------------------------------------------
# Merging siblings that carry equal tokens (on device, fixed node table)
# --------------------------------------------------------------------------------------------


def merge_duplicates(tree: TokenTree, node_tokens: jax.Array, valid: jax.Array):
    """Merge siblings with equal tokens: ``(node int32[N], parent int32[N], valid bool[N])``.

    Args:
      tree: the static tree the tokens were drawn into.
      node_tokens: int32[N] (entry 0, the root, is not compared); valid: bool[N] per slot.

    Returns:
      ``node[i]``, the canonical slot of slot i: the smallest valid slot whose root path carries the
      same tokens (-1 for an invalid slot); ``parent[i] = node[tree.parents[i]]``, its parent in
      the merged tree (-1 for the root and invalid slots); ``valid[i]``, slot i is a node of the
      merged tree (valid and canonical). A slot is valid only if its ancestors are.
    """
    n_nodes = tree.num_nodes
    paths = jnp.asarray(tree.paths)  # [N, D+1]
    depth = jnp.asarray(tree.depth)
    valid = jnp.asarray(valid, bool)
    anc = jnp.asarray(tree.ancestors)
    valid = jnp.all(valid[None, :] | ~anc, axis=1)  # ancestor-closed
    # Tokens along each root path (depth >= 1), -1 beyond the node's depth.
    path_tok = jnp.where(paths[:, 1:] >= 0, node_tokens[jnp.maximum(paths[:, 1:], 0)], -1)
    same = jnp.all(path_tok[:, None, :] == path_tok[None, :, :], axis=-1)
    same = same & (depth[:, None] == depth[None, :]) & valid[:, None] & valid[None, :]
    node = jnp.where(valid, jnp.argmax(same, axis=1), -1).astype(jnp.int32)
    par = jnp.asarray(np.maximum(np.asarray(tree.parents), 0))
    parent = jnp.where(valid & (jnp.arange(n_nodes) > 0), node[par], -1).astype(jnp.int32)
    return node, parent, valid & (node == jnp.arange(n_nodes))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MergedChains:
    """K drawn chains as one tree on the fixed node table of :func:`chains_token_tree`.

    Slot ``1 + k*n + i`` holds token i of chain k; it is a node of the merged tree iff chain k is
    the first chain with that prefix (``valid``), and ``chain_nodes[k, i]`` names the node that
    carries chain k's position i.
    """

    node_tokens: jax.Array  # int32[N], N = K*n + 1; entry 0 is the root token
    parent: jax.Array  # int32[N], merged parent of each valid slot, -1 for the root / invalid
    valid: jax.Array  # bool[N], the slot is a node of the merged tree
    node_chain: jax.Array  # int32[N], the chain that first produced the node (0 for the root)
    chain_nodes: jax.Array  # int32[K, n], node of chain k's position i (-1 past its length)

    @property
    def num_nodes(self) -> jax.Array:
        """int32[]: valid nodes, the root included."""
        return jnp.sum(self.valid).astype(jnp.int32)


def merge_chains(root_token, tokens_KN: jax.Array, lengths_K: jax.Array | None = None):
    """Merge K drawn chains ``int32[K, n]`` that share prefixes into one tree.

    ``lengths_K`` (default n) counts the valid tokens of each chain (EOS, ``max_new_tokens``).
    """
    num_drafts, n = tokens_KN.shape
    tree = chains_token_tree(num_drafts, n)
    lengths_K = jnp.full((num_drafts,), n, jnp.int32) if lengths_K is None else lengths_K
    node_tokens = jnp.concatenate(
        [jnp.asarray(root_token, jnp.int32).reshape(1), tokens_KN.reshape(-1).astype(jnp.int32)]
    )
    valid_in = jnp.concatenate(
        [jnp.ones((1,), bool), (jnp.arange(n)[None, :] < lengths_K[:, None]).reshape(-1)]
    )
    node, parent, valid = merge_duplicates(tree, node_tokens, valid_in)
    chain_of_slot = jnp.asarray(np.maximum((np.arange(tree.num_nodes) - 1) // max(n, 1), 0))
    return MergedChains(
        node_tokens=node_tokens,
        parent=parent,
        valid=valid,
        node_chain=jnp.where(valid, chain_of_slot, 0).astype(jnp.int32),
        chain_nodes=node[1:].reshape(num_drafts, n),
    )


# --------------------------------------------------------------------------------------------
# Draft trees of the decode loop: chains of a full-depth tree, and branching draw plans
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChainLayout:
    """A tree whose leaves all sit at depth D, seen as one *chain* per leaf (its root path).

    The decode loop drafts such a tree with one draft cache replica per chain: replica l feeds the
    tokens of leaf l's root path. NumPy arrays (static).

    Attributes:
      chain_nodes: int32[L, D], the node of chain l at depth d + 1.
      first_chain: int32[N], the first chain through each node (0 for the root): the replica whose
        draws and draft laws stand for the node.
    """

    chain_nodes: np.ndarray
    first_chain: np.ndarray

    @property
    def num_chains(self) -> int:  # L
        return int(self.chain_nodes.shape[0])

    @property
    def chain_paths(self) -> np.ndarray:
        """int32[L, D + 1]: the root, then chain l's nodes."""
        return np.concatenate([np.zeros((self.num_chains, 1), np.int32), self.chain_nodes], axis=1)


def chain_layout(tree: TokenTree) -> ChainLayout:
    """The :class:`ChainLayout` of a tree whose leaves are all at its maximal depth."""
    leaves = [i for i in range(tree.num_nodes) if tree.num_children[i] == 0]
    shallow = [i for i in leaves if tree.depth[i] != tree.max_depth]
    if tree.max_depth == 0 or shallow:
        raise ValueError(
            "a draft tree needs every leaf at its full depth (one draft replica per root path); "
            f"got a tree of depth {tree.max_depth} with leaves at depths "
            f"{sorted(set(tree.depth[leaves].tolist()))}"
        )
    chain_nodes = tree.paths[leaves, 1:].astype(np.int32)
    first_chain = np.zeros(tree.num_nodes, np.int32)
    for chain in reversed(range(len(leaves))):
        first_chain[chain_nodes[chain]] = chain
    return ChainLayout(chain_nodes=chain_nodes, first_chain=first_chain)


def parse_widths(text: str) -> tuple[int, ...]:
    """``"4,2,1,1"`` -> ``(4, 2, 1, 1)``: a branching tree's children per node at each depth, as
    the command lines write it (a one-line ``ValueError`` otherwise)."""
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        widths = ()
    if not widths or min(widths) < 1:
        raise ValueError(
            f"expected children per node at each depth, e.g. 4,2,1,1 (every width >= 1), got "
            f"{text!r}"
        )
    return widths


@dataclasses.dataclass(frozen=True)
class BranchingPlan:
    """How the draft replicas of a :func:`branching_token_tree` draw its tokens (static).

    At depth d every node draws its ``widths[d]`` children from its own law, with or without
    replacement; replica l stands for the node of its root path, and it takes child
    ``sibling[d, l]`` of the draws made with the key and law of replica ``group_first[d, l]`` (the
    first replica through its depth-d node), so every replica through a node sees the same
    children.
    """

    widths: tuple[int, ...]
    replace: bool

    @property
    def num_chains(self) -> int:  # L, the leaves
        return math.prod(self.widths)

    @property
    def max_width(self) -> int:
        return max(self.widths)

    @property
    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        """``(group_first int32[D, L], sibling int32[D, L])``."""
        chains = np.arange(self.num_chains)
        group_first, sibling = [], []
        for d in range(len(self.widths)):
            per_node = math.prod(self.widths[d:])  # replicas through one depth-d node
            per_child = math.prod(self.widths[d + 1 :])
            group_first.append(chains - chains % per_node)
            sibling.append((chains % per_node) // per_child)
        return np.asarray(group_first, np.int32), np.asarray(sibling, np.int32)

    @property
    def tree(self) -> TokenTree:
        return branching_token_tree(self.widths)


DRAWS = ("chains", "iid", "without_replacement")
"""How a :class:`DraftTree` is drawn: ``"chains"``, K independent chains (widths ``(K, 1, ...,
1)``; replica k draws its whole root path with its own key); ``"iid"``, every node its children
independently from its one law with one key; ``"without_replacement"``, every node its children
without replacement (:class:`BranchingPlan`)."""


@dataclasses.dataclass(frozen=True)
class DraftTree:
    """The one static tree of a decoding step: its shape, how it is drawn, its node table and its
    root paths (one draft cache replica per leaf). Hashable; a static part of ``SpecConfig``.

    K chains of n tokens are the tree of widths ``(K, 1, ..., 1)`` drawn as ``"chains"``; their
    nodes are numbered chain by chain (node ``1 + k*n + i`` is token i of chain k), a branching
    tree's depth by depth (:func:`branching_token_tree`).

    Attributes:
      widths: children per node at each depth (D = ``len(widths)``, the draft length).
      draws: one of :data:`DRAWS`.
    """

    widths: tuple[int, ...]
    draws: str

    def __post_init__(self):
        widths = tuple(int(w) for w in self.widths)
        object.__setattr__(self, "widths", widths)
        if not widths or min(widths) < 1:
            raise ValueError(f"DraftTree: widths must be >= 1 at every depth, got {widths}")
        if self.draws not in DRAWS:
            raise ValueError(f"DraftTree: draws must be one of {DRAWS}, got {self.draws!r}")
        if self.draws == "chains" and any(w != 1 for w in widths[1:]):
            raise ValueError(f"DraftTree: chains have widths (K, 1, ..., 1), got {widths}")

    @classmethod
    def chains(cls, num_drafts: int, draft_len: int) -> DraftTree:
        """K independent chains of ``draft_len`` tokens."""
        return cls((num_drafts,) + (1,) * (draft_len - 1), "chains")

    @property
    def depth(self) -> int:  # D
        return len(self.widths)

    @property
    def num_chains(self) -> int:  # L = K, the leaves, one draft replica each
        return math.prod(self.widths)

    @functools.cached_property
    def nodes(self) -> TokenTree:
        """The node table (N = ``nodes.num_nodes``)."""
        if self.draws == "chains":
            return chains_token_tree(self.num_chains, self.depth)
        return branching_token_tree(self.widths)

    @functools.cached_property
    def layout(self) -> ChainLayout:
        """The root path of each leaf, the chain its draft replica feeds."""
        return chain_layout(self.nodes)

    @property
    def plan(self) -> BranchingPlan | None:
        """How the replicas draw a branching tree; None for chains (each replica its own)."""
        if self.draws == "chains":
            return None
        return BranchingPlan(self.widths, self.draws == "iid")

    def node_validity(self, lengths_BL: jax.Array) -> jax.Array:
        """``bool[B, N]``: the root, and each node within the usable length of the first chain
        through it (every chain through a node drew the same tokens up to it)."""
        depth_N = self.nodes.depth
        lengths_BN = lengths_BL[:, self.layout.first_chain]
        return (depth_N == 0)[None, :] | (depth_N[None, :] <= lengths_BN)

    def to_nodes(self, root_B: jax.Array, per_chain_BLD: jax.Array) -> jax.Array:
        """``[B, N, ...]``: each node's entry from the first chain through it, at its depth (the
        root's row is chain 0's first entry; ``root_B``, when given, replaces it)."""
        at_N = np.maximum(self.nodes.depth - 1, 0)
        out = per_chain_BLD[:, self.layout.first_chain, at_N]
        return out if root_B is None else out.at[:, 0].set(root_B)
