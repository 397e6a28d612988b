"""A fresh clone of the repository stands on its own: the scripts' --help runs from it, and it
carries its docs and corpus (cloned offline with ``git clone --depth 1 file://``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("scripts/train_tiny.py", "benchmarks/benchmark.py", "scripts/sample.py")


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    inside = subprocess.run(
        ["git", "rev-parse", "--is-inside-work-tree"], cwd=ROOT, capture_output=True, text=True
    )
    if inside.returncode != 0 or inside.stdout.strip() != "true":
        pytest.skip("the tests do not run from a git checkout")
    dest = tmp_path_factory.mktemp("clone") / "asps_jax"
    proc = subprocess.run(
        ["git", "clone", "--quiet", "--depth", "1", ROOT.as_uri(), str(dest)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return dest


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_help_runs_from_a_fresh_clone(clone, script):
    env = dict(os.environ, PYTHONPATH=str(clone), HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(clone / script), "--help"],
        cwd=clone,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout and "Traceback" not in proc.stderr


def test_the_clone_carries_its_docs_and_corpus(clone):
    docs = ("docs/algorithms.md", "docs/api.md", "docs/design.md", "docs/benchmarks.md")
    for name in (*docs, "data/tinyshakespeare.txt"):
        assert (clone / name).is_file(), name
    assert (clone / "data/tinyshakespeare.txt").stat().st_size > 1_000_000
