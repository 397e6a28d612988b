"""The project as an installed library (issue 65): pyproject.toml names every package, the wheel
carries the bundled models (package data of ``asps_jax._models``) and the ``asps-jax`` command and
nothing else, and a fresh virtual environment with only that wheel installed runs
``python -m asps_jax --help`` and the main job from an empty directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _packages_on_disk() -> set[str]:
    return {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "asps_jax").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }


def test_pyproject_lists_every_package_and_maps_the_models_folder():
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert set(setuptools["packages"]) == _packages_on_disk() | {"asps_jax._models"}
    assert setuptools["package-dir"] == {"asps_jax._models": "models"}
    assert PYPROJECT["project"]["scripts"] == {"asps-jax": "asps_jax.cli.main:console"}


def test_version_and_the_bundled_models_folder_from_the_checkout():
    import asps_jax
    from asps_jax.models import cards

    assert isinstance(asps_jax.__version__, str) and asps_jax.__version__
    assert cards.MODELS_DIR.resolve() == (ROOT / "models").resolve()
    assert {"tinyshakespeare-target", "tinyshakespeare-draft"} <= set(cards.known_aliases())


def _source_copy(dest: Path) -> set[str]:
    """What the build reads (pyproject.toml, README.md, asps_jax/, models/) copied to ``dest``,
    without caches; returns the wheel paths expected of it. A training leftover is planted in a
    model folder: the wheel must not carry it."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    expected = set()
    for top, installed in (("asps_jax", "asps_jax"), ("models", "asps_jax/_models")):
        for path in sorted((ROOT / top).rglob("*")):
            rel = path.relative_to(ROOT / top)
            skip = "__pycache__" in rel.parts or path.name == "train_state.npz"
            if path.is_dir() or skip or (top == "asps_jax" and path.suffix != ".py"):
                continue
            (dest / top / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest / top / rel)
            expected.add(f"{installed}/{rel.as_posix()}")
    (dest / "models" / "tinyshakespeare-target" / "train_state.npz").write_bytes(b"not shipped")
    return expected


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, set[str]]:
    src = tmp_path_factory.mktemp("src")
    expected = _source_copy(src)
    dist = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["-q", "-w", str(dist), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (path,) = dist.glob("asps_jax-*.whl")
    return path, expected


@pytest.mark.slow
def test_the_wheel_carries_the_package_the_models_and_the_command_only(wheel):
    path, expected = wheel
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        info = [n for n in names if ".dist-info/" in n]
        entry_points = next(n for n in info if n.endswith("entry_points.txt"))
        assert "asps-jax = asps_jax.cli.main:console" in z.read(entry_points).decode()
    assert set(names) - set(info) == expected
    for name in ("config.json", "model.safetensors", "tokenizer.json", "card.json"):
        assert f"asps_jax/_models/tinyshakespeare-target/{name}" in names
    assert "asps_jax/_models/tinyshakespeare-eagle3/model.safetensors" in names


@pytest.mark.slow
def test_a_fresh_venv_with_the_wheel_runs_the_command_from_an_empty_directory(
    wheel, tmp_path_factory
):
    """``--system-site-packages`` lends the dependencies (offline, fast); ``-I``, no PYTHONPATH and
    an empty working directory keep the checkout (and its editable install) out: the package
    imported is the venv's."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
        check=True,
        timeout=120,
    )
    python = venv / "bin" / "python"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
        + ["--no-index", "--force-reinstall", str(wheel[0])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    empty = tmp_path_factory.mktemp("empty")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PYTHONNOUSERSITE="1", HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")

    def run(*argv):
        return subprocess.run(argv, cwd=empty, env=env, capture_output=True, text=True, timeout=300)

    code = "import sys, asps_jax as a; print(a.__file__, a.__version__, 'torch' in sys.modules)"
    where = run(str(python), "-I", "-c", code)
    assert where.returncode == 0, where.stderr
    path, version, torch = where.stdout.split()
    assert Path(path).is_relative_to(venv) and ROOT not in Path(path).parents, where.stdout
    assert version == PYPROJECT["project"]["version"] and torch == "False"  # no torch at import
    helped = run(str(python), "-I", "-m", "asps_jax", "--help")
    assert helped.returncode == 0 and "usage:" in helped.stdout, helped.stderr
    ran = run(str(venv / "bin" / "asps-jax"), "sample", "--max-new-tokens", "8", "--json")
    assert ran.returncode == 0, ran.stderr
    out = json.loads(ran.stdout)
    assert out["new_tokens"] == 8 and out["draft"] == "tinyshakespeare-draft", out
    assert list(empty.iterdir()) == []
