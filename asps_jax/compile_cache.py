"""A persistent JAX compilation cache, on by default for the command-line tools and for Python.

Compiling the decoding loop takes most of a short run; XLA can keep the compiled programs on disk
so that the next process with the same shapes loads them instead. Nothing happens at import (no
import-time side effects): the scripts call :func:`enable` first thing, and the library's entry
points (``sample``, ``stream``, ``Session``, ``prepare``) call :func:`enable_default` before they
build anything, which turns it on once per process unless the program chose a cache directory of
its own (``jax_compilation_cache_dir`` already set: it is kept, as the tests' temporary one is).

Where the cache lives, in order: the ``path`` argument, ``$ASPS_JAX_CACHE_DIR``,
``$XDG_CACHE_HOME/asps_jax/jax``, ``~/.cache/asps_jax/jax``. ``ASPS_JAX_NO_CACHE=1`` (or the
scripts' ``--no-compile-cache`` flag) turns it off.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import warnings
from pathlib import Path

ENV_DIR = "ASPS_JAX_CACHE_DIR"
ENV_OFF = "ASPS_JAX_NO_CACHE"
MAX_BYTES = 4 << 30  # past this size the least recently used programs are dropped


def default_dir() -> Path:
    """The cache directory used when ``enable`` is given no path."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "asps_jax" / "jax"


def disabled_by_env() -> bool:
    """True when ``$ASPS_JAX_NO_CACHE`` is set, other than to ``""``, ``0``, ``false``, ``no``."""
    return os.environ.get(ENV_OFF, "").strip().lower() not in ("", "0", "false", "no")


def _unusable(directory: Path) -> str | None:
    """Why ``directory`` cannot hold the cache (it cannot be created, or written), or None."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # Every compile writes an entry (and takes a lock file) here: a directory that takes no
        # file would have JAX warn at each one instead.
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        return f"{err.strerror or err}"
    return None


def enable(path: str | os.PathLike | None = None, notify=None) -> Path | None:
    """Turn on JAX's persistent compilation cache; returns its directory, or None when it is off.

    Off when ``$ASPS_JAX_NO_CACHE`` is set, or when the directory cannot be created or written (a
    read-only home, say: the run then compiles as usual rather than failing or warning at every
    compile); ``notify``, if given, is then called once with a one-line message saying so.
    Every program is cached, however small or quick to compile, because a CLI run is a handful of
    programs that all recur. Call it before anything is compiled: jax decides once per process,
    at the first compilation, whether the persistent cache is in use.
    """
    if disabled_by_env():
        return None
    directory = Path(path).expanduser() if path is not None else default_dir()
    problem = _unusable(directory)
    if problem is not None:
        if notify is not None:
            notify(
                f"the compilation cache directory {directory} cannot be used ({problem}); "
                f"compiling without it (set {ENV_DIR} to move it, {ENV_OFF}=1 to turn it off)"
            )
        return None
    import jax

    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if importlib.util.find_spec("filelock") is not None:
        # A bounded cache is an LRU one that holds a file lock around every read and write: two
        # runs sharing the directory never read an entry the other is still writing.
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
        global _bounded_dir
        _bounded_dir = directory
        repair(directory)
    return directory


_bounded_dir: Path | None = None  # the size-bounded cache :func:`enable` turned on
_CACHE, _ATIME = "-cache", "-atime"  # the suffixes of an entry's files in JAX's bounded cache


def repair(directory: str | os.PathLike) -> int | None:
    """Drop the orphan entries of a size-bounded cache: a program file (``KEY-cache``) without
    its access-time file (``KEY-atime``), which a write that failed half-way (a full disk) leaves.
    JAX's bounded cache reads every entry's access time before each write, so one orphan made
    every later write fail, with a warning per program, for good. An orphan may be truncated, so
    it is deleted rather than given a time (it is compiled again when next needed). Runs under
    the cache's own lock, without waiting for it; returns the number of entries dropped, None
    when the directory is gone or another process holds the lock (the next call tries again)."""
    try:
        import fcntl  # the lock JAX's filelock.FileLock takes on POSIX: flock of the same file
    except ImportError:  # pragma: no cover - not POSIX
        return None
    directory = Path(directory)
    if not directory.is_dir():  # (opening the lock file would create it)
        return None
    try:
        fd = os.open(directory / ".lockfile", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        names = set(os.listdir(directory))
        orphans = [
            n for n in names if n.endswith(_CACHE) and n[: -len(_CACHE)] + _ATIME not in names
        ]
        for name in orphans:
            (directory / name).unlink(missing_ok=True)
    except OSError:  # the lock is busy (another run writes), or the directory went away
        return None
    finally:
        os.close(fd)  # (releases the lock)
    return len(orphans)


_scanned: dict[Path, int] = {}  # the bounded cache's directory mtime at its last repair


def _repair_if_changed() -> None:
    """:func:`repair` the bounded cache :func:`enable` turned on if an entry was written (or
    dropped) there since the last look: a steady loop that compiles nothing scans nothing."""
    if _bounded_dir is None:
        return
    try:
        if os.stat(_bounded_dir).st_mtime_ns == _scanned.get(_bounded_dir):
            return
        if repair(_bounded_dir) is not None:
            _scanned[_bounded_dir] = os.stat(_bounded_dir).st_mtime_ns
    except OSError:
        return


_default_tried = False


def enable_default() -> Path | None:
    """The library's default: :func:`enable` with the default directory, once per process (the
    first call decides; later ones return None), unless ``$ASPS_JAX_NO_CACHE`` is set or the
    program already set ``jax_compilation_cache_dir`` (its own directory is left as it is). A
    directory that cannot be used is said once, as a ``RuntimeWarning``, and the run compiles as
    usual. Later calls (every entry point's) :func:`repair` the bounded cache :func:`enable` turned
    on, so that a write that failed (a full disk) stops no later one. Returns the directory it
    turned on, else None."""
    global _default_tried
    if _default_tried:
        _repair_if_changed()  # a write that failed since (a full disk) leaves no orphan
        return None
    _default_tried = True
    import jax

    if jax.config.jax_compilation_cache_dir:
        return None
    return enable(notify=lambda message: warnings.warn(message, RuntimeWarning, stacklevel=3))


def decline_default() -> None:
    """Make :func:`enable_default` do nothing in this process: for a program that decided about
    the cache itself (the command line's ``--no-compile-cache``, or its own :func:`enable`)."""
    global _default_tried
    _default_tried = True


# --------------------------------------------------------------------------------------------
# Counting compiles

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_counts = {"programs": 0, "cache_hits": 0}
_listening = False


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event == _BACKEND_COMPILE:
        _counts["programs"] += 1


def _on_event(event: str, **kwargs) -> None:
    if event == _CACHE_HIT:
        _counts["cache_hits"] += 1


def count_compiles() -> None:
    """Start counting XLA programs (idempotent): :func:`compiles` then reports them."""
    global _listening
    if not _listening:
        import jax

        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        jax.monitoring.register_event_listener(_on_event)
        _listening = True


def compiles() -> dict[str, int]:
    """``{"programs": n, "cache_hits": h}`` since :func:`count_compiles`: ``n`` XLA programs
    built for a new shape or static argument (a jit cache miss), ``h`` of them loaded from the
    persistent cache instead of compiled; ``n - h`` were compiled."""
    return dict(_counts)
