"""The persistent compilation cache is on by default from Python (``sample``, ``stream``,
``Session``, ``prepare``), in the command line's directory and with its opt-out, and a program's
own choice of directory is kept (as the test run's is)."""

from __future__ import annotations

import jax
import pytest
from hf_checkpoints import load_tiny_pair

from asps_jax import compile_cache, sampler


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_tiny_pair(tmp_path_factory.mktemp("cache_default"))


@pytest.fixture
def fresh_process(monkeypatch, tmp_path):
    """As in a new Python process with no cache directory chosen (conftest restores JAX's
    configuration after the test; the run's own cache, initialised already, keeps serving)."""
    monkeypatch.setattr(compile_cache, "_default_tried", False)
    monkeypatch.setattr(compile_cache, "_bounded_dir", None)
    monkeypatch.setattr(compile_cache, "_scanned", {})
    monkeypatch.setenv(compile_cache.ENV_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv(compile_cache.ENV_OFF, raising=False)
    jax.config.update("jax_compilation_cache_dir", None)
    return tmp_path / "cache"


def _prepare(pair):
    target, draft = pair
    return sampler.prepare(target, draft, [[1, 2]], key=jax.random.key(0), max_new_tokens=2)


@pytest.mark.slow
def test_prepare_turns_the_default_cache_on(pair, fresh_process):
    _prepare(pair)
    assert jax.config.jax_compilation_cache_dir == str(fresh_process)
    assert fresh_process.is_dir()


def test_the_opt_out_keeps_it_off(pair, fresh_process, monkeypatch):
    monkeypatch.setenv(compile_cache.ENV_OFF, "1")
    _prepare(pair)
    assert not jax.config.jax_compilation_cache_dir


def test_a_directory_the_program_chose_is_kept(pair, fresh_process, tmp_path):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    _prepare(pair)
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")


def test_the_command_line_decides_once(pair, fresh_process):
    """``--no-compile-cache``: the CLI declines the default, so the library leaves it off."""
    compile_cache.decline_default()
    _prepare(pair)
    assert not jax.config.jax_compilation_cache_dir


def test_an_unusable_directory_is_one_warning(pair, fresh_process, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(compile_cache.ENV_DIR, str(blocker / "cache"))
    with pytest.warns(RuntimeWarning, match="cannot be used") as caught:
        _prepare(pair)
        _prepare(pair)
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert not jax.config.jax_compilation_cache_dir


def _entries(directory) -> set[str]:
    return {p.name for p in directory.iterdir() if not p.name.startswith(".")}


def test_an_orphan_entry_is_dropped_so_later_writes_work(tmp_path, monkeypatch):
    """A write a full disk cut leaves a program file without its access time; JAX's bounded
    cache then failed every later write (two warning lines per program) for good."""
    from jax._src.lru_cache import LRUCache

    monkeypatch.setattr(compile_cache, "_bounded_dir", None)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "kept-cache").write_bytes(b"program")
    (cache / "kept-atime").write_bytes((1).to_bytes(8, "little"))
    (cache / "orphan-cache").write_bytes(b"half a progr")
    lru = LRUCache(str(cache), max_size=1 << 20)
    with pytest.raises(FileNotFoundError):
        lru.put("new", b"program")  # what JAX does with the orphan there
    assert compile_cache.enable(cache) == cache  # repairs it (conftest restores JAX's config)
    lru.put("new", b"program")
    assert _entries(cache) == {"kept-cache", "kept-atime", "new-cache", "new-atime"}


def test_an_orphan_made_during_the_run_is_dropped_at_the_next_call(pair, fresh_process):
    _prepare(pair)
    (fresh_process / "orphan-cache").write_bytes(b"half")
    _prepare(pair)
    assert "orphan-cache" not in _entries(fresh_process)


def test_the_repair_waits_for_no_lock_jax_holds(tmp_path):
    """Under JAX's lock (another run writing) the orphan is left for the next look."""
    filelock = pytest.importorskip("filelock")
    (tmp_path / "orphan-cache").write_bytes(b"half")
    with filelock.FileLock(tmp_path / ".lockfile"):
        assert compile_cache.repair(tmp_path) is None
    assert "orphan-cache" in _entries(tmp_path)
    assert compile_cache.repair(tmp_path) == 1 and not _entries(tmp_path)
