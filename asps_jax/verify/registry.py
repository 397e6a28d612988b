"""The one registry of verification methods: :data:`REGISTRY`, name -> :class:`Method`.

Every other list of method names derives from it: ``CHAIN_METHODS``, ``DRAFTS_METHODS``,
``TREE_METHODS`` and ``WITHOUT_REPLACEMENT_METHODS`` (verify/api.py), ``sampler.METHODS``, the
CLI's ``--method`` choices and help, the benchmark scripts' method lists and the tests'
parametrisations.

A method is resolved once (:func:`resolve`) into its :class:`Method` value: the kind of input its
verifier takes (one chain, K chains, or a node-indexed token tree), the draft laws it is exact for
and the one a branching draft tree draws for it, its options (an
:class:`~asps_jax.verify.options.Options` value, the one validator), whether its level race can
fit per row of a batch, and the verifier itself. The sampler, the decode step and the public
entry points read that value, never the name. This module sits on top of the verifiers
(chain.py, multi.py, tree.py) and imports them; none of them imports it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

from asps_jax import trees
from asps_jax.verify import chain, multi, tree
from asps_jax.verify import options as opts
from asps_jax.verify.tree_rules import LevelRaceRule

KINDS = {
    "chain": "one draft chain",
    "drafts": "several drafts, token by token",
    "tree": "several drafts verified as one tree",
}
"""Kind of input -> what it is: ``"chain"`` verifiers take ``[n]`` tokens (verify_chain, or chain 0
of verify_drafts), ``"drafts"`` ones ``[K, n]`` chains (verify_drafts), ``"tree"`` ones a
node-indexed tree (verify_tree)."""

LAWS = ("iid", "without_replacement")
"""Draft laws: independent draws (the K chains of the decode loop), or root tokens drawn without
replacement (multi.sample_without_replacement)."""


@dataclasses.dataclass(frozen=True)
class Method:
    """One verification method, resolved.

    Attributes:
      name: the ``method=`` string.
      kind: the input its verifier takes, a key of :data:`KINDS`.
      laws: the draft laws (:data:`LAWS`) it is exact for; ``laws[0]`` is the one it needs.
      accepts: its options and their one validator (:class:`~asps_jax.verify.options.Options`).
      verifier: a :data:`~asps_jax.verify.verdict.ChainVerifier` or ``DraftsVerifier``, or
        ``tree.sample_tree`` with ``method=`` bound.
      branch_draws: how a branching draft tree draws siblings for it
        (:data:`~asps_jax.trees.DRAWS`): ``"without_replacement"`` for ``"tv"``, else ``"iid"``.
      rows_option: ``(options, axis_name) -> options``: the options with which its level race
        fits only where some row of a batch ``vmap``-ed over ``axis_name`` needs it (the same
        verdicts, far fewer fits); None when it has no such fit.
    """

    name: str
    kind: str
    laws: tuple[str, ...]
    accepts: opts.Options = dataclasses.field(repr=False)
    verifier: Callable = dataclasses.field(repr=False, compare=False)
    branch_draws: str = "iid"
    rows_option: Callable[[dict, str], dict] | None = dataclasses.field(
        default=None, repr=False, compare=False
    )

    @property
    def law(self) -> str:
        """The draft law the method needs."""
        return self.laws[0]

    @property
    def in_sample(self) -> bool:
        """Usable by ``sample`` / the decode loop: every method is. The loop draws K independent
        chains, or, for a method that needs root drafts without replacement, the K roots as
        distinct siblings of one node, each continued by its own chain (:meth:`draft_tree`)."""
        return self.law in LAWS

    @property
    def options(self) -> tuple[tuple[str, Any], ...]:
        """``(name, default)`` pairs of the options it accepts."""
        return self.accepts.defaults

    @property
    def defaults(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def merges_siblings(self) -> bool:
        """Its verifier merges siblings that drew the same token (it reads one law per merged
        node, so the decode step scores each merged node once)."""
        return self.kind == "tree"

    def validate(self, options: Mapping[str, Any], *, vocab: int | None = None, tree=None) -> None:
        """Raise the verifier's one-line ``ValueError`` if it does not accept ``options`` (plain
        Python values).

        Args:
          vocab: V, where options are bounded by it (``alphabet`` of ``"is"``); None skips that.
          tree: the static tree of a tree method (shape-dependent options, e.g. ``alive="count"``);
            None checks the options alone.
        """
        self.accepts.check(self.name, options, vocab=vocab, tree=tree)

    def draft_tree(self, num_drafts: int, draft_len: int, widths: tuple = ()) -> trees.DraftTree:
        """The decode step's :class:`~asps_jax.trees.DraftTree`: K independent chains, the
        branching tree ``widths`` drawn with :attr:`branch_draws`, or, for a method that needs
        root drafts without replacement (``"specinfer_wor"``), K chains whose roots are drawn
        without replacement: the tree of widths ``(K, 1, ..., 1)`` (its root paths are the K
        chains the verifier reads, in the order their roots were drawn)."""
        if widths:
            return trees.DraftTree(widths, self.branch_draws)
        if self.law == "without_replacement" and num_drafts > 1:
            return trees.DraftTree((num_drafts,) + (1,) * (draft_len - 1), "without_replacement")
        return trees.DraftTree.chains(num_drafts, draft_len)


def _race_rows(options: dict, axis: str) -> dict:
    """``"is"`` / ``"optimal"``: the level race fits a node only where some row needs it."""
    return {**options, "batch_axis": axis}


def _tree_race_rows(options: dict, axis: str) -> dict:
    """``"is_bv"``: the level race fits a node only when some row of the batch has two walkers
    there (most nodes below the root have one)."""
    if options.get("alive", "walkers") != "walkers":
        return options
    rule = options.get("rule", "level_race")
    if rule == "level_race":
        return {**options, "rule": LevelRaceRule(batch_axis=axis)}
    if isinstance(rule, LevelRaceRule):
        return {**options, "rule": dataclasses.replace(rule, batch_axis=axis)}
    return options


_IID = ("iid",)


def _tree_verifier(name: str) -> Callable:
    return functools.partial(tree.sample_tree, method=name)


def _entries():
    yield Method("sps", "chain", _IID, opts.NONE, chain.sps)
    yield Method("asps", "chain", _IID, opts.NONE, chain.asps)
    yield Method("specinfer", "drafts", _IID, opts.TAIL, multi.verify_specinfer)
    yield Method("spectr", "drafts", _IID, opts.TAIL, multi.verify_spectr)
    yield Method("is", "drafts", _IID, opts.IS, multi.verify_is, rows_option=_race_rows)
    yield Method(
        "optimal", "drafts", _IID, opts.OPTIMAL, multi.verify_optimal, rows_option=_race_rows
    )
    wor = ("without_replacement",)
    yield Method("specinfer_wor", "drafts", wor, opts.TAIL, multi.verify_specinfer_wor)
    yield Method(
        "tv", "tree", (*_IID, *wor), opts.TREE_NONE, _tree_verifier("tv"),
        branch_draws="without_replacement",
    )  # fmt: skip
    yield Method("tv_wr", "tree", _IID, opts.TREE_NONE, _tree_verifier("tv_wr"))
    yield Method(
        "is_bv", "tree", _IID, opts.SELECTION, _tree_verifier("is_bv"),
        rows_option=_tree_race_rows,
    )  # fmt: skip


REGISTRY: dict[str, Method] = {m.name: m for m in _entries()}
"""Every verification method, in the order the public lists follow."""

DEFAULT_METHOD = "asps"
"""The method of ``sample`` / ``Session`` / the command line when none is given."""

REFERENCE_METHODS = ("optimal",)
"""Methods available from Python only, not as a ``--method`` choice: reference constructions
whose per-step fit costs several decode steps."""


def resolve(name, known=None, fn_name: str = "method") -> Method:
    """The :class:`Method` called ``name`` (one of ``known``, default every method); an unknown
    name is a one-line ``ValueError`` naming ``fn_name`` and the choices."""
    known = tuple(REGISTRY) if known is None else tuple(known)
    if name not in known or name not in REGISTRY:
        raise ValueError(
            f"{fn_name}: unknown method {name!r}; choose one of {', '.join(sorted(known))}"
        )
    return REGISTRY[name]


def names(kind: str, *, sample: bool | None = None) -> tuple[str, ...]:
    """The names of ``kind`` in registry order; ``sample=True`` keeps those ``sample`` runs."""
    if kind not in KINDS:
        raise ValueError(f"unknown method kind {kind!r}; choose one of {', '.join(KINDS)}")
    return tuple(
        m.name
        for m in REGISTRY.values()
        if m.kind == kind and (sample is None or m.in_sample == sample)
    )


def describe(methods) -> str:
    """``"sps / asps = one draft chain; ..."``: ``methods`` grouped by kind (CLI help)."""
    methods = tuple(methods)
    groups = {kind: [m for m in methods if REGISTRY[m].kind == kind] for kind in KINDS}
    return "; ".join(" / ".join(g) + " = " + KINDS[kind] for kind, g in groups.items() if g)
