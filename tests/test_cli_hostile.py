"""scripts/sample.py against hostile input and faults (issue 15): --seed range, several
--prompt values, sizes refused before anything is built, --num-drafts with --method ar, NaN logits
(the text before the failure and a one-line error, exit 1) and Ctrl-C (exit 130, the text so far
and its statistics, no traceback)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest
from test_cli import ROOT, SCRIPT, cli

import asps_jax
from asps_jax.models import save_checkpoint
from asps_jax.sampler import Session

SHORT = ["--max-new-tokens", "6", "--num-draft-tokens", "2"]


def _one_line_error(capsys, argv, code=2):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("seed", [str(2**64), str(2**63), "-1"])
def test_seed_out_of_range_is_one_line(capsys, seed):
    assert "2**63" in _one_line_error(capsys, ["--seed", seed])


@pytest.mark.parametrize("flag", ["--temperature", "--draft-temperature"])
def test_temperature_beyond_float32_is_one_line(capsys, flag):
    assert "3.4e38" in _one_line_error(capsys, [flag, "1e308"])


def test_largest_seed_runs(capsys):
    assert cli.main(SHORT + ["--seed", str(2**63 - 1), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["batch_size"] == 1


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
def test_sizes_are_refused_before_anything_is_built(capsys, argv, needle):
    start = time.perf_counter()
    assert cli.main(argv) == 2
    assert time.perf_counter() - start < 30  # no 10^9-row list, no compile
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


@pytest.fixture(scope="module")
def nan_target(tmp_path_factory):
    """The bundled target with a NaN embedding for the 3rd token its greedy run emits (the
    logits turn NaN once that token is generated), and that greedy run."""
    model = asps_jax.load_model("tinyshakespeare-target")
    prompt = model.tokenizer.encode(cli.DEFAULT_PROMPT)
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


@pytest.mark.parametrize("method", ["ar", "asps"])
def test_nan_logits_print_the_text_before_and_exit_1(capsys, nan_target, method):
    path, before = nan_target
    argv = ["--target", str(path), "--method", method, "--temperature", "0"]
    argv += ["--max-new-tokens", "12", "--num-draft-tokens", "3", "--no-compile-cache"]
    assert cli.main(argv + ["--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["tokens"] == [before]
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "NaN" in err and f"new token {len(before)}" in err
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    text = asps_jax.load_model(str(path)).tokenizer.decode(before, skip_special_tokens=True)
    assert out.startswith(cli.DEFAULT_PROMPT + text) and "--- statistics ---" in out


def test_ctrl_c_while_streaming_prints_the_statistics(capsys, monkeypatch):
    steps = Session.steps

    def two_steps_then_ctrl_c(self):
        for i, new in enumerate(steps(self)):
            yield new
            if i == 1:
                raise KeyboardInterrupt

    monkeypatch.setattr(Session, "steps", two_steps_then_ctrl_c)
    assert cli.main(SHORT + ["--max-new-tokens", "40"]) == 130
    captured = capsys.readouterr()
    assert captured.out.startswith(cli.DEFAULT_PROMPT) and "--- statistics ---" in captured.out
    assert "target calls: 2" in captured.out
    err = captured.err.strip().splitlines()
    assert "interrupted after" in err[-1] and "Traceback" not in captured.err


def test_ctrl_c_while_compiling_is_one_line(capsys, monkeypatch):
    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Session, "compile", interrupted)
    assert cli.main(SHORT) == 130
    captured = capsys.readouterr()
    assert "--- statistics ---" not in captured.out
    assert captured.err.strip().splitlines()[-1].endswith("nothing was generated")


def test_sigint_while_streaming_exits_130_with_statistics():
    env = dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu", ASPS_JAX_NO_CACHE="1")
    argv = ["--method", "ar", "--max-new-tokens", "240", "--batch-size", "256", "--seed", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-u", str(SCRIPT), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        first = proc.stdout.read(len(cli.DEFAULT_PROMPT) + 1)  # the prompt, then a token
        assert first.startswith(cli.DEFAULT_PROMPT), first
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "--- statistics ---" in out
    assert "interrupted after" in err


def test_ctrl_c_right_after_a_step_keeps_that_step_for_result():
    """The step donates the old state: a SIGINT that lands after the step returned but before the
    session kept the new state used to leave result() only deleted buffers."""
    target = asps_jax.load_model("tinyshakespeare-target")
    session = Session(target, None, [[1, 2, 3]], key=jax.random.key(0), max_new_tokens=8,
                      method="ar")  # fmt: skip
    step = session._step

    def step_then_ctrl_c(**kwargs):
        state = step(**kwargs)
        os.kill(os.getpid(), signal.SIGINT)  # handled at the next bytecode, before the return
        return state

    session._step = step_then_ctrl_c
    with pytest.raises(KeyboardInterrupt):
        next(session.steps())
    out = session.result()
    assert int(out.lengths[0]) == 1 and int(out.tokens[0, 0]) >= 0
