"""Multi-host sampling: 2 local CPU processes x 2 devices each give the tokens of one process.

The processes (``multihost_worker.py``) join through ``jax.distributed.initialize`` on a free
local port and sample on a ``data=2,model=2`` mesh whose data axis goes across them (gloo
collectives); meanwhile this process computes the reference on one device. Every process passes
the full list of prompts, so each row's key is ``fold_in(key, row)`` as in one process, and every
process gets all rows back. The checkpoints are tiny random Llamas written by transformers.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hf_checkpoints import write_tiny_llama
from subprocess_env import xla_flags
from test_cli import cli
from test_sharding import CASES, PROMPTS, single_device_runs

from asps_jax import sharding

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MESH = "data=2,model=2"
# The command line on the bundled pair; "ar" keeps the compile short (the flags and the printing
# are under test here, the speculative methods above).
CLI_ARGS = ["--method", "ar", "--max-new-tokens", "8", "--batch-size", "3", "--seed", "5"]
CLI_ARGS += ["--prompt", "ROMEO:", "--json", "--no-compile-cache"]
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(one-process tokens and CLI output, [report of process 0, report of process 1])."""
    root = tmp_path_factory.mktemp("ckpt")
    target_model = write_tiny_llama(root / "target", seed=0, initializer_range=0.4)
    write_tiny_llama(root / "draft", seed=1, initializer_range=0.4, noise_from=target_model)
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS=xla_flags())
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    port = str(_free_port())
    workers = [
        subprocess.Popen(
            [sys.executable, str(HERE / "multihost_worker.py"), str(root), port, str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    try:
        local = single_device_runs(root, CLI_ARGS)
        outputs, deadline = [], time.monotonic() + TIMEOUT_S
        for worker in workers:
            try:
                outputs.append(worker.communicate(timeout=max(1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for w in workers:
                    w.kill()
                tails = [w.communicate()[1][-1500:] for w in workers]
                pytest.fail(f"the 2 processes did not finish within {TIMEOUT_S} s: {tails}")
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
    reports = []
    for worker, (out, err) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, err[-3000:]
        line = [ln for ln in out.splitlines() if ln.startswith("REPORT ")][-1]
        reports.append(json.loads(line[len("REPORT ") :]))
    return local, reports


@pytest.mark.slow
def test_two_processes_join_one_mesh(runs):
    _, reports = runs
    for index, report in enumerate(reports):
        assert report["process"] == index and report["processes"] == 2
        assert report["devices"] == 4 and report["local_devices"] == 2
        # data=2 goes across the processes, model=2 within each.
        assert report["mesh_processes"] == [[0, 0], [1, 1]]


@pytest.mark.slow
@pytest.mark.parametrize("method", list(CASES))
def test_same_tokens_as_one_process(runs, method):
    local, reports = runs
    for report in reports:  # every process gets every row, on its own device
        assert report[method] == local[method]
        assert report[f"{method}/lengths"] == local[f"{method}/lengths"] == [6, 6, 6]
        assert report[f"{method}/local"] is True
    # Sampled, not degenerate: rows differ and use several token ids.
    assert len({tuple(r) for r in local[method]}) == len(PROMPTS)
    assert len({t for r in local[method] for t in r}) >= 4


@pytest.mark.slow
def test_processes_with_different_prompts_are_refused(runs):
    _, reports = runs
    for report in reports:
        assert "differ between processes" in report["mismatch"]
        assert "same full list of prompts" in report["mismatch"]


@pytest.mark.slow
def test_mesh_must_use_every_process(runs):
    _, reports = runs
    for report in reports:
        assert "must use all of them" in report["too_small"]


@pytest.mark.slow
def test_cli_prints_once_with_the_tokens_of_one_process(runs):
    local, reports = runs
    assert [r["cli_code"] for r in reports] == [0, 0]
    assert reports[1]["cli_stdout"] == ""
    cli = json.loads(reports[0]["cli_stdout"])
    assert cli["tokens"] == local["cli"]["tokens"] and cli["texts"] == local["cli"]["texts"]
    assert [len(r) for r in cli["tokens"]] == [8, 8, 8]


@pytest.mark.parametrize(
    "args, match",
    [
        (("127.0.0.1:1", None, 0), "both the number of processes"),
        ((None, 2, None), "both the number of processes"),
        (("127.0.0.1:1", 2, 2), r"process id must lie in \[0, 2\)"),
        (("127.0.0.1:1", 0, 0), r"process id must lie in \[0, 0\)"),
        (("localhost", 2, 0), "HOST:PORT"),
    ],
)
def test_bad_distributed_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        sharding.init_distributed(*args)


def test_cli_bad_distributed_flags_exit_with_one_line(capsys):
    assert cli.main(["--process-id", "1", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "number of processes" in err
