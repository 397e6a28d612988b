"""pyproject.toml declares what the code imports, and nothing that it does not: every runtime
dependency and every optional group (except the test tools) is imported somewhere in asps_jax/,
scripts/ or benchmarks/, and every third-party module they import is declared; the suite's XLA
flags are only those the installed jaxlib knows (jax is not pinned)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
# Statements only (a docstring line "from the ..." is not an import).
IMPORT = re.compile(
    r"^\s*(?:from\s+(\w+)[\w.]*\s+import\s|import\s+(\w+)[\w.]*\s*(?:$|,|as\s))", re.M
)


# Distributions whose import name is not their name with dashes as underscores.
IMPORT_NAMES = {"google_tunix": "tunix"}


def _name(requirement: str) -> str:
    """``"flax>=0.12"`` -> ``"flax"`` (the import name: dashes become underscores)."""
    name = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].replace("-", "_").lower()
    return IMPORT_NAMES.get(name, name)


def _scripts() -> list[Path]:
    """The programs outside the package: scripts/ and the benchmark suite."""
    return [*(ROOT / "scripts").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]


def _imported() -> set[str]:
    files = [*(ROOT / "asps_jax").rglob("*.py"), *_scripts()]
    found = (m for f in files for m in IMPORT.findall(f.read_text(encoding="utf-8")))
    return {(a or b).lower() for a, b in found}


def test_declared_dependencies_are_imported_and_imports_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    imported = _imported()
    extras = project["optional-dependencies"]
    used = {_name(r) for r in project["dependencies"]}
    for group, requirements in extras.items():
        if group != "test":  # test tools (pytest, ruff, ...) are imported by tests/ only
            used |= {_name(r) for r in requirements}
    assert "chex" not in used and "safetensors" not in used
    unused = sorted(used - imported)
    assert not unused, (
        f"declared but never imported by asps_jax/, scripts/ or benchmarks/: {unused}"
    )
    declared = used | {_name(r) for r in extras["test"]}
    scripts = {p.stem for p in _scripts()}  # one script imports another (or the harness)
    third_party = imported - set(sys.stdlib_module_names) - {"asps_jax", *scripts}
    undeclared = sorted(third_party - declared)
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


def test_the_suites_xla_flags_that_this_jaxlib_lacks_are_dropped(monkeypatch):
    """jax is not pinned, and XLA stops a process at start on a flag its jaxlib does not know: the
    suite's speed-only flags (tests/subprocess_env.py) keep only those the CPU backend starts with,
    each probed in a child process."""
    from subprocess_env import supported

    monkeypatch.setenv("ASPS_JAX_TEST_XLA_FLAGS", "{}")  # probe afresh; restored after the test
    known = "--xla_backend_optimization_level=0"
    assert supported(f"--xla_no_such_flag=1 {known}") == known
