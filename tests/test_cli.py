"""scripts/sample.py via main([...]) on the bundled pair, once as a subprocess (its bad flags and
faults: test_cli_bad_input.py)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asps_jax.cli.args import DEFAULT_PROMPT, build_parser

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "sample.py"


def _load_cli():
    spec = importlib.util.spec_from_file_location("sample_cli", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cli = _load_cli()


@pytest.mark.slow
def test_default_run_streams_text_and_statistics(capsys):
    assert cli.main(["--max-new-tokens", "12", "--num-draft-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(DEFAULT_PROMPT)
    body = out.split("--- statistics ---")[0][len(DEFAULT_PROMPT) :]
    assert len(body.strip()) > 0
    for name in ("method", "tokens per step", "target calls", "tokens/s", "draft acceptance"):
        assert name in out


@pytest.mark.slow
def test_every_flag_in_one_json_run(capsys):
    code = cli.main(
        [
            "--target", "tinyshakespeare-target",
            "--draft", str(ROOT / "models" / "tinyshakespeare-draft"),
            "--prompt", "KING HENRY:", "--prompt", "JULIET:\nO Romeo",
            "--method", "specinfer", "--num-draft-tokens", "3", "--num-drafts", "2",
            "--temperature", "0.9", "--draft-temperature", "1.2", "--top-k", "50",
            "--top-p", "0.95", "--max-new-tokens", "10", "--batch-size", "3", "--seed", "5",
            "--dtype", "bf16", "--stop", "e", "--stop", "\n", "--stop", "e", "--json",
            "--min-p", "0.05", "--repetition-penalty", "1.3",
            "--presence-penalty", "0.4", "--frequency-penalty", "0.2",
            "--no-repeat-ngram-size", "3", "--logit-bias", "3=-inf", "--logit-bias", "14=1.5",
            "--top-logprobs", "2", "--bad-words", " the", "--bad-words", "And",
            "--min-tokens", "2",
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["method"] == "specinfer" and result["num_drafts"] == 2
    assert result["batch_size"] == 3 and len(result["texts"]) == 3
    assert result["prompts"] == ["KING HENRY:", "JULIET:\nO Romeo", "KING HENRY:"]
    assert all(1 <= len(t) <= 10 for t in result["tokens"])
    assert 1.0 <= result["tokens_per_step"] <= 4.0
    assert result["target_calls"] >= 3 and result["compile_seconds"] > 0
    # One finite, non-positive log-probability per emitted token.
    assert [len(lp) for lp in result["logprobs"]] == [len(t) for t in result["tokens"]]
    # --top-logprobs 2: two [id, log-probability] pairs per token, most likely first; the banned
    # token 3 never appears.
    assert [len(top) for top in result["top_logprobs"]] == [len(t) for t in result["tokens"]]
    for row in result["top_logprobs"]:
        for pairs in row:
            assert (
                len(pairs) == 2
                and pairs[0][1] >= pairs[1][1]
                and 3 not in (pairs[0][0], pairs[1][0])
            )
    assert all(3 not in t for t in result["tokens"])
    assert all(math.isfinite(x) and x <= 0.0 for lp in result["logprobs"] for x in lp)
    # --stop with --min-tokens 2: a row ends at the first token after the first whose text
    # completes "e" or a newline.
    from transformers import AutoTokenizer

    from asps_jax.controls.sampling import bad_word_ids

    tok = AutoTokenizer.from_pretrained(str(ROOT / "models" / "tinyshakespeare-target"))
    stopped = 0
    for tokens, text in zip(result["tokens"], result["texts"]):
        assert len(tokens) >= 2
        first = tok.decode(tokens[:1], skip_special_tokens=True)
        before = tok.decode(tokens[:-1], skip_special_tokens=True)[len(first) :]
        assert text == tok.decode(tokens, skip_special_tokens=True)
        assert "e" not in before and "\n" not in before
        # --bad-words: none of their token sequences occurs in the generated tokens
        for word in (" the", "And"):
            for seq in bad_word_ids(tok, word):
                runs = [tokens[i : i + len(seq)] for i in range(len(tokens) - len(seq) + 1)]
                assert seq not in runs, (word, seq)
        hit = "e" in text or "\n" in text
        assert hit or len(tokens) == 10
        stopped += hit
    assert stopped >= 1


@pytest.mark.slow
def test_greedy_ar_and_asps_print_the_same_text(capsys):
    args = ["--temperature", "0", "--max-new-tokens", "16", "--json"]
    assert cli.main(args + ["--method", "ar"]) == 0
    ar = json.loads(capsys.readouterr().out)
    assert cli.main(args + ["--method", "asps", "--num-draft-tokens", "4"]) == 0
    asps = json.loads(capsys.readouterr().out)
    assert ar["tokens"] == asps["tokens"]
    assert ar["logprobs"] == asps["logprobs"] == [[0.0] * len(ar["tokens"][0])]  # greedy law
    assert asps["target_calls"] <= ar["target_calls"]


def _strict_json(text: str):
    """json.loads refusing NaN / Infinity, which strict JSON parsers reject."""

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_json_is_strict_after_one_step(capsys):
    """One step: the standard error of tokens per step is undefined, null (it was Infinity)."""
    assert cli.main(["--max-new-tokens", "1", "--num-draft-tokens", "3", "--json"]) == 0
    result = _strict_json(capsys.readouterr().out)
    assert result["target_calls"] == 1 and result["new_tokens"] == 1
    assert result["tokens_per_step"] == 1.0 and result["tokens_per_step_stderr"] is None


# Runs the script as `python scripts/sample.py` would, then says on stderr whether torch (installed
# with the test extra: seconds to import) was imported at any point of the run.
_REPORT_TORCH = (
    "import atexit, runpy, sys; "
    "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules, file=sys.stderr)); "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


@pytest.mark.slow
def test_runs_as_a_subprocess_without_network_or_torch():
    """The whole command (start-up, both models and their tokenizers, the run) imports no torch:
    transformers' AutoTokenizer would (issue 65), so the tokenizer's own class is loaded."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", _REPORT_TORCH, str(SCRIPT), "--max-new-tokens", "8"]
        + ["--method", "sps"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--- statistics ---" in proc.stdout and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "torch imported: False", proc.stderr


def test_llama7b_without_weights_explains_where_it_looked(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("ASPS_MODELS_DIR", str(tmp_path / "models"))
    assert cli.main(["--target", "llama7b", "--draft", "llama68m"]) != 0
    err = capsys.readouterr().err
    assert "huggyllama/llama-7b" in err and "download" in err and str(tmp_path) in err


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for action in build_parser()._actions:
        for flag in action.option_strings:
            assert flag in out
        assert action.help


def test_usage_follows_the_sections_and_the_cache_help_names_its_folders():
    """Issue 65: the synopsis kept the order the flags were added in; the cache flag's help left
    out $XDG_CACHE_HOME."""
    from asps_jax.cli.args import GROUPS

    parser = build_parser()
    usage = " ".join(parser.format_usage().split())
    flags = [f for section in GROUPS.values() for f in section]
    at = [
        usage.index(f"[{flag} ") if f"[{flag} " in usage else usage.index(f"[{flag}]")
        for flag in flags
    ]
    assert at == sorted(at) and usage.index("[-h]") < at[0]
    (cache,) = [a for a in parser._actions if "--no-compile-cache" in a.option_strings]
    assert "$XDG_CACHE_HOME/asps_jax/jax" in cache.help and "$ASPS_JAX_CACHE_DIR" in cache.help


def test_top_logprobs_of_zero_probability_tokens_are_a_documented_finite_number():
    """Strict JSON has no -Infinity: a token outside the law's support (k above its size) is
    written as output.ZERO_PROBABILITY_LOGPROB (-9999.0), not null (issue 65)."""
    from types import SimpleNamespace

    import numpy as np

    from asps_jax.cli import output

    out = SimpleNamespace(
        tokens=np.array([[5, 6]]),
        lengths=np.array([2]),
        logprobs=np.array([[-0.5, -0.1]], np.float32),
        top_logprobs=(
            np.array([[[5, 1], [6, 2]]]),
            np.array([[[-0.5, -np.inf], [-0.1, -2.4]]], np.float32),
        ),
    )
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "xy")
    result = output.batch_json({}, out, ["p"], tokenizer)
    assert output.ZERO_PROBABILITY_LOGPROB == -9999.0
    assert result["top_logprobs"][0][0] == [[5, -0.5], [1, -9999.0]]
    assert json.loads(json.dumps(output.strict_json(result), allow_nan=False)) == result


def test_optimal_is_python_only(capsys):
    """ "optimal" (a reference construction, far slower per step) is not a --method choice."""
    parser = build_parser()
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--method", "optimal"])
    assert info.value.code == 2 and "invalid choice" in capsys.readouterr().err
    assert parser.parse_args(["--method", "is"]).method == "is"


def test_tree_methods_are_method_choices():
    parser = build_parser()
    for method in ("tv", "tv_wr", "is_bv"):
        assert parser.parse_args(["--method", method, "--num-drafts", "4"]).method == method


@pytest.mark.slow
def test_branching_tree_run(capsys):
    """--tree sets n and K: a depth-3 tree with 3 * 2 leaves, drawn without replacement for tv."""
    argv = ["--method", "tv", "--tree", "3,2,1", "--max-new-tokens", "12", "--json"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["num_draft_tokens"] == 3 and result["num_drafts"] == 6
    assert len(result["tokens"][0]) == 12 and 1.0 <= result["tokens_per_step"] <= 4.0


@pytest.mark.slow
def test_num_draft_tokens_auto_prints_and_reports_the_choice(capsys):
    """--num-draft-tokens auto with the cheapest real calibration (a lookup draft of chains of at
    most 1 token: an "ar" run and the lookup run at n = 1 are measured, and the run itself reuses
    the calibration's compiled step): the choice is printed on stderr, is the run's n in --json,
    and the calibration is there too."""
    prompt = "ROMEO: But soft, what light. ROMEO: But soft, what light. ROMEO: But soft"
    argv = ["--draft", "lookup", "--lookup-max", "1", "--num-draft-tokens", "auto"]
    assert cli.main(argv + ["--prompt", prompt, "--max-new-tokens", "4", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["num_draft_tokens"] == 1 and result["new_tokens"] == 4
    assert "[num_draft_tokens=auto chose n=1: " in captured.err
    calibration = result["calibration"]
    assert calibration["num_draft_tokens"] == 1 and calibration["cost_ratio"] >= 0
    assert len(calibration["tokens_per_step"]) == len(calibration["step_seconds"]) == 2
    assert all(s > 0 for s in calibration["step_seconds"])


@pytest.mark.slow
def test_help_lists_every_flag_under_its_section():
    """--help's sections (models, method and tree, drafting, ... devices and processes) come in
    order and together hold every flag; the untitled "options" block has --help alone."""
    from asps_jax.cli.args import GROUPS

    parser = build_parser()
    sections = {g.title: g._group_actions for g in parser._action_groups}
    flags = {a.option_strings[0] for a in parser._actions if a.dest != "help"}
    filed = {a.option_strings[0] for title in GROUPS for a in sections[title]}
    assert filed == flags
    assert [a.dest for a in sections["options"]] == ["help"]
    text = parser.format_help()
    at = [text.index(f"\n{title}:\n") for title in GROUPS]
    assert at == sorted(at)


def test_lookup_says_how_often_it_found_a_match_and_ar_shows_no_draft_statistics(
    capsys, monkeypatch
):
    """A prompt that repeats itself: greedy text loops and the lookup finds matches; the line
    counts the steps whose drafter proposed a token, against the target calls. ``ar`` has no
    draft, so no draft line. The compile line names the cache only when it is on."""
    prompt = "ROMEO: But soft, what light through yonder window breaks? ROMEO: But soft"
    common = ["--prompt", prompt, "--max-new-tokens", "40", "--temperature", "0"]
    assert cli.main([*common, "--draft", "lookup", "--method", "sps", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert 0 < stats["drafted_steps"] <= stats["target_calls"] and stats["acceptance"] > 0
    assert stats["tokens_per_step"] > 1.0  # the matches were accepted: fewer target calls
    assert cli.main([*common, "--draft", "lookup", "--method", "sps"]) == 0
    out = capsys.readouterr().out
    assert f"{stats['drafted_steps']} of {stats['target_calls']} (steps where the lookup" in out
    assert cli.main([*common, "--method", "ar"]) == 0
    captured = capsys.readouterr()
    out = captured.out.split("--- statistics ---")[1]
    assert "draft acceptance" not in out and "steps with a draft" not in out
    assert "draft tokens n / drafts K" not in out
    assert "[compiling ar for tinyshakespeare-target / -, or loading it from the cache" in (
        captured.err
    )
    monkeypatch.setenv("ASPS_JAX_NO_CACHE", "1")
    assert cli.main([*common, "--method", "ar"]) == 0
    err = capsys.readouterr().err
    assert "[compiling ar for tinyshakespeare-target / - ...]" in err and "cache ..." not in err


@pytest.mark.parametrize(
    "programs, hits, note",
    [
        (2, 2, "loaded the compiled programs from the cache in 1.5 s"),
        (2, 0, "compiled 2 programs in 1.5 s"),
        (3, 1, "compiled 2 programs in 1.5 s, 1 loaded from the cache"),
        (0, 0, "nothing to compile: the programs were already built in this process"),
    ],
)
def test_the_compile_note_says_what_the_cache_did(programs, hits, note, monkeypatch):
    from asps_jax import compile_cache
    from asps_jax.cli import output

    before = {"programs": 10, "cache_hits": 4}
    after = {"programs": 10 + programs, "cache_hits": 4 + hits}
    monkeypatch.setattr(compile_cache, "compiles", lambda: after)
    assert output.compiled_note(before, 1.5) == note


@pytest.mark.slow
def test_n_samples_per_row_are_the_librarys(capsys):
    """``--n 3``: each row gives 3 rows, row r * 3 + i its sample i, the tokens of
    ``asps_jax.sample(..., key=jax.random.key(seed), n=3)``; not with --prompts."""
    import jax

    import asps_jax

    texts = ["KING HENRY:", "JULIET:\nO Romeo"]
    argv = ["--prompt", texts[0], "--prompt", texts[1], "--n", "3", "--seed", "4"]
    assert cli.main([*argv, "--max-new-tokens", "6", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prompts"] == [texts[0]] * 3 + [texts[1]] * 3
    assert result["samples_per_row"] == 3 and result["batch_size"] == 6
    target = asps_jax.load_model("tinyshakespeare-target", dtype="float32")  # the CLI's f32
    draft = asps_jax.load_model("tinyshakespeare-draft", dtype="float32")
    encoded = [target.tokenizer.encode(t, verbose=False) for t in texts]
    out = asps_jax.sample(target, draft, encoded, key=jax.random.key(4), n=3, max_new_tokens=6)
    want = [out.tokens[b, : out.lengths[b]].tolist() for b in range(6)]
    assert result["tokens"] == want
    with pytest.raises(SystemExit) as info:
        cli.main(["--prompts", "p.jsonl", "--n", "2"])
    assert info.value.code == 2 and "--n: not with --prompts" in capsys.readouterr().err
