"""The one validator of verification options: each method's options are an :class:`Options`
value (its accepted names and defaults) that checks a mapping of plain Python values before
anything is traced, and returns them resolved (a :class:`~asps_jax.verify.selection.RuleConfig`
for the level race / pairwise rules, a selection rule object for ``"is_bv"``). Every check raises
a one-line ``ValueError`` that names the function and the argument.

The registry (verify/registry.py) gives every method one of these values; ``sample``, the
verifiers and the decode step all validate through it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from asps_jax.checks import check_keywords
from asps_jax.verify.selection import PAIRWISE_RULES, RULES, RuleConfig
from asps_jax.verify.tree_rules import ALIVE_MODES, TREE_RULES, FixedOrderRule, LevelRaceRule

TAILS = ("asps", "sps")
RACE_OPTIONS = ("levels", "fit_steps", "table")
PAIRWISE_OPTIONS = ("s", "alphabet", "lp_iters", "tol")
_TAIL = (("tail", "asps"),)
_RACE = (("levels", 16), ("fit_steps", 15), ("table", 128), ("batch_axis", None))
IS_DEFAULTS = dict(
    (("rule", "level_race"), *_RACE, ("s", 5), ("alphabet", 40), ("lp_iters", 300), ("tol", 1e-5))
)
OPTIMAL_DEFAULTS = dict((*_RACE, ("grad_steps", 200)))
NAMES = frozenset(("tail", "alive", *IS_DEFAULTS, *OPTIMAL_DEFAULTS))
"""Every option some verification method takes (a keyword outside it is unknown everywhere)."""
_BIG_VOCAB = 1 << 62  # no vocabulary given: only the check that an option exceeds it is skipped


def check_tail(tail) -> None:
    """``tail`` must be ``"asps"`` (default) or ``"sps"`` (a one-line ValueError otherwise)."""
    if tail not in TAILS:
        raise ValueError(f"verify_drafts: tail must be one of {TAILS}, got {tail!r}")


def _pick(method: str, options: Mapping, defaults: dict) -> dict:
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ValueError(
            f"verify_drafts: unknown option(s) {unknown} for method {method!r}; "
            f"allowed: {sorted(defaults)}"
        )
    return {**defaults, **options}


def _positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"verify_drafts: {name} must be an int >= {minimum}, got {value!r}")
    return value


def _table(value) -> int:
    """``table``: 0 (one level law per token) or B >= 2 tabulated laws."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value == 1:
        raise ValueError(f"verify_drafts: table must be an int, 0 or >= 2, got {value!r}")
    return value


def _axis_name(value):
    """``batch_axis``: None, or the name of the ``vmap`` axis the call is mapped over."""
    if value is not None and not isinstance(value, str):
        raise ValueError(
            f"verify_drafts: batch_axis must be a vmap axis name or None, got {value!r}"
        )
    return value


def rule_config(method: str, vocab: int, options: Mapping) -> RuleConfig:
    """Validate the options of ``"is"`` / ``"optimal"`` (plain Python values, ``tail`` excluded)
    into a static :class:`RuleConfig`."""
    if method == "optimal":
        legacy = sorted(set(options) & set(PAIRWISE_OPTIONS))
        if legacy:
            raise ValueError(
                f"verify_drafts: method 'optimal' is a gradient-fitted level race and takes no "
                f"LP option {legacy}; the pairwise LP is method='is', rule='truncated_lp'"
            )
        opts = _pick(method, options, OPTIMAL_DEFAULTS)
        return RuleConfig(
            rule="level_race",
            levels=_positive_int("levels", opts["levels"]),
            fit_steps=_positive_int("fit_steps", opts["fit_steps"]),
            table=_table(opts["table"]),
            grad_steps=_positive_int("grad_steps", opts["grad_steps"], minimum=0),
            batch_axis=_axis_name(opts["batch_axis"]),
        )
    opts = _pick(method, options, IS_DEFAULTS)
    rule = opts["rule"]
    if rule not in RULES:
        raise ValueError(f"verify_drafts: unknown rule={rule!r}; choose one of {RULES}")
    if rule == "level_race":
        wrong = sorted(set(options) & set(PAIRWISE_OPTIONS))
        if wrong:
            raise ValueError(
                f"verify_drafts: option(s) {wrong} apply to the pairwise rules "
                f"{PAIRWISE_RULES} only, not rule='level_race' (which takes {RACE_OPTIONS})"
            )
        return RuleConfig(
            rule=rule,
            levels=_positive_int("levels", opts["levels"]),
            fit_steps=_positive_int("fit_steps", opts["fit_steps"]),
            table=_table(opts["table"]),
            batch_axis=_axis_name(opts["batch_axis"]),
        )
    wrong = sorted(set(options) & set(RACE_OPTIONS))
    if wrong:
        raise ValueError(
            f"verify_drafts: option(s) {wrong} apply to rule='level_race' only, not {rule!r}"
        )
    alphabet = opts["alphabet"]
    if not isinstance(alphabet, int) or alphabet < 1:
        raise ValueError(f"verify_drafts: alphabet must be a positive int, got {alphabet!r}")
    if "alphabet" in options and alphabet > vocab:
        raise ValueError(
            f"verify_drafts: alphabet={alphabet} is larger than the vocabulary V={vocab}"
        )
    alphabet = min(alphabet, vocab)
    if rule == "sir":
        block = alphabet
    elif rule == "fixed_order":
        block = 1
    else:
        block = opts["s"]
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"verify_drafts: s must be a positive int, got {block!r}")
        if "s" in options and block > alphabet:
            raise ValueError(f"verify_drafts: s={block} is larger than the alphabet ({alphabet})")
        block = min(block, alphabet)
    if "s" in options and rule != "truncated_lp":
        raise ValueError(f"verify_drafts: s applies to rule='truncated_lp' only, not {rule!r}")
    if not isinstance(opts["lp_iters"], int) or opts["lp_iters"] < 0:
        raise ValueError(f"verify_drafts: lp_iters must be an int >= 0, got {opts['lp_iters']!r}")
    return RuleConfig(
        rule=rule, block=block, alphabet=alphabet, lp_iters=opts["lp_iters"], tol=float(opts["tol"])
    )


def uniform_widths(tree) -> tuple[int, ...]:
    """Children per node at each depth; ``alive="count"`` needs them equal within a depth."""
    widths = []
    for d in range(tree.max_depth):
        counts = set(tree.num_children[tree.depth == d].tolist())
        if len(counts) != 1:
            raise ValueError(
                'verify_tree: alive="count" needs a tree whose nodes at one depth all have the '
                f"same number of children; depth {d} has {sorted(counts)}"
            )
        widths.append(counts.pop())
    return tuple(widths)


def selection_options(tree, options: Mapping) -> dict:
    """``"is_bv"``'s options resolved: ``{"rule": a selection rule, "alive": ...}``. ``tree``
    (a :class:`~asps_jax.trees.TokenTree`, or None) is checked for ``alive="count"``."""
    unknown = sorted(set(options) - {"rule", "alive"})
    if unknown:
        raise ValueError(f"verify_tree: unknown option(s) {unknown} for method 'is_bv'")
    alive = options.get("alive", "walkers")
    if alive not in ALIVE_MODES:
        raise ValueError(f"verify_tree: alive must be one of {ALIVE_MODES}, got {alive!r}")
    if alive == "count" and tree is not None:
        uniform_widths(tree)
    # alive="count" needs the law of the number of alive drafts, which the fixed order gives.
    rule = options.get("rule", "fixed_order" if alive == "count" else "level_race")
    if isinstance(rule, str):
        if rule not in TREE_RULES:
            raise ValueError(
                f"verify_tree: rule must be one of {TREE_RULES} or a SelectionRule, got {rule!r}"
            )
        rule = LevelRaceRule() if rule == "level_race" else FixedOrderRule()
    elif not all(callable(getattr(rule, name, None)) for name in ("walkers", "counted")):
        raise ValueError(
            f"verify_tree: rule must be one of {TREE_RULES} or a SelectionRule (an object with "
            f"walkers() and counted()), got {type(rule).__name__}"
        )
    if alive == "count" and isinstance(rule, LevelRaceRule):
        raise ValueError(
            "verify_tree: alive='count' needs rule='fixed_order' (the level race gives no law "
            "of the number of drafts alive below its winner)"
        )
    return {"rule": rule, "alive": alive}


@dataclasses.dataclass(frozen=True)
class Options:
    """The options one method accepts, and their one validator.

    Attributes:
      kind: ``"none"`` (no options), ``"tail"`` (``tail=`` only), ``"race"`` (``"is"`` /
        ``"optimal"``: ``tail=`` and a selection rule's, into a RuleConfig) or ``"selection"``
        (``"is_bv"``: ``alive=`` and ``rule=``).
      defaults: ``(name, default)`` pairs; a default of None is the verifier's own (``is_bv``'s
        rule: ``"level_race"``, or ``"fixed_order"`` with ``alive="count"``).
      caller: the function named in a message (``"verify_drafts"`` or ``"verify_tree"``).
    """

    kind: str
    defaults: tuple[tuple[str, Any], ...] = ()
    caller: str = "verify_drafts"

    def check(self, method: str, options: Mapping, *, vocab: int | None = None, tree=None):
        """Raise the one-line ``ValueError`` for options ``method`` does not take; returns them
        resolved: a dict (``tail`` and the verifier's keywords) for ``"none"`` / ``"tail"`` /
        ``"selection"``, and ``(tail, RuleConfig)`` for ``"race"``.

        Args:
          vocab: V, where options are bounded by it (``alphabet`` of ``"is"``); None skips that.
          tree: the static tree of a tree method (``alive="count"`` needs uniform widths); None
            checks the options alone.
        """
        options = dict(options)
        check_keywords(self.caller, options, NAMES)  # a name no method takes: unknown
        if self.kind == "selection":
            return selection_options(tree, options)
        tail = options.pop("tail", "asps") if self.kind in ("tail", "race") else "asps"
        check_tail(tail)
        if self.kind == "race":
            return tail, rule_config(method, _BIG_VOCAB if vocab is None else vocab, options)
        if options:
            raise ValueError(f"{self.caller}: method {method!r} takes no options, got {options}")
        return {"tail": tail} if self.kind == "tail" else {}


NONE = Options("none")
TREE_NONE = Options("none", caller="verify_tree")
TAIL = Options("tail", _TAIL)
IS = Options("race", _TAIL + tuple(IS_DEFAULTS.items()))
OPTIMAL = Options("race", _TAIL + tuple(OPTIMAL_DEFAULTS.items()))
SELECTION = Options("selection", (("alive", "walkers"), ("rule", None)), caller="verify_tree")
