"""The one method registry (asps_jax/verify/registry.py): every public list of method names, the
CLI's choices and help, and the benchmark scripts' lists are derived from it, and its entries
validate options with the verifiers' one-line errors. Expected lists are literals (the public API
of docs/api.md §1 and §3)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

import asps_jax
from asps_jax import sampler, trees
from asps_jax.cli.args import build_parser
from asps_jax.verify import api, multi, registry
from asps_jax.verify import options as verify_options
from asps_jax.verify import tree as vtree
from asps_jax.verify.registry import REGISTRY

SCRIPTS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load_script(name, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # the scripts import harness (and bench_model)
    spec = importlib.util.spec_from_file_location(f"registry_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_public_lists_keep_their_values_and_order():
    assert api.CHAIN_METHODS == asps_jax.verify.CHAIN_METHODS == ("sps", "asps")
    assert api.DRAFTS_METHODS == asps_jax.verify.DRAFTS_METHODS == (
        "specinfer", "spectr", "is", "optimal", "specinfer_wor", "sps", "asps",
    )  # fmt: skip
    assert api.WITHOUT_REPLACEMENT_METHODS == ("specinfer_wor",)
    assert api.TREE_METHODS == ("tv", "tv_wr", "is_bv")
    assert sampler.METHODS == (
        "ar", "sps", "asps", "specinfer", "spectr", "is", "optimal", "specinfer_wor", "tv",
        "tv_wr", "is_bv",
    )  # fmt: skip


def test_every_public_list_is_derived_from_the_registry():
    assert set(REGISTRY) == set(api.DRAFTS_METHODS + api.TREE_METHODS)
    for name, entry in REGISTRY.items():
        assert entry.name == name and entry.kind in registry.KINDS
        assert set(entry.laws) <= set(registry.LAWS) and entry.law == entry.laws[0]
    assert all(REGISTRY[m].kind == "chain" for m in api.CHAIN_METHODS)
    assert all(REGISTRY[m].kind == "tree" for m in api.TREE_METHODS)
    assert all(REGISTRY[m].law == "without_replacement" for m in api.WITHOUT_REPLACEMENT_METHODS)
    # sample runs every entry: independent chains, or (specinfer_wor) K roots drawn without
    # replacement as one node's siblings, each continued by its own chain.
    assert sampler.METHODS[0] == "ar" and "ar" not in REGISTRY
    assert sampler.METHODS[1:] == tuple(m for m, e in REGISTRY.items() if e.in_sample)
    assert sampler.METHODS[1:] == tuple(REGISTRY)
    wor = REGISTRY["specinfer_wor"].draft_tree(3, 4)
    assert wor.widths == (3, 1, 1, 1) and wor.draws == "without_replacement"
    assert REGISTRY["specinfer_wor"].draft_tree(1, 4).draws == "chains"
    assert REGISTRY["specinfer"].draft_tree(3, 4).draws == "chains"
    # The multi-draft verifiers are multi.py's functions; the option defaults are options.py's.
    for name in registry.names("drafts"):
        assert REGISTRY[name].verifier is getattr(multi, f"verify_{name}")
    # tree.py's own list (it sits below the registry) names the registry's tree entries.
    assert vtree.METHODS == registry.names("tree")
    assert verify_options.IS_DEFAULTS == {k: v for k, v in REGISTRY["is"].options if k != "tail"}
    assert verify_options.OPTIMAL_DEFAULTS == {
        "levels": 16,
        "fit_steps": 15,
        "table": 128,
        "batch_axis": None,
        "grad_steps": 200,
    }
    for name in api.TREE_METHODS:
        assert REGISTRY[name].verifier.keywords == {"method": name}


def test_entries_are_small_frozen_values():
    entry = REGISTRY["is"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.name = "other"
    assert hash(entry) == hash(dataclasses.replace(entry))
    assert entry.defaults["rule"] == "level_race" and entry.defaults["tail"] == "asps"
    assert REGISTRY["sps"].options == () and REGISTRY["tv"].options == ()
    with pytest.raises(ValueError, match="unknown method kind"):
        registry.names("chains")


@pytest.mark.parametrize(
    "method, options, match",
    [
        ("sps", {"rule": "sir"}, "takes no options"),
        ("asps", {"tail": "sps"}, "takes no options"),
        ("specinfer", {"rule": "sir"}, "takes no options"),
        ("specinfer_wor", {"levels": 2}, "takes no options"),
        ("spectr", {"tail": "block"}, "tail must be one of"),
        ("is", {"temperature": 1.0}, "unknown option"),
        ("is", {"rule": "nope"}, "unknown rule"),
        ("is", {"levels": 0}, "levels must be an int >= 1"),
        ("is", {"batch_axis": 3}, "batch_axis must be a vmap axis name"),
        ("optimal", {"s": 3}, "LP option"),
        ("tv", {"alive": "count"}, "takes no options"),
        ("tv_wr", {"rule": "sir"}, "takes no options"),
        ("is_bv", {"beta": 1.0}, "unknown option"),
        ("is_bv", {"alive": "all"}, "alive must be one of"),
    ],
)
def test_validate_gives_the_verifiers_one_line_errors(method, options, match):
    with pytest.raises(ValueError, match=match) as info:
        REGISTRY[method].validate(options)
    assert "\n" not in str(info.value)


def test_validate_accepts_good_options_and_checks_the_tree_and_vocabulary():
    for method, options in [
        ("sps", {}),
        ("specinfer", {"tail": "sps"}),
        ("is", {"rule": "sir", "alphabet": 8}),
        ("optimal", {"grad_steps": 3, "tail": "sps"}),
        ("tv", {}),
        ("is_bv", {"alive": "count"}),
    ]:
        REGISTRY[method].validate(options)
    with pytest.raises(ValueError, match="larger than the vocabulary"):
        REGISTRY["is"].validate({"rule": "sir", "alphabet": 8}, vocab=4)
    uneven = trees.TokenTree((-1, 0, 0, 1))  # depth 1: one node has a child, the other none
    REGISTRY["is_bv"].validate({"alive": "count"}, tree=trees.chains_token_tree(2, 3))
    with pytest.raises(ValueError, match="same number of children"):
        REGISTRY["is_bv"].validate({"alive": "count"}, tree=uneven)


def test_cli_choices_and_help_come_from_the_registry():
    parser = build_parser()
    (action,) = [a for a in parser._actions if "--method" in a.option_strings]
    # Every method of sample() but "optimal", a reference construction (Python only).
    assert tuple(action.choices) == tuple(m for m in sampler.METHODS if m != "optimal")
    assert "optimal" in sampler.METHODS
    assert action.help == (
        "verification method: ar = target alone; sps / asps = one draft chain; specinfer / "
        "spectr / is / specinfer_wor = several drafts, token by token; tv / tv_wr / is_bv = "
        "several drafts verified as one tree (default asps)"
    )


def test_benchmark_lists_come_from_the_registry(monkeypatch):
    bench = _load_script("benchmark", monkeypatch)
    assert bench.CHAIN == ("sps", "asps")
    assert bench.MULTI == (
        "specinfer", "spectr", "is", "optimal", "specinfer_wor", "tv", "tv_wr", "is_bv",
    )  # fmt: skip
    verify = _load_script("bench_verify", monkeypatch)
    assert verify.CHAIN_METHODS == api.CHAIN_METHODS
    base = {m.partition("[")[0] for m in verify.DRAFTS_METHODS}
    assert base == {"sps"} | set(registry.names("drafts"))
    assert verify.REAL_METHODS == (
        "specinfer", "spectr", "is[level_race]", "is[truncated_lp]", "is[fixed_order]",
        "is[sir]", "optimal",
    )  # fmt: skip
    cost = _load_script("bench_cost_ratio", monkeypatch)
    assert [cost.num_drafts(m) for m in sampler.METHODS] == [1, 1, 1] + [2] * 8
