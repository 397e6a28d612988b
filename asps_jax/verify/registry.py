"""The one registry of verification methods: :data:`REGISTRY`, name -> :class:`Method`.

Every other list of method names derives from it: ``CHAIN_METHODS``, ``DRAFTS_METHODS``,
``TREE_METHODS`` and ``WITHOUT_REPLACEMENT_METHODS`` (verify/api.py), ``multi.METHODS``,
``sampler.METHODS``, the CLI's ``--method`` choices and help, the benchmark scripts' method lists
and the tests' parametrisations.

An entry names the kind of input its verifier takes (one chain, K chains, or a node-indexed token
tree), the draft laws it is exact for, and the options it accepts with their defaults;
:meth:`Method.validate` raises the verifier's own one-line ``ValueError`` for bad options before
anything is traced (the checks themselves stay in multi.py and tree.py). Verifiers are resolved on
first use, so importing this module imports no other verification module.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Mapping
from typing import Any

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


def _no_options(method: Method, options: Mapping, vocab, tree) -> None:
    if options:
        raise ValueError(f"verify_drafts: method {method.name!r} takes no options, got {options}")


def _drafts_options(method: Method, options: Mapping, vocab, tree) -> None:
    from asps_jax.verify import multi

    options = dict(options)
    multi.check_tail(options.pop("tail", "asps"))
    if method.name in ("is", "optimal"):
        # Without a vocabulary only the check that an option exceeds it is left to the verifier.
        multi._rule_config(method.name, vocab if vocab is not None else 1 << 62, options)
    else:
        multi._reject_options(method.name, options)


def _tree_options(method: Method, options: Mapping, vocab, tree) -> None:
    from asps_jax import trees
    from asps_jax.verify import tree as tree_mod

    if tree is None:
        tree = trees.chains_token_tree(1, 1)
    tree_mod.check_options(tree, method.name, **options)


@dataclasses.dataclass(frozen=True)
class Method:
    """One verification method.

    Attributes:
      name: the ``method=`` string.
      kind: the input its verifier takes, a key of :data:`KINDS`.
      laws: the draft laws (:data:`LAWS`) it is exact for; ``laws[0]`` is the one it needs.
      options: ``(name, default)`` pairs of the options it accepts; a default of ``None`` is the
        verifier's own default (``is_bv``'s rule: ``"level_race"``, or ``"fixed_order"`` with
        ``alive="count"``).
      function: ``"module:attribute"`` of the verifier, imported on first use.
    """

    name: str
    kind: str
    laws: tuple[str, ...]
    options: tuple[tuple[str, Any], ...]
    function: str
    _check: Callable[..., None] = dataclasses.field(repr=False, compare=False)
    branch_draws: str = "iid"
    rows_option: Callable[[dict, str], dict] | None = dataclasses.field(
        default=None, repr=False, compare=False
    )

    @property
    def merges_siblings(self) -> bool:
        """The verifier merges siblings that drew the same token (reads one law per node)."""
        return self.kind == "tree"

    def draft_tree(self, num_drafts: int, draft_len: int, widths: tuple = ()):
        """The step's :class:`~asps_jax.trees.DraftTree`: K independent chains, or the branching
        tree ``widths`` drawn with this method's sibling law (``branch_draws``)."""
        from asps_jax import trees

        if widths:
            return trees.DraftTree(widths, self.branch_draws)
        return trees.DraftTree.chains(num_drafts, draft_len)

    @property
    def law(self) -> str:
        """The draft law the method needs."""
        return self.laws[0]

    @property
    def in_sample(self) -> bool:
        """Usable by ``sample`` / the decode loop, which draws its K chains independently."""
        return "iid" in self.laws

    @property
    def defaults(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def verifier(self) -> Callable:
        """The verifier: a :data:`~asps_jax.verify.api.ChainVerifier` or ``DraftsVerifier``, or
        ``verify_tree`` with ``method=`` bound."""
        return _resolve(self.function, self.name if self.kind == "tree" else None)

    def validate(self, options: Mapping[str, Any], *, vocab: int | None = None, tree=None) -> None:
        """Raise the verifier's one-line ``ValueError`` if it does not accept ``options`` (plain
        Python values).

        Args:
          vocab: V, where options are bounded by it (``alphabet`` of ``"is"``); None skips that.
          tree: the static tree of a tree method (shape-dependent options, e.g. ``alive="count"``);
            None checks the options alone.
        """
        self._check(self, options, vocab, tree)


@functools.cache
def _resolve(function: str, method: str | None) -> Callable:
    module, _, attr = function.partition(":")
    fn = getattr(importlib.import_module(module), attr)
    return functools.partial(fn, method=method) if method is not None else fn


def _race_rows(options: dict, axis: str) -> dict:
    """The level race of ``"is"`` / ``"optimal"`` fits only where some row needs it."""
    return {**options, "batch_axis": axis}


def _tree_race_rows(options: dict, axis: str) -> dict:
    """``"is_bv"``: the level race fits a node only when some row of the batch has two walkers
    there (most nodes below the root have one): the same verdicts, far fewer fits."""
    from asps_jax.verify.tree import LevelRaceRule

    if options.get("alive", "walkers") != "walkers":
        return options
    rule = options.get("rule", "level_race")
    if rule == "level_race":
        return {**options, "rule": LevelRaceRule(batch_axis=axis)}
    if isinstance(rule, LevelRaceRule):
        return {**options, "rule": dataclasses.replace(rule, batch_axis=axis)}
    return options


_TAIL = (("tail", "asps"),)
_RACE = (("levels", 16), ("fit_steps", 15), ("table", 128), ("batch_axis", None))
_IID = ("iid",)


def _entries():
    chain = "asps_jax.verify.chain:"
    multi = "asps_jax.verify.multi:"
    tree = "asps_jax.verify.tree:verify_tree"
    yield Method("sps", "chain", _IID, (), chain + "sps", _no_options)
    yield Method("asps", "chain", _IID, (), chain + "asps", _no_options)
    yield Method("specinfer", "drafts", _IID, _TAIL, multi + "verify_specinfer", _drafts_options)
    yield Method("spectr", "drafts", _IID, _TAIL, multi + "verify_spectr", _drafts_options)
    is_options = (("rule", "level_race"), *_RACE)
    is_options += (("s", 5), ("alphabet", 40), ("lp_iters", 300), ("tol", 1e-5))
    yield Method("is", "drafts", _IID, _TAIL + is_options, multi + "verify_is", _drafts_options,
                 rows_option=_race_rows)  # fmt: skip
    optimal_options = _TAIL + _RACE + (("grad_steps", 200),)
    yield Method("optimal", "drafts", _IID, optimal_options, multi + "verify_optimal",
                 _drafts_options, rows_option=_race_rows)  # fmt: skip
    yield Method(
        "specinfer_wor",
        "drafts",
        ("without_replacement",),
        _TAIL,
        multi + "verify_specinfer_wor",
        _drafts_options,
    )
    yield Method("tv", "tree", ("iid", "without_replacement"), (), tree, _tree_options,
                 branch_draws="without_replacement")  # fmt: skip
    yield Method("tv_wr", "tree", _IID, (), tree, _tree_options)
    yield Method("is_bv", "tree", _IID, (("alive", "walkers"), ("rule", None)), tree, _tree_options,
                 rows_option=_tree_race_rows)  # fmt: skip


REGISTRY: dict[str, Method] = {m.name: m for m in _entries()}
"""Every verification method, in the order the public lists follow."""


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
