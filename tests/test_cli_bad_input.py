"""scripts/sample.py against bad input and faults (issue 15): bad flags and bad runs (one
line, exit 2 or nonzero), --seed range, several --prompt values, sizes refused before anything is
built, --num-drafts with --method ar, NaN logits (the text before the failure and a one-line error,
exit 1). Ctrl-C: test_cli_signals.py."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from test_cli import _strict_json, cli

import asps_jax
from asps_jax.cli.args import DEFAULT_PROMPT
from asps_jax.models import save_checkpoint

SHORT = ["--max-new-tokens", "6", "--num-draft-tokens", "2"]


def _one_line_error(capsys, argv, code=2):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--method", "nope"], "invalid choice"),
        (["--num-draft-tokens", "-2"], "positive integer"),
        (["--top-p", "1.5"], "top-p"),
        (["--top-p", "0"], "top-p"),
        (["--temperature", "-1"], ">= 0"),
        (["--dtype", "f16"], "invalid choice"),
        (["--tree", "2,x"], "every width >= 1"),
        (["--tree", "2,0"], "every width >= 1"),
        (["--method", "tv", "--tree", "2,2", "--num-drafts", "3"], "drop --num-drafts 3"),
        (["--method", "asps", "--tree", "2,2"], "verifies draft chains (drop --tree)"),
        (["--method", "ar", "--tree", "2,2"], "uses no draft (drop --tree)"),
        (["--prompt", "ROMEO\udcff"], "argument --prompt: expected UTF-8 text, got byte 0xff"),
        (["--prompt", "ok", "--prompt", "\ud800"], "argument --prompt: expected UTF-8 text"),
        (["--stop", "a", "--stop", ""], "--stop '' is empty"),
        (["--stop", "x" * 65], "at most 64"),
        ([arg for i in range(17) for arg in ("--stop", str(i))], "at most 16"),
        (["--repetition-penalty", "0"], "a finite number > 0"),
        (["--repetition-penalty", "-1.5"], "a finite number > 0"),
        (["--presence-penalty", "nan"], "a finite number"),
        (["--frequency-penalty", "inf"], "a finite number"),
        (["--no-repeat-ngram-size", "-1"], "an integer >= 0"),
        (["--min-tokens", "-1"], "an integer >= 0"),
        (["--min-p", "1.5"], "in [0, 1]"),
        (["--typical-p", "0"], "a typical-p mass in (0, 1]"),
        (["--logit-bias", "5"], "ID=BIAS"),
        (["--logit-bias", "5=inf"], "ID=BIAS"),
        (["--logit-bias=-2=1"], "ID=BIAS"),
        (["--top-logprobs", "2"], "--top-logprobs needs --json"),
        (["--quantize", "int3"], "argument --quantize: weight-only quantization is 'int8'"),
        (["--draft-quantize", "int4:0"], "argument --draft-quantize: weight-only"),
    ],
)
def test_bad_flags_exit_with_one_line(capsys, argv, needle):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err
    if "--tree" in argv and "--num-drafts" not in argv:
        assert "--num-drafts" not in err  # the flag the user typed is the one blamed


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--target", "/nonexistent/checkpoint"], "/nonexistent/checkpoint"),
        (["--target", "no-such-alias"], "no-such-alias"),
        (["--method", "asps", "--num-drafts", "2"], "single draft chain"),
        (["--prompt", "x " * 3000], "context"),
        (["--logit-bias", "99999=1"], "logit_bias: token id 99999 lies outside"),
        (["--bad-words", " "], "bad_words: each must be a non-empty string"),
        (["--json", "--top-logprobs", "99999"], "top_logprobs must be at most"),
        (
            ["--quantize", "int4:128"],  # plain int4 picks 16 (issue 66): test_quant.py
            "--quantize int4:128: tinyshakespeare-target's w_gate has 192 inputs per output "
            "(192), which groups of 128 do not divide; give a group size that divides every "
            "matrix (here 'int4:16')",
        ),
        (["--draft", "lookup", "--draft-quantize", "int8"], "--draft-quantize quantizes a draft"),
        (["--draft", "quant:int2"], "draft='quant:int2': weight-only quantization"),
    ],
)
def test_bad_runs_exit_nonzero_with_one_line(capsys, argv, needle):
    assert cli.main(argv + ["--max-new-tokens", "4"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err


def test_missing_weights_are_a_summary_line_then_one_place_per_line(capsys, monkeypatch):
    """Issue 65: the places searched used to be one long line of inline bullets."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("ASPS_MODELS_DIR", raising=False)
    assert cli.main(["--target", "llama68m", "--max-new-tokens", "4"]) == 2
    first, *rest = capsys.readouterr().err.strip().splitlines()
    assert first == (
        "sample.py: error: no weights for 'llama68m' (JackFram/llama-68m); fetch them with: "
        "hf download JackFram/llama-68m"
    )
    assert rest[0] == "  Looked in:" and all(line.startswith("    - ") for line in rest[1:-1])
    assert any("Hugging Face cache" in line for line in rest) and "Traceback" not in "".join(rest)
    assert rest[-1].startswith("  Or put a checkpoint folder at $ASPS_MODELS_DIR/llama68m")


@pytest.mark.parametrize("seed", [str(2**64), str(2**63), "-1"])
def test_seed_out_of_range_is_one_line(capsys, seed):
    assert "2**63" in _one_line_error(capsys, ["--seed", seed])


@pytest.mark.parametrize("flag", ["--temperature", "--draft-temperature"])
def test_temperature_beyond_float32_is_one_line(capsys, flag):
    assert "3.4e38" in _one_line_error(capsys, [flag, "1e308"])


@pytest.mark.slow
def test_largest_seed_runs(capsys):
    assert cli.main(SHORT + ["--seed", str(2**63 - 1), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["batch_size"] == 1


@pytest.mark.slow
def test_several_prompts_set_the_batch(capsys):
    assert cli.main(SHORT + ["--prompt", "KING:", "--prompt", "JULIET:", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["batch_size"] == 2 and result["prompts"] == ["KING:", "JULIET:"]
    assert all(len(t) >= 1 for t in result["tokens"])


def test_batch_smaller_than_the_prompts_is_refused(capsys):
    err = _one_line_error(capsys, ["--prompt", "A", "--prompt", "B", "--batch-size", "1"])
    assert "--batch-size 1" in err and "2 prompts" in err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--num-draft-tokens", str(10**9)], "--num-draft-tokens"),
        (["--method", "specinfer", "--num-drafts", str(10**7)], "--num-drafts"),
        (["--batch-size", str(10**9)], "--batch-size"),
        (["--method", "ar", "--batch-size", str(10**9)], "--batch-size"),
        (["--method", "ar", "--num-drafts", "2"], "--num-drafts"),
        # Wide trees: their N x N masks used to be left out of the estimate (a 38-line
        # traceback after 70-90 s, 37 GiB); the tree itself used to be built before the check.
        (["--method", "tv_wr", "--tree", "100000"], "--tree"),
        (
            ["--method", "tv_wr", "--num-drafts", "100000", "--num-draft-tokens", "1"],
            "--num-drafts",
        ),
        (["--method", "tv", "--tree", "1000,1000,1000"], "--tree"),
    ],
)
def test_sizes_are_refused_before_anything_is_built(capsys, monkeypatch, argv, needle):
    # Refused from the shapes alone: no tree is built and nothing is compiled (a wall-clock bound
    # here would depend on the machine's load).
    def built(*args, **kwargs):
        raise AssertionError("built before the size check")

    for name in ("build_chain_tree", "chains_token_tree", "branching_token_tree", "chain_layout"):
        monkeypatch.setattr(asps_jax.trees, name, built)
    monkeypatch.setattr(asps_jax.sampler, "prepare", built)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


@pytest.fixture(scope="module")
def nan_target(tmp_path_factory):
    """The bundled target with a NaN embedding for the 3rd token its greedy run emits (the
    logits turn NaN once that token is generated), and that greedy run."""
    model = asps_jax.load_model("tinyshakespeare-target")
    prompt = model.tokenizer.encode(DEFAULT_PROMPT)
    out = asps_jax.sample(
        model,
        None,
        [prompt],
        key=jax.random.key(0),
        max_new_tokens=12,
        method="ar",
        temperature=0.0,
        eos_token_id=-1,
    )
    tokens = [int(t) for t in out.tokens[0]]
    j = next(i for i in range(2, 10) if tokens[i] not in prompt + tokens[:i])
    params = dict(model.params, embed=model.params["embed"].at[tokens[j]].set(jnp.nan))
    path = tmp_path_factory.mktemp("nan_cli") / "target"
    save_checkpoint(path, model.config, params, tokenizer=model.tokenizer)
    return path, tokens[: j + 1]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "asps"])
def test_nan_logits_print_the_text_before_and_exit_1(capsys, nan_target, method):
    path, before = nan_target
    argv = ["--target", str(path), "--method", method, "--temperature", "0"]
    argv += ["--max-new-tokens", "12", "--num-draft-tokens", "3", "--no-compile-cache"]
    assert cli.main(argv + ["--json"]) == 1
    captured = capsys.readouterr()
    assert _strict_json(captured.out)["tokens"] == [before]
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "NaN" in err and f"new token {len(before)}" in err
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    text = asps_jax.load_model(str(path)).tokenizer.decode(before, skip_special_tokens=True)
    assert out.startswith(DEFAULT_PROMPT + text) and "--- statistics ---" in out
