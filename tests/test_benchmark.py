"""benchmarks/benchmark.py: a smoke run through ``main([...])`` on tiny random checkpoints written
by transformers, checking the table and JSON structure and that the figures are sane; flag errors.
The other benchmark scripts of benchmarks/: their smoke runs, --quick and their helps."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from subprocess_env import xla_flags

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "benchmark.py"


def _load_script():
    # The suite's scripts import benchmarks/harness.py (and each other) by name, as
    # `python benchmarks/<script>.py` does: the folder stays on the path for the other loads.
    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("benchmark_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


benchmark = _load_script()


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A random Llama target and a smaller random draft over a 64-token vocabulary."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_checkpoints import write_tiny_llama

    root = tmp_path_factory.mktemp("benchmark_pair")
    paths = []
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        write_tiny_llama(
            root / name,
            seed=seed,
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            # Large weights give peaked laws, so that drafts are sometimes rejected.
            initializer_range=0.5,
        )
        paths.append(str(root / name))
    return paths


@pytest.mark.slow
def test_smoke_table_and_json(tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair
    out_json = tmp_path / "bench.json"
    argv = ["--target", target, "--draft", draft, "--methods", "sps", "tv", "--trees", "2,1"]
    argv += ["--n", "2", "--k", "2", "--batch-size", "2", "--max-new-tokens", "12"]
    argv += ["--prompt-tokens", "6", "--repeats", "1", "--json", str(out_json)]
    assert benchmark.main(argv) == 0
    stdout = capsys.readouterr().out
    for header in ("| method | K | n | tokens/step", "| transformers | n |"):
        assert header in stdout
    result = json.loads(out_json.read_text())

    ours = {(r["method"], r["n"], r["K"], tuple(r["tree"])): r for r in result["ours"]}
    assert set(ours) == {
        ("ar", 0, 1, ()),
        ("sps", 2, 1, ()),
        ("tv", 2, 2, ()),
        ("tv", 2, 2, (2, 1)),
    }
    assert "| tv tree=2,1 | 2 | 2 |" in stdout
    for (method, n, k, _), r in ours.items():
        assert f"| {method} |" in stdout
        # Draft nodes scored per step: none for AR, at most the n * K slots of the tree.
        assert 0 <= r["scored_nodes_per_step"] <= n * k
        assert (r["scored_nodes_per_step"] > 0) == (method != "ar")
        assert r["tokens"] == 2 * 12  # EOS never stops a row
        assert 1.0 <= r["tokens_per_step"] <= n + 1 if n else r["tokens_per_step"] == 1.0
        assert r["steps"] * r["tokens_per_step"] == pytest.approx(r["tokens"])
        assert r["target_calls_per_row"] > 0 and r["fallbacks"] >= 0
        assert r["steps"] == pytest.approx(2 * r["target_calls_per_row"])
        assert r["compile_s"] > 0 and r["wall_s"] > 0 and r["tokens_per_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["wall_s"])
        if method == "ar":
            assert r["acceptance"] is None and r["speedup_vs_ar"] == 1.0
            assert r["tokens_per_step_se"] == 0.0
        else:
            assert 0.0 <= r["acceptance"] <= 1.0
            assert 0.0 <= r["root_acceptance"] <= 1.0
            assert 0.0 < r["root_optimal_acceptance"] <= 1.0
    ar_tps = ours[("ar", 0, 1, ())]["tokens_per_s"]
    sps = ours[("sps", 2, 1, ())]
    assert sps["speedup_vs_ar"] == pytest.approx(sps["tokens_per_s"] / ar_tps)

    hf = {(h["run"], h["n"]): h for h in result["transformers"]}
    assert set(hf) == {("generate", 0), ("assisted", 2)}
    for h in hf.values():
        assert h["tokens"] == 2 * 12 and h["tokens_per_s"] > 0
    assert sps["speedup_vs_hf_assisted"] == pytest.approx(
        sps["tokens_per_s"] / hf[("assisted", 2)]["tokens_per_s"]
    )
    assert result["asps_gain"] == []  # no ASpS run
    assert result["config"]["prompts"] and len(result["config"]["prompts"][0]) == 6


def test_atn_and_ratio_se_match_hand_computation():
    # Steps emitting 1, 1, 3 tokens in row 0 and 2 in row 1: mean 7/4, sample variance 11/12.
    hist = np.array([[0, 2, 0, 1], [0, 0, 1, 0]])
    mean, se, steps = benchmark.atn(hist)
    assert (mean, steps) == (1.75, 4)
    assert se == pytest.approx(math.sqrt(11 / 12 / 4))
    r, r_se = benchmark.ratio_se(2.0, 0.2, 1.0, 0.05)
    assert r == 2.0 and r_se == pytest.approx(2.0 * math.sqrt(0.1**2 + 0.05**2))


def test_asps_gain_pairs_asps_with_sps_at_the_same_n():
    def row(method, n, tps, se, k=1):
        return dict(method=method, n=n, K=k, tokens_per_step=tps, tokens_per_step_se=se)

    rows = [row("ar", 0, 1.0, 0.0), row("sps", 2, 2.0, 0.1), row("asps", 2, 2.5, 0.1)]
    rows += [row("asps", 4, 3.0, 0.2), row("specinfer", 2, 2.4, 0.1, k=2)]
    (gain,) = benchmark.asps_gain(rows)  # n = 4 has no SpS partner
    assert (gain["n"], gain["sps"], gain["asps"], gain["gain"]) == (2, 2.0, 2.5, 1.25)
    assert gain["gain_se"] == pytest.approx(1.25 * math.hypot(0.1 / 2.5, 0.1 / 2.0))
    table = benchmark.markdown([], [], [gain])
    assert "| 2 | 2.000 | 2.500 | 1.250 ± 0.080 |" in table


def test_separation_says_which_runs_the_quick_subset_tells_apart():
    """Issue 65: --quick gave three methods the same tokens per step with nothing said."""

    def row(method, n, tps, se, k=1):
        return dict(method=method, n=n, K=k, tokens_per_step=tps, tokens_per_step_se=se)

    rows = [row("ar", 1, 1.0, 0.0), row("sps", 4, 3.0, 0.05), row("asps", 4, 3.3, 0.05)]
    rows += [row("specinfer", 4, 3.35, 0.05, k=2)]
    assert benchmark.separation(rows) == [
        "- specinfer (K=2) vs asps (K=1), n=4: +0.050 ± 0.071 tokens per step: NOT separated "
        "at this size",
        "- asps (K=1) vs sps (K=1), n=4: +0.300 ± 0.071 tokens per step: separated",
    ]
    assert benchmark.QUICK["no_hf"] and benchmark.QUICK["batch_size"] >= 32


def test_plan_runs_each_method_at_its_draft_counts():
    runs = benchmark.plan(["sps", "specinfer", "ar"], [1, 4], [1, 2, 4])
    assert runs == [
        ("ar", 1, 1, ()),
        ("sps", 1, 1, ()),
        ("sps", 4, 1, ()),
        ("specinfer", 1, 2, ()),
        ("specinfer", 4, 2, ()),
        ("specinfer", 1, 4, ()),
        ("specinfer", 4, 4, ()),
    ]
    # Branching trees: each tree method on each tree, K = the leaves and n = the depth.
    runs = benchmark.plan(["tv", "asps"], [4], [2], [(4, 2, 1, 1), (2, 2)])
    assert runs == [
        ("ar", 1, 1, ()),
        ("tv", 4, 2, ()),
        ("asps", 4, 1, ()),
        ("tv", 4, 8, (4, 2, 1, 1)),
        ("tv", 2, 4, (2, 2)),
    ]


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--n", "0"], "--n"),
        (["--k", "2", "-1"], "--k"),
        (["--batch-size", "0"], "--batch-size"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--temperature", "-1"], "--temperature"),
        (["--draft-temperature", "-0.5"], "--draft-temperature"),
        (["--draft-temperature", "inf"], "--draft-temperature"),
        (["--top-k", "-2"], "--top-k"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--repeats", "-1"], "--repeats"),
        (["--trees", "2,0"], "--trees"),
        (["--trees", "4,a"], "--trees"),
    ],
)
def test_bad_flags_name_the_flag(argv, flag, capsys):
    args = benchmark.build_parser().parse_args(argv)
    with pytest.raises(ValueError, match=flag):
        benchmark.check_args(args)
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(argv)  # fails before any model is loaded
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_draft_temperature_reaches_the_sampler(monkeypatch):
    """--draft-temperature is passed to ``sampler.prepare`` (None when absent: the target's)."""
    seen = []

    class Stop(Exception):
        pass

    def prepare(*args, **kwargs):
        seen.append(kwargs["draft_temperature"])
        raise Stop

    monkeypatch.setattr(benchmark.sampler, "prepare", prepare)
    for argv, expected in (([], None), (["--draft-temperature", "1.4"], 1.4)):
        args = benchmark.build_parser().parse_args(argv)
        with pytest.raises(Stop):
            benchmark.run_ours(None, None, [[1, 2]], "is", 2, 2, args)
        assert seen[-1] == expected


def test_help_documents_every_flag():
    parser = benchmark.build_parser()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} has no help text"
    text = parser.format_help()
    for flag in ("--n", "--k", "--methods", "--quick", "--json", "--batch-size", "--seed"):
        assert flag in text


BENCH_SCRIPTS = (
    "benchmark", "bench_cost_ratio", "bench_device", "bench_drafters", "bench_longtail",
    "bench_model", "bench_quant", "bench_self_draft", "bench_tunix", "bench_verify", "bench_vocab",
    "bench_block",
)  # fmt: skip


class _Parsed(Exception):
    """Raised in place of ``ArgumentParser.parse_args``, carrying the parser it was called on."""

    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def _script_parser(name: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser of ``benchmarks/<name>.py``'s ``main``, caught at its ``parse_args``: importing
    the script defines things only, and ``main`` stops before it runs anything."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # undone after the test, the scripts' too
    spec = importlib.util.spec_from_file_location(f"help_{name}", SCRIPT.with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)

    def parse_args(self, *args, **kwargs):
        raise _Parsed(self)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
        with pytest.raises(_Parsed) as caught:
            module.main([])
    return caught.value.parser


def test_every_benchmark_script_has_quick_and_sentence_helps(monkeypatch):
    """Every benchmark script takes --quick, and its --help is made of sentences: a description
    that ends with a period, and for every option (positionals too) a help that starts with a
    capital letter and ends with a period. No benchmark runs: each script's ``main`` is stopped
    at ``parse_args``."""
    siblings = set(BENCH_SCRIPTS) - set(sys.modules)  # imported by name by the scripts
    problems = []
    try:
        for name in BENCH_SCRIPTS:
            parser = _script_parser(name, monkeypatch)
            parser.format_help()  # a stray % in a help would raise here
            flags = {s for action in parser._actions for s in action.option_strings}
            if "--quick" not in flags:
                problems.append(f"{name}: no --quick")
            if not (parser.description or "").strip().endswith("."):
                problems.append(f"{name}: the description does not end with a period")
            for action in parser._actions:
                if isinstance(action, argparse._HelpAction):
                    continue
                flag = "/".join(action.option_strings) or action.dest
                text = (action.help or "").strip()
                if not text:
                    problems.append(f"{name} {flag}: no help")
                elif not (text[0].isupper() and text.endswith(".")):
                    problems.append(f"{name} {flag}: not a sentence: {text!r}")
    finally:
        for sibling in siblings:
            sys.modules.pop(sibling, None)
    assert not problems, "\n".join(problems)


def test_quick_fills_only_flags_left_at_their_defaults(monkeypatch):
    seen = {}

    def stop(name, **kwargs):  # stop before loading a model; keep the parsed arguments
        raise RuntimeError(name)

    monkeypatch.setattr(benchmark.asps_jax, "load_model", stop)
    monkeypatch.setattr(benchmark, "check_args", lambda args: seen.update(vars(args)))
    with pytest.raises(RuntimeError):
        benchmark.main(["--quick", "--n", "3", "--target", "T"])
    assert seen["n"] == [3] and seen["methods"] == benchmark.QUICK["methods"]
    assert seen["batch_size"] == benchmark.QUICK["batch_size"]


def test_unknown_method_is_rejected(capsys):
    with pytest.raises(SystemExit):
        benchmark.main(["--methods", "beam"])
    assert "--methods" in capsys.readouterr().err


def test_prompts_file_plain_lines_and_jsonl(tmp_path):
    plain = tmp_path / "prompts.txt"
    plain.write_text("first prompt\n\n  second one\n", encoding="utf-8")
    assert benchmark.read_prompts(str(plain)) == ["first prompt", "  second one"]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "a\\nb", "id": 1}\n{"prompt": "c"}\n', encoding="utf-8")
    assert benchmark.read_prompts(str(jsonl)) == ["a\nb", "c"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.jsonl:2 has no string 'prompt' field"):
        benchmark.read_prompts(str(bad))
    with pytest.raises(ValueError, match="cannot read"):
        benchmark.read_prompts(str(tmp_path / "missing.txt"))
    # Row b takes prompt b % count, keeping its last tokens (bytes modulo V without a tokenizer).
    rows = benchmark.encode_prompts(["abc", "xy"], None, 64, 3, 2)
    assert rows == [[ord("b") % 64, ord("c") % 64], [ord("x") % 64, ord("y") % 64]] + [
        [ord("b") % 64, ord("c") % 64]
    ]


@pytest.mark.slow
def test_prompts_file_drives_a_run(tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello there"}\n{"prompt": "abc"}\n', encoding="utf-8")
    out_json = tmp_path / "bench.json"
    argv = ["--target", target, "--draft", draft, "--methods", "ar", "--no-hf", "--quiet"]
    argv += ["--batch-size", "2", "--max-new-tokens", "4", "--prompt-tokens", "6"]
    argv += ["--repeats", "1", "--prompts", str(prompts), "--json", str(out_json)]
    assert benchmark.main(argv) == 0
    captured = capsys.readouterr()
    assert "# ar" not in captured.err  # --quiet
    result = json.loads(out_json.read_text())
    expected = [[b % 64 for b in text.encode()][-6:] for text in ("Hello there", "abc")]
    assert result["config"]["prompts"] == expected
    assert result["ours"][0]["tokens"] == 2 * 4


@pytest.mark.parametrize("task", ["wmt16", "cnndm", "dolly"])
def test_task_without_datasets_is_a_one_line_error(task, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # import fails
    monkeypatch.setattr(benchmark.asps_jax, "load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(["--task", task])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--task {task} needs the datasets package" in err and "--prompts FILE" in err


def test_task_templates_follow_the_papers():
    wmt = benchmark.TASKS["wmt16"][1]({"translation": {"en": "Hello.", "ro": "Salut."}})
    assert wmt == "Translate from English to Romanian: Hello."
    assert benchmark.TASKS["cnndm"][1]({"article": "News."}) == "News.\nTL;DR:\n"
    dolly = benchmark.TASKS["dolly"][1]
    assert dolly({"instruction": "Why?", "context": ""}) == "Why?\n"
    assert dolly({"instruction": "Sum up.", "context": "Text."}) == "Sum up.\n\nText.\n"


@pytest.mark.slow
def test_cost_ratio_smoke_beside_transformers(tmp_path, capsys):
    """benchmarks/bench_cost_ratio.py --smoke: the pair is written once as HF checkpoints (a second
    call reuses them), and ours prints beside transformers generate and assisted generation at
    the same n, with tokens per step, CPU and wall time, and the race's fit beside the forward."""
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location(
        "bench_cost_ratio_script", SCRIPT.with_name("bench_cost_ratio.py")
    )
    cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cost)
    root, out_json = tmp_path / "checkpoints", tmp_path / "cost.json"
    argv = ["--smoke", "--methods", "sps", "--n", "2", "--max-new-tokens", "4", "--repeats", "1"]
    argv += ["--prompt-tokens", "4", "--checkpoints", str(root), "--json", str(out_json)]
    assert cost.main([*argv, "--drafters", "model", "quant:int8"]) == 0
    stdout = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    # The draft model's rows, then the target's own int8 copy drafting (no bound: c is the model's).
    assert [r["method"] for r in result["rows"]] == ["sps", "sps + quant:int8"]
    assert "step_bound" not in result["rows"][1] and "| sps + quant:int8 | 1 | 2 |" in stdout
    # k_n on the layout the loop scores chains on, and on the one-row layout, in the same run.
    config = result["config"]
    assert set(config["chain_cost"]) == set(config["chain_cost_one_row_layout"]) == {"2"}
    assert "one-row layout:" in stdout
    assert [(r["method"], r["n"]) for r in result["transformers"]] == [
        ("hf generate", 0),
        ("hf assisted", 2),
    ]
    for r in result["rows"] + result["transformers"]:
        assert r["tokens"] == 4  # EOS never stops a run
        assert 1.0 <= r["tokens_per_step"] <= r["n"] + 1
        assert r["cpu_s"] > 0 and r["wall_s"] > 0
        assert r["tokens_per_cpu_s"] == pytest.approx(r["tokens"] / r["cpu_s"])
        assert f"| {r['method']} | {r['K']} | {r['n']} |" in stdout
    hf_generate, assisted = result["transformers"]
    assert hf_generate["tokens_per_step"] == 1.0  # one target call per token
    sps = result["rows"][0]
    assert sps["vs_hf_assisted"] == pytest.approx(
        sps["tokens_per_cpu_s"] / assisted["tokens_per_cpu_s"]
    )
    assert set(result["config"]["fit_s"]) == {"is", "optimal"}
    assert "level-race fit per node" in stdout
    paths = [Path(p) for p in result["config"]["checkpoints"]]
    assert sorted(p.name for p in root.iterdir()) == sorted(p.name for p in paths)
    stamps = [(p / "model.safetensors").stat().st_mtime_ns for p in paths]
    args = (cost.SMOKE_TARGET, cost.SMOKE_DRAFT), 0.2, 0.07, 0, root
    assert list(cost.checkpoint_pair(*args)) == paths
    assert [(p / "model.safetensors").stat().st_mtime_ns for p in paths] == stamps


def test_cost_ratio_says_its_memory_need_where_less_is_free(monkeypatch, capsys):
    """Issue 65: the kernel killed it at 8.6 GB with nothing said; its --quick peaked at 10.9 GB
    at the 0.5B shape, and builds a smaller pair now (3.7 GB measured), which it says too."""
    spec = importlib.util.spec_from_file_location(
        "bench_cost_ratio_memory", SCRIPT.with_name("bench_cost_ratio.py")
    )
    cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cost)
    pages = {"SC_AVPHYS_PAGES": 2 * 2**30 // 4096, "SC_PAGE_SIZE": 4096}  # 2 GB free
    monkeypatch.setattr(cost.os, "sysconf", pages.__getitem__)
    cost.warn_memory("bench_cost_ratio")
    assert capsys.readouterr().err == (
        "bench_cost_ratio: needs about 12 GB of memory at the 0.5B shape and 2.0 GB is free; it "
        "may be killed (--smoke runs tiny shapes)\n"
    )
    cost.warn_memory("bench_cost_ratio", cost.QUICK_NEEDS_GB, "--quick's shape")
    assert capsys.readouterr().err.startswith(
        "bench_cost_ratio: needs about 4 GB of memory at --quick's shape and 2.0 GB is free"
    )
    pages["SC_AVPHYS_PAGES"] *= 8  # 16 GB free: nothing said
    cost.warn_memory("bench_cost_ratio")
    assert capsys.readouterr().err == ""


def test_cost_ratio_refuses_an_unknown_drafter(capsys):
    spec = importlib.util.spec_from_file_location(
        "bench_cost_ratio_script", SCRIPT.with_name("bench_cost_ratio.py")
    )
    cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cost)
    with pytest.raises(SystemExit) as exit_:
        cost.main(["--smoke", "--drafters", "model", "bogus"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--drafters: ['bogus'] name no drafter" in err


@pytest.mark.slow
def test_bench_model_smoke(tmp_path, capsys):
    """benchmarks/bench_model.py: ours beside transformers per workload (a Llama checkpoint)."""
    script = SCRIPT.with_name("bench_model.py")
    spec = importlib.util.spec_from_file_location("bench_model", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    argv = ["--smoke", "--prefix", "12", "--widths", "9,2", "--repeats", "1", "--ar-tokens", "4"]
    argv += ["--json", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    both = ["[out, in]", "[in, out]"]  # each forward workload on both run layouts
    assert [(r["workload"], r["layout"]) for r in rows] == [
        (name, layout) for name in ("prefill", "decode", "chain2", "chain9") for layout in both
    ] + [("ar_token", "auto")]
    assert all(r["ours_tok_s"] > 0 and r["torch_tok_s"] > 0 for r in rows)
    # k: each row's CPU time over the one-token forward's on [out, in] (row 2).
    for r in rows:
        assert r["k"] == pytest.approx(r["ours_ms"] / rows[2]["ours_ms"])
    assert "| chain9 | 9 | smoke | [in, out] |" in capsys.readouterr().out
    # The base install has no torch: our columns alone, the note said up front.
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
        assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert all(r["ours_tok_s"] > 0 and r["torch_tok_s"] is None for r in rows)
    captured = capsys.readouterr()
    assert "torch is not installed, so the transformers columns are skipped" in captured.err
    assert "| chain9 | 9 | smoke | [out, in] |" in captured.out and "| – | – |" in captured.out


@pytest.mark.slow
def test_without_torch_the_transformers_columns_are_skipped_up_front(
    tiny_pair, monkeypatch, capsys
):
    """The base install has no torch: the run says so before anything runs and prints our
    columns, instead of failing after them."""
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    assert benchmark.missing_hf() == "torch"
    target, draft = tiny_pair
    argv = ["--target", target, "--draft", draft, "--methods", "ar", "--n", "2", "--k", "2"]
    argv += ["--batch-size", "1", "--max-new-tokens", "4", "--prompt-tokens", "4", "--quiet"]
    assert benchmark.main(argv) == 0
    captured = capsys.readouterr()
    assert "torch is not installed, so the transformers columns are skipped" in captured.err
    assert (
        "| method | K | n | tokens/step" in captured.out and "| transformers |" not in captured.out
    )


def _run_script(
    name: str, *argv: str, path: Path | None = None, folder: str = "benchmarks"
) -> subprocess.CompletedProcess:
    """``<folder>/<name> *argv --repeats 1`` in a subprocess on the CPU at -O0 (the figures are
    not the point, the script's path through prepare / compile / run is); it must succeed.
    ``path``: a folder put first on the import path (modules that shadow installed ones)."""
    root = Path(__file__).resolve().parents[1]
    search = os.pathsep.join(str(p) for p in (path, root) if p is not None)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(), PYTHONPATH=search)
    run = subprocess.run(
        [sys.executable, str(root / folder / name), *argv, "--repeats", "1"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    return run


@pytest.mark.slow
def test_bench_device_smoke(tmp_path):
    """bench_device.py --smoke on the CPU: random tiny target and draft, AR and a tree method, ms
    per step beside the roofline measured in the same run; run through scripts/bench_device.py,
    the path the device instructions name (it runs benchmarks/bench_device.py)."""
    out = tmp_path / "device.json"
    argv = ("--smoke", "--methods", "ar,tv", "--json", str(out))
    run = _run_script("bench_device.py", *argv, folder="scripts")
    report = json.loads(out.read_text())
    assert report["meta"]["platform"] == "cpu" and report["meta"]["roofline_ms"] > 0
    assert [(r["batch"], r["method"]) for r in report["rows"]] == [(2, "ar"), (2, "tv")]
    for row in report["rows"]:
        assert row["ms_per_step"] > 0 and row["compile_s"] > 0 and row["tokens_per_step"] >= 1
    assert "| 2 | tv |" in run.stdout and "roofline" in run.stdout
    assert "batch 2: 2 loops compiled in" in run.stdout  # side by side, before the timed runs
    # Each row is printed as soon as it is measured, before the closing table repeats it.
    assert run.stdout.count("| 2 | tv |") == 2


def test_bench_device_refuses_an_unknown_method(capsys):
    spec = importlib.util.spec_from_file_location(
        "bench_device", SCRIPT.with_name("bench_device.py")
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--methods", "ar,beam"]) == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "unknown method(s) ['beam']" in out


@pytest.mark.slow
def test_bench_vocab_smoke(tmp_path):
    """benchmarks/bench_vocab.py --smoke: tiny random models over the first 300 cl100k ids, a plain
    step and one under a regex, the ratio printed against the plain step of the same run."""
    out = tmp_path / "vocab.json"
    argv = ["--smoke", "--vocabs", "300", "--methods", "asps", "--batches", "2"]
    run = _run_script("bench_vocab.py", *argv, "--features", "plain,regex", "--json", str(out))
    rows = json.loads(out.read_text())
    assert [(r["V"], r["feature"]) for r in rows] == [(300, "plain"), (300, "regex")]
    assert all(r["ms_per_step"] > 0 and r["first_call_s"] > 0 for r in rows)
    assert "| 300 | asps | 2 | plain |" in run.stdout and "| 1.00 |" in run.stdout
    # The base install has no tiktoken: the features that read text are skipped, said up front.
    blocked = tmp_path / "no_tiktoken"
    blocked.mkdir()
    (blocked / "tiktoken.py").write_text("raise ImportError('no tiktoken', name='tiktoken')\n")
    run = _run_script(
        "bench_vocab.py", *argv, "--features", "plain,regex", "--json", str(out), path=blocked
    )
    assert [r["feature"] for r in json.loads(out.read_text())] == ["plain"]
    assert "tiktoken is not installed, so stop, regex, schema are skipped" in run.stderr


@pytest.mark.slow
def test_bench_quant_smoke(tmp_path):
    """benchmarks/bench_quant.py --smoke: AR per weight format on a tiny shape (fewer bytes per
    token each step down), and the logit error of the bundled target against its float32 upcast."""
    out = tmp_path / "quant.json"
    run = _run_script("bench_quant.py", "--smoke", "--json", str(out))
    report = json.loads(out.read_text())
    speed = {r["format"]: r for r in report["speed"]}
    assert list(speed) == ["float32", "bfloat16", "int8", "int4:32"]
    mb = [r["mb_per_token"] for r in speed.values()]
    assert mb == sorted(mb, reverse=True) and len(set(mb)) == 4
    assert all(r["ms_per_token_wall"] > 0 and r["roofline_ms_wall"] > 0 for r in speed.values())
    error = {r["format"]: r for r in report["error"]}
    assert error["bfloat16"]["max_abs_logit"] > 0  # the same weights, bfloat16 activations
    assert 0 < error["int8"]["kl_mean"] < error["int4:16"]["kl_mean"] < 0.1
    assert "logit error on the bundled target" in run.stdout


def test_the_suite_map_lists_every_script_and_its_sections_exist():
    """benchmarks/README.md maps each script to its sections of docs/benchmarks.md: every script
    of the suite is in it, and every file and section it names exists (read, nothing run)."""
    import re

    suite = SCRIPT.parent
    readme = (suite / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([^`]+\.py)` \|[^|]*\| (.+) \|$", readme, re.M)
    named = {name for name, _ in rows}
    assert {p.name for p in suite.glob("*.py")} - {"harness.py"} <= named
    docs = (suite.parent / "docs/benchmarks.md").read_text(encoding="utf-8")
    headings = re.findall(r"^#+\s+(.*)$", docs, re.M)
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
    for name, cell in rows:
        assert (suite / name).is_file(), name
        anchors = re.findall(r"\(\.\./docs/benchmarks\.md#([\w-]+)\)", cell)
        assert anchors and set(anchors) <= slugs, (name, set(anchors) - slugs)


def test_harness_interleaves_side_by_side_and_stamps_every_json_row(tmp_path):
    """benchmarks/harness.py: side_by_side calls each candidate once per round, the order turned
    by one each round, warm-up rounds untimed; write_json records the machine in every row."""
    import harness

    calls = []
    candidates = {name: (lambda r, name=name: calls.append((name, r))) for name in "abc"}
    timed = harness.side_by_side(candidates, repeats=2, warmup=1)
    assert calls == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1),
                     ("c", 2), ("a", 2), ("b", 2)]  # fmt: skip
    assert [len(timed[n]["times"]) for n in "abc"] == [2, 2, 2] and timed["a"]["ratio"] == 1.0
    out = tmp_path / "rows.json"
    harness.write_json(str(out), {"config": {"n": 4}, "rows": [{"tokens": 3}, {"tokens": 5}]})
    written = json.loads(out.read_text())
    assert written["config"] == {"n": 4} and [r["tokens"] for r in written["rows"]] == [3, 5]
    for row in written["rows"]:
        assert row["machine"]["cpus"] == os.cpu_count() and len(row["machine"]["load"]) == 3
        assert row["machine"]["jax"] and row["machine"]["devices"]
