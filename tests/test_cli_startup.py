"""scripts/sample.py as a user starts it: a quiet stderr, and a compilation cache that a second
process reuses (two subprocess runs on the bundled pair, sharing one temporary cache directory)."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import pytest

from asps_jax import compile_cache
from asps_jax.cli.args import build_parser

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "sample.py"
ARGS = ["--max-new-tokens", "4", "--num-draft-tokens", "3"]


def _load_cli():
    spec = importlib.util.spec_from_file_location("sample_cli_startup", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(env, *extra):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *ARGS, *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )


def _compile_seconds(stdout: str) -> float:
    match = re.search(r"load / compile / run s: [\d.]+ / ([\d.]+) / ", stdout)
    assert match, stdout
    return float(match.group(1))


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("startup")
    # Hide torch from this process tree, as on a machine without it: transformers then announces
    # "PyTorch was not found" at import, which the command must not show.
    (tmp / "site").mkdir()
    (tmp / "site" / "sitecustomize.py").write_text('import sys\nsys.modules["torch"] = None\n')
    cache = tmp / "cache"
    env = {k: v for k, v in os.environ.items() if k != compile_cache.ENV_OFF}
    env.update(
        HF_HUB_OFFLINE="1",
        JAX_PLATFORMS="cpu",
        ASPS_JAX_CACHE_DIR=str(cache),
        PYTHONPATH=os.pathsep.join([str(tmp / "site"), str(ROOT)]),
    )
    first = _run(env)
    # Compiled programs (the cache also holds a lock file and access times).
    files_after_first = sorted(p.name for p in cache.glob("*-cache"))
    second = _run(env)
    return first, second, files_after_first


@pytest.mark.slow
def test_main_command_prints_no_warnings(two_runs):
    for proc in two_runs[:2]:
        assert proc.returncode == 0, proc.stderr
        noisy = [line for line in proc.stderr.splitlines() if "warning" in line.lower()]
        assert noisy == [], proc.stderr
        assert "PyTorch" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_second_process_reuses_the_compilation_cache(two_runs):
    first, second, files_after_first = two_runs
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert len(files_after_first) > 0
    assert _compile_seconds(second.stdout) < _compile_seconds(first.stdout)
    # Same key, same shapes: the cached programs give the same text.
    assert first.stdout.split("--- statistics ---")[0] == second.stdout.split("---")[0]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.usefixtures("isolated_logging")
def test_notice_filters_drop_only_those_notices():
    # The two loggers alone, each with this test's handler only: what other tests, transformers
    # (its own handler, no propagation) or pytest attached to them or above them plays no part.
    cli = _load_cli()
    records = _Records()
    for name in cli._NOTICES:
        logger = logging.getLogger(name)
        logger.handlers[:], logger.filters[:] = [records], []
        logger.propagate, logger.disabled = False, False
        logger.setLevel(logging.INFO)
    cli.silence_notices()
    cli.silence_notices()  # idempotent: one filter per logger
    filters = logging.getLogger("transformers").filters
    assert sum(type(f).__name__ == "_DropNotices" for f in filters) == 1
    logging.getLogger("transformers").warning("PyTorch was not found. Models won't be ...")
    logging.getLogger("jax._src.xla_bridge").warning("An NVIDIA GPU may be present ...")
    logging.getLogger("transformers").error("a real problem")
    logging.getLogger("jax._src.xla_bridge").warning("CUDA backend failed to initialize: x")
    assert records.messages == ["a real problem", "CUDA backend failed to initialize: x"]


def test_logging_state_does_not_leak_between_tests():
    """After the test above (and cli.main in other files), its loggers are as they were."""
    for name in ("transformers", "jax._src.xla_bridge"):
        logger = logging.getLogger(name)
        assert not any(type(f).__name__ == "_DropNotices" for f in logger.filters), name
        assert not any(isinstance(h, _Records) for h in logger.handlers), name


@pytest.fixture
def restore_jax_cache_config():
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
        "jax_compilation_cache_max_size",
    )
    saved = {n: jax.config.values[n] for n in names}
    yield
    for name, value in saved.items():
        jax.config.update(name, value)


def test_cache_directory_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_dir() == tmp_path / "xdg" / "asps_jax" / "jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.default_dir() == tmp_path / "home" / ".cache" / "asps_jax" / "jax"
    monkeypatch.setenv(compile_cache.ENV_DIR, str(tmp_path / "moved"))
    assert compile_cache.default_dir() == tmp_path / "moved"


@pytest.mark.usefixtures("restore_jax_cache_config")
def test_enable_sets_the_cache_and_the_switches_turn_it_off(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV_OFF, raising=False)
    assert compile_cache.enable(tmp_path / "c") == tmp_path / "c"
    assert (tmp_path / "c").is_dir()
    assert jax.config.values["jax_compilation_cache_dir"] == str(tmp_path / "c")
    assert jax.config.values["jax_persistent_cache_min_compile_time_secs"] == 0.0
    for off in ("1", "yes", "true"):
        monkeypatch.setenv(compile_cache.ENV_OFF, off)
        assert compile_cache.enable(tmp_path / "d") is None
    assert not (tmp_path / "d").exists()
    monkeypatch.setenv(compile_cache.ENV_OFF, "0")
    assert compile_cache.enable(tmp_path / "e") == tmp_path / "e"
    (tmp_path / "file").write_text("")
    assert compile_cache.enable(tmp_path / "file" / "sub") is None  # cannot create: stays off


def test_cli_flag_turns_the_cache_off():
    assert build_parser().parse_args(["--no-compile-cache"]).no_compile_cache
    assert not build_parser().parse_args([]).no_compile_cache


def _refuse_files_in(monkeypatch, directory):
    """``directory`` takes no new file, as a read-only one (root writes to those regardless)."""
    mkstemp = tempfile.mkstemp

    def refuse(*args, dir=None, **kwargs):
        if dir is not None and Path(dir) == directory:
            raise PermissionError(13, "Permission denied")
        return mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", refuse)


def test_unwritable_cache_directory_is_one_notice(monkeypatch, tmp_path, restore_jax_cache_config):
    """A cache directory that takes no file (read-only) is left off with one notice; JAX used to
    warn at every compile (56 lines for the default command)."""
    monkeypatch.delenv(compile_cache.ENV_OFF, raising=False)
    before = jax.config.values["jax_compilation_cache_dir"]

    _refuse_files_in(monkeypatch, tmp_path / "ro")
    notices = []
    assert compile_cache.enable(tmp_path / "ro", notify=notices.append) is None
    assert len(notices) == 1 and str(tmp_path / "ro") in notices[0]
    assert "Permission denied" in notices[0] and compile_cache.ENV_DIR in notices[0]
    assert jax.config.values["jax_compilation_cache_dir"] == before
    assert compile_cache.enable(tmp_path / "ro") is None  # no notify: silent


def test_read_only_cache_directory_is_one_notice(monkeypatch, tmp_path, restore_jax_cache_config):
    """The same with a directory made read-only for real (where permissions bind: not as root)."""
    monkeypatch.delenv(compile_cache.ENV_OFF, raising=False)
    directory = tmp_path / "ro"
    directory.mkdir()
    directory.chmod(0o555)
    try:
        if os.access(directory, os.W_OK):
            pytest.skip("permissions do not bind for this user (root)")
        notices = []
        assert compile_cache.enable(directory, notify=notices.append) is None
        assert len(notices) == 1 and str(directory) in notices[0]
    finally:
        directory.chmod(0o755)


@pytest.mark.slow
def test_cli_with_an_unwritable_cache_prints_one_notice(
    capsys, monkeypatch, tmp_path, restore_jax_cache_config
):
    monkeypatch.delenv(compile_cache.ENV_OFF, raising=False)
    monkeypatch.setenv(compile_cache.ENV_DIR, str(tmp_path / "ro"))

    _refuse_files_in(monkeypatch, tmp_path / "ro")
    assert _load_cli().main([*ARGS, "--json"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sample.py: note: the compilation cache"), err
