"""Public verification entry points, the result type and the method lists (derived from
verify/registry.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from asps_jax import trees
from asps_jax.checks import known_keywords
from asps_jax.verify import registry
from asps_jax.verify.checks import (
    check_distinct_roots,
    check_draft_length,
    check_dtypes,
    check_token_range,
)
from asps_jax.verify.options import NAMES
from asps_jax.verify.tree import sample_tree
from asps_jax.verify.verdict import (  # noqa: F401  (re-exported: the public result types)
    ChainVerifier,
    DraftsVerifier,
    TreeVerdict,
    Verdict,
    make_verdict,
)

# The public lists, derived from the one registry (verify/registry.py). verify_drafts also takes
# the chain methods (on chain 0 alone), after the multi-draft ones.
CHAIN_METHODS: tuple[str, ...] = registry.names("chain")
DRAFTS_METHODS: tuple[str, ...] = registry.names("drafts") + CHAIN_METHODS
# Root drafts drawn without replacement (multi.sample_without_replacement): verify_drafts only.
WITHOUT_REPLACEMENT_METHODS: tuple[str, ...] = tuple(
    m.name for m in registry.REGISTRY.values() if "iid" not in m.laws
)
# Sequence-level verifiers of a whole token tree (verify.tree.verify_tree, docs/algorithms.md §7).
TREE_METHODS: tuple[str, ...] = registry.names("tree")


@known_keywords()
def verify_chain(
    key: jax.Array,
    draft_tokens: jax.Array,
    draft_logprobs: jax.Array,
    target_logprobs: jax.Array,
    *,
    method: str = "asps",
    draft_length: jax.Array | int | None = None,
) -> Verdict:
    """Verify one draft chain against the target (docs/api.md §1).

    Args:
      key: a PRNG key.
      draft_tokens: int32[n], tokens drawn from the draft.
      draft_logprobs: float32[n, V], the laws the draft tokens were actually drawn from.
      target_logprobs: float32[n+1, V], the target laws; row n is the bonus law.
      method: ``"sps"`` (standard speculative sampling) or ``"asps"`` (accelerated).
      draft_length: int32[] in [0, n]: only the first ``draft_length`` draft tokens are real (the
        rest is padding, e.g. after an EOS); the bonus law is then
        ``target_logprobs[draft_length]``.

    Returns:
      A :class:`Verdict` with ``tokens`` int32[n+1] and ``1 <= num_tokens <= draft_length + 1``.
    """
    entry = registry.resolve(method, CHAIN_METHODS, "verify_chain")
    draft_tokens = jnp.asarray(draft_tokens)
    draft_logprobs = jnp.asarray(draft_logprobs)
    target_logprobs = jnp.asarray(target_logprobs)
    if draft_tokens.ndim != 1:
        raise ValueError(
            f"verify_chain: draft_tokens must be int32[n], got shape {draft_tokens.shape}"
        )
    n = draft_tokens.shape[0]
    if draft_logprobs.ndim != 2 or draft_logprobs.shape[0] != n:
        raise ValueError(
            f"verify_chain: draft_logprobs must be [n={n}, V], got shape {draft_logprobs.shape}"
        )
    vocab = draft_logprobs.shape[1]
    if target_logprobs.shape != (n + 1, vocab):
        raise ValueError(
            f"verify_chain: target_logprobs must be [n+1={n + 1}, V={vocab}] "
            f"(draft vocabulary), got shape {target_logprobs.shape}"
        )
    check_dtypes(draft_tokens, draft_logprobs, target_logprobs, "verify_chain")
    check_token_range(draft_tokens, vocab, "verify_chain")
    length = check_draft_length(draft_length, n, (), "verify_chain")
    return entry.verifier(
        key,
        draft_tokens.astype(jnp.int32),
        draft_logprobs.astype(jnp.float32),
        target_logprobs.astype(jnp.float32),
        length,
    )


@known_keywords(*NAMES)
def verify_drafts(
    key: jax.Array,
    draft_tokens: jax.Array,
    draft_logprobs: jax.Array,
    target_logprobs: jax.Array,
    *,
    method: str = "is",
    draft_length: jax.Array | None = None,
    **options,
) -> Verdict:
    """Verify K independent draft chains against the target (docs/api.md §1, docs/algorithms.md §3).

    Args:
      draft_tokens: int32[K, n]; draft_logprobs: float32[K, n, V]; target_logprobs:
        float32[K, n+1, V] (the target along each chain).
      method: ``"specinfer"``, ``"spectr"``, ``"is"``, ``"optimal"``, ``"specinfer_wor"``, or
        ``"sps"`` / ``"asps"`` on chain 0 alone.
      draft_length: int32[K], valid tokens per chain (default n).
      options: method options (e.g. ``rule=`` for ``"is"``); every multi-draft method takes
        ``tail="asps"`` (default: ASpS verifies the rest of the last alive chain) or ``"sps"``.

    Concrete inputs are validated (shapes, dtypes, token ids in [0, V), distinct root tokens for
    ``"specinfer_wor"``); traced out-of-range ids end their chain and are never emitted.

    Returns:
      A :class:`Verdict`; ``draft_index`` names a chain whose prefix the emitted tokens follow.
    """
    entry = registry.resolve(method, DRAFTS_METHODS, "verify_drafts")
    draft_tokens = jnp.asarray(draft_tokens)
    draft_logprobs = jnp.asarray(draft_logprobs)
    target_logprobs = jnp.asarray(target_logprobs)
    if draft_tokens.ndim != 2 or draft_tokens.shape[0] == 0:
        raise ValueError(
            f"verify_drafts: draft_tokens must be int32[K, n] with K >= 1, got shape "
            f"{draft_tokens.shape}"
        )
    num_drafts, n = draft_tokens.shape
    if draft_logprobs.ndim != 3 or draft_logprobs.shape[:2] != (num_drafts, n):
        raise ValueError(
            f"verify_drafts: draft_logprobs must be [K={num_drafts}, n={n}, V], got shape "
            f"{draft_logprobs.shape}"
        )
    vocab = draft_logprobs.shape[2]
    if target_logprobs.shape != (num_drafts, n + 1, vocab):
        raise ValueError(
            f"verify_drafts: target_logprobs must be [K={num_drafts}, n+1={n + 1}, V={vocab}], "
            f"got shape {target_logprobs.shape}"
        )
    check_dtypes(draft_tokens, draft_logprobs, target_logprobs, "verify_drafts")
    check_token_range(draft_tokens, vocab, "verify_drafts")
    lengths = check_draft_length(draft_length, n, (num_drafts,), "verify_drafts")
    if entry.law == "without_replacement":
        check_distinct_roots(draft_tokens, lengths, "verify_drafts")
    draft_tokens = draft_tokens.astype(jnp.int32)
    draft_logprobs = draft_logprobs.astype(jnp.float32)
    target_logprobs = target_logprobs.astype(jnp.float32)
    entry.validate(options, vocab=vocab)
    if entry.kind == "chain":
        return entry.verifier(
            key, draft_tokens[0], draft_logprobs[0], target_logprobs[0], lengths[0]
        )
    return entry.verifier(key, draft_tokens, draft_logprobs, target_logprobs, lengths, **options)


@known_keywords(*NAMES)
def verify_tree(
    key: jax.Array,
    tree: trees.TokenTree | trees.Tree,
    node_tokens: jax.Array,
    draft_logprobs: jax.Array,
    target_logprobs: jax.Array,
    valid: jax.Array | None = None,
    *,
    method: str = "tv_wr",
    **options,
) -> TreeVerdict:
    """Verify a drawn token tree against the target (docs/algorithms.md §7).

    Args:
      key: a PRNG key.
      tree: the static tree (a :class:`~asps_jax.trees.TokenTree`, or the chain ``Tree`` of the
        decode loop); node 0 is the root, the last committed token.
      node_tokens: int32[N], the token of each slot (entry 0, the root, is not used).
      draft_logprobs: float32[N, V], row i the law slot i's token was drawn from (row 0 unused).
      target_logprobs: float32[N, V], row i the target law after slot i (leaves: the bonus law).
      valid: bool[N], the slots that hold a drawn token (default all); ancestor-closed.
      method: ``"tv"`` (traversal verification; trees drawn without replacement, or independent
        draws), ``"tv_wr"`` (its with-replacement rule for independent draws) or ``"is_bv"``
        (IS path selection + ASpS against the induced laws; independent draws).
      options: ``"is_bv"`` only: ``alive="walkers"`` (default; laws conditioned on the drafts
        actually alive) or ``"count"`` (marginal over the number of alive drafts; identical draft
        models and a tree whose nodes at one depth have equal numbers of children), and
        ``rule=`` ``"level_race"`` (default with ``alive="walkers"``), ``"fixed_order"``
        (default and only named rule with ``alive="count"``) or a :class:`SelectionRule`.

    Shapes and dtypes are checked (integer ids, floating laws), and concrete ids must lie in
    ``[0, V)``, each a one-line ``ValueError``; a traced id outside ``[0, V)``, or one its draft
    law gives probability 0, ends its branch, so no id outside the vocabulary is ever emitted.

    Returns:
      A :class:`TreeVerdict` with ``tokens`` and ``path`` int32[D+1].
    """
    if isinstance(tree, trees.Tree):
        tree = trees.token_tree_of(tree)
    if not isinstance(tree, trees.TokenTree):
        raise ValueError(f"verify_tree: tree must be a TokenTree, got {type(tree).__name__}")
    n_nodes = tree.num_nodes
    node_tokens = jnp.asarray(node_tokens)
    draft_logprobs = jnp.asarray(draft_logprobs)
    target_logprobs = jnp.asarray(target_logprobs)
    if node_tokens.shape != (n_nodes,):
        raise ValueError(
            f"verify_tree: node_tokens must be int32[N={n_nodes}], got shape {node_tokens.shape}"
        )
    if draft_logprobs.ndim != 2 or draft_logprobs.shape[0] != n_nodes:
        raise ValueError(
            f"verify_tree: draft_logprobs must be [N={n_nodes}, V], got shape "
            f"{draft_logprobs.shape}"
        )
    if target_logprobs.shape != draft_logprobs.shape:
        raise ValueError(
            f"verify_tree: target_logprobs must be [N={n_nodes}, V={draft_logprobs.shape[1]}], "
            f"got shape {target_logprobs.shape}"
        )
    valid = jnp.ones((n_nodes,), bool) if valid is None else jnp.asarray(valid, bool)
    if valid.shape != (n_nodes,):
        raise ValueError(f"verify_tree: valid must be bool[N={n_nodes}], got shape {valid.shape}")
    # As verify_chain / verify_drafts: dtypes always, ids when concrete (the root's is not used);
    # traced out-of-range ids end their branch (_in_contract).
    check_dtypes(node_tokens, draft_logprobs, target_logprobs, "verify_tree", "node_tokens")
    check_token_range(
        node_tokens[1:], draft_logprobs.shape[1], "verify_tree", "node_tokens (slots 1..N-1)"
    )
    return sample_tree(
        key,
        tree,
        node_tokens.astype(jnp.int32),
        draft_logprobs.astype(jnp.float32),
        target_logprobs.astype(jnp.float32),
        valid,
        method,
        **options,
    )
