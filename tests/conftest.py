"""Test-wide JAX settings: loud rank promotion, CPU only (tests never need an accelerator), XLA at
-O0 but for tests marked ``optimized`` (fusions by XLA:CPU's elemental emitter at every level), one
on-disk compilation cache per test run, and a bounded number of compiled programs held at once;
and the longest modules handed to xdist's workers first.

Each test and each module leaves the process as it found it (``_process_state_restored``,
``_module_state_restored``): JAX's configuration, the environment, the SIGINT / SIGTERM handlers,
the main thread's blocked signals and the filters on every logger are restored after it, so that
no test passes or fails by what ran before it in the same worker (``scripts/sample.py``'s
``main``, run in-process by the CLI tests and by one module-scoped fixture, turns the compilation
cache on for every program and filters two loggers). ``isolated_logging`` restores the loggers'
handlers, levels and propagation as well, for tests that change those.
"""

import gc
import logging
import os
import shutil
import signal
import tempfile

from subprocess_env import FAST_CODEGEN, supported

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Most tests compile far more than they run: XLA:CPU compiles them at -O0 (LLVM's optimisation
# off), in this process and in every command-line run it starts. Tests marked ``optimized`` (the
# law runs of thousands of rows, whose run at -O0 outweighs their compile) get the level below;
# see ``pytest_runtest_setup``. The HLO, what each program computes, is the same; a float may
# differ in its last bit (FMA contraction).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# The ``optimized`` level: XLA:CPU's level 1 with LLVM's expensive passes off. Measured on a
# 20,006-row law run (specinfer, 2 new tokens, one process): it compiles in the time -O0 takes
# (10.5 s each) and runs as fast as the default level (3.5 s against 13.4 s at -O0 and 4.1 s at the
# default, whose compile is 13.1 s). Flags already in XLA_FLAGS come after these and win; xdist's
# workers inherit them from the controller.
OPTIMIZED_FLAGS = supported(
    "--xla_backend_optimization_level=1 --xla_llvm_disable_expensive_passes=true"
)
# At every level, and in every subprocess (tests/subprocess_env.py), XLA:CPU emits its fusions with
# the elemental emitter instead of the MLIR fusion emitters, in one LLVM module: see FAST_CODEGEN.
# Only flags this jaxlib knows (``supported``): an unknown one would stop every process at start.
_TEST_FLAGS = f"{OPTIMIZED_FLAGS} {FAST_CODEGEN}".strip()
if _TEST_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{_TEST_FLAGS} {os.environ.get('XLA_FLAGS', '')}".strip()

# One on-disk compilation cache per test run, never the user's. The process that imports this
# first (xdist's controller) makes it; the workers it starts and the CLI subprocesses they run
# inherit it through the environment (scripts' main() turns the cache on, in $ASPS_JAX_CACHE_DIR).
# A compiled decoding loop takes seconds, and the same one recurs across test files, workers and
# processes; the cache hands back the executable XLA compiled, so no test is weakened. Tests of
# the cache itself pass their own directory; ASPS_JAX_NO_CACHE=1 turns it off.
# A directory given in $ASPS_JAX_TEST_RUN_CACHE is used and kept (several runs can share one).
_RUN_CACHE_ENV = "ASPS_JAX_TEST_RUN_CACHE"
_RUN_CACHE_MADE_HERE = _RUN_CACHE_ENV not in os.environ
if _RUN_CACHE_MADE_HERE:
    os.environ[_RUN_CACHE_ENV] = tempfile.mkdtemp(prefix="asps_jax_test_cache_")
RUN_CACHE_DIR = os.environ[_RUN_CACHE_ENV]
os.environ["ASPS_JAX_CACHE_DIR"] = RUN_CACHE_DIR

import jax  # noqa: E402
import pytest  # noqa: E402

from asps_jax import compile_cache  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
if compile_cache.enable(RUN_CACHE_DIR) is not None:
    # In-process, only programs that take a while to compile are worth the round trip to disk.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


_FAST_COMPILE = jax.config.values["jax_disable_most_optimizations"]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Compile at -O0 unless the test is marked ``optimized`` (then at ``OPTIMIZED_FLAGS``' level;
    before its fixtures are made, so a module-scoped fixture compiles as the first test that uses
    it)."""
    optimized = item.get_closest_marker("optimized") is not None
    jax.config.update("jax_disable_most_optimizations", _FAST_COMPILE and not optimized)


# The modules that take longest, longest first (seconds of test time in a full run on 2 cores,
# measured 2026-12-06; test_tpu, test_sharding and test_block: CPU-seconds of the file alone,
# 2026-12-07, its subprocesses included; the others follow in collection order). xdist's
# ``--dist loadfile`` hands each worker the next whole module in this order, so the run ends on
# short modules instead of, say, test_tpu's 200 s; its own reordering (by number of tests) is
# turned off. Only the wall time depends on this list.
LONGEST_MODULES_FIRST = (
    "test_decode.py",  # 313 s
    "test_tpu.py",  # 200 (CPU-s)
    "test_sharding.py",  # 170 (CPU-s)
    "test_verify_multi.py",  # 165
    "test_decode_trees.py",  # 139
    "test_block.py",  # 131 (CPU-s)
    "test_head.py",  # 121
    "test_families.py",  # 113
    "test_verify_tree.py",  # 107
    "test_controls.py",  # 99
    "test_quant.py",  # 95
    "test_benchmark.py",  # 75
    "test_logprobs.py",  # 72
    "test_properties.py",  # 72
    "test_constraints.py",  # 66
    "test_verify_chain.py",  # 57
    "test_cli.py",  # 53
    "test_multihost.py",  # 47
    "test_self_draft.py",  # 45
    "test_samples.py",  # 44
    "test_slots.py",  # 43
    "test_stopping.py",  # 42
    "test_sampler_bad_input.py",  # 41
    "test_notebook.py",  # 37
    "test_draft_stop.py",  # 33
    "test_cli_signals.py",  # 33
    "test_tunix.py",  # 28
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's, on by default
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest in order


def pytest_sessionfinish(session):
    if _RUN_CACHE_MADE_HERE:  # the process that made the directory (xdist's controller)
        shutil.rmtree(RUN_CACHE_DIR, ignore_errors=True)


# Every program XLA:CPU compiles holds a few memory mappings until JAX's caches drop it; a full
# run compiles thousands, and past the kernel's vm.max_map_count (65530 by default) the next
# compile's mmap fails and the process dies with SIGSEGV inside XLA. Between modules, once the
# count passes this bound, the caches are cleared (later modules recompile what they share).
MAX_MAPPINGS = 20_000


def _num_mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: nothing to count
        return 0


@pytest.fixture(autouse=True, scope="module")
def _bounded_compiled_programs():
    yield
    if _num_mappings() > MAX_MAPPINGS:
        jax.clear_caches()
        gc.collect()


_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_PER_TEST_ENV = ("PYTEST_CURRENT_TEST",)  # pytest's own, set per test phase


def _is_pytest_handler(handler) -> bool:  # pytest's capture handlers come and go per phase
    return type(handler).__module__.startswith("_pytest")


def _made_since(known) -> list[logging.Logger]:
    """The loggers made since ``known`` was taken (a filter set on one then stays otherwise)."""
    return [
        lg
        for lg in list(logging.Logger.manager.loggerDict.values())
        if isinstance(lg, logging.Logger) and lg not in known
    ]


def _process_state():
    """What a test or a module's fixtures may change in the process: JAX's configuration, the
    environment, the SIGINT / SIGTERM handlers, the blocked signals (a child process inherits
    them: a CLI started with SIGINT blocked never sees a Ctrl-C) and the filters on every logger."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    return (
        dict(jax.config.values),
        dict(os.environ),
        {s: signal.getsignal(s) for s in _SIGNALS},
        signal.pthread_sigmask(signal.SIG_BLOCK, []),  # the mask, unchanged
        {lg: list(lg.filters) for lg in loggers if isinstance(lg, logging.Logger)},
    )


def _restore(state) -> None:
    config, environ, handlers, blocked, filters = state
    for name, value in config.items():
        if jax.config.values.get(name) != value:
            jax.config.update(name, value)
    if dict(os.environ) != environ:
        for name in set(os.environ) - set(environ) - set(_PER_TEST_ENV):
            del os.environ[name]
        os.environ.update({k: v for k, v in environ.items() if k not in _PER_TEST_ENV})
    for sig, handler in handlers.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
    if signal.pthread_sigmask(signal.SIG_BLOCK, []) != blocked:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    for lg, saved in filters.items():
        lg.filters[:] = saved
    for lg in _made_since(filters):
        lg.filters[:] = []


@pytest.fixture(autouse=True)
def _process_state_restored():
    state = _process_state()
    yield
    _restore(state)


@pytest.fixture(autouse=True, scope="module")
def _module_state_restored():
    """The same around a whole module: its module-scoped fixtures run before any test's snapshot
    (test_sharding's reference run calls the CLI's main in one)."""
    state = _process_state()
    yield
    _restore(state)


@pytest.fixture
def isolated_logging():
    """Every logger's handlers (pytest's own excepted), filters, level, propagation and disabled
    flag restored after the test."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    saved = {
        lg: (
            [h for h in lg.handlers if not _is_pytest_handler(h)],
            list(lg.filters),
            lg.level,
            lg.propagate,
            lg.disabled,
        )
        for lg in loggers
        if isinstance(lg, logging.Logger)
    }
    yield
    for lg in _made_since(saved):  # as logging.getLogger makes them
        lg.handlers[:] = [h for h in lg.handlers if _is_pytest_handler(h)]
        lg.filters[:] = []
        lg.setLevel(logging.NOTSET)
        lg.propagate, lg.disabled = True, False
    for lg, (handlers, filters, level, propagate, disabled) in saved.items():
        lg.handlers[:] = handlers + [h for h in lg.handlers if _is_pytest_handler(h)]
        lg.filters[:] = filters
        lg.setLevel(level)
        lg.propagate, lg.disabled = propagate, disabled
