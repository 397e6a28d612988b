"""What the benchmark scripts share: ``--quick``, the transformers check, timing and JSON rows.

Every script in ``benchmarks/`` imports this module by name (``python benchmarks/<script>.py``
puts the folder first on ``sys.path``; the tests put it there):

* arguments: :func:`fill_quick` (``--quick`` fills the flags left at their defaults),
  :func:`skip_hf` / :func:`missing_hf` (the transformers columns, skipped with one line on stderr
  where torch or transformers is not installed);
* timing: :func:`cpu_wall` (CPU and wall seconds of each call), :func:`median_times`,
  :func:`median_call_s`, :func:`side_by_side` (several candidates timed in interleaved rounds, so
  that a change in the machine's load falls on all of them alike: paired repeats) and
  :func:`timed_runs` (a prepared decoding loop compiled ahead of time, warmed up, then timed);
* rows: :func:`machine` (host, processor count, load averages, jax and its devices) and
  :func:`write_json`, which records that machine in every row it writes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import jax

from asps_jax import decode


def fill_quick(parser: argparse.ArgumentParser, args, quick: dict) -> None:
    """``--quick``: each of ``quick``'s values for the flags left at their defaults."""
    for name, value in quick.items():
        if getattr(args, name) == parser.get_default(name):
            setattr(args, name, value)


def missing_hf() -> str | None:
    """The package the transformers runs need that is not installed (torch, transformers), or
    None."""
    for name in ("torch", "transformers"):
        try:
            importlib.import_module(name)
        except ImportError:
            return name
    return None


def skip_hf(script: str, no_hf: bool, what: str = "columns", flag: bool = True) -> bool:
    """Whether ``script`` skips its transformers runs: asked (``no_hf``), or torch / transformers
    is not installed (the base install), which one line on stderr says before anything runs;
    ``flag``: the script has ``--no-hf``."""
    missing = None if no_hf else missing_hf()
    if missing:
        hint = "; --no-hf skips them without this note" if flag else ""
        print(
            f"{script}: {missing} is not installed, so the transformers {what} are skipped "
            f'(pip install -e ".[test]" brings it{hint})',
            file=sys.stderr,
        )
    return no_hf or missing is not None


def cpu_wall(fn: Callable[[], object], repeats: int) -> tuple[list[float], list[float]]:
    """(CPU seconds, wall seconds) of each of ``repeats`` calls of ``fn()``."""
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return cpu, wall


def median_times(fn: Callable[[], object], repeats: int, warmup: int = 1) -> tuple[float, float]:
    """(median CPU seconds, median wall seconds) of ``fn()`` over ``repeats`` calls, after
    ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    cpu, wall = cpu_wall(fn, repeats)
    return statistics.median(cpu), statistics.median(wall)


def median_call_s(fn, *args, repeats: int = 30) -> float:
    """Median wall seconds of ``fn(*args)`` (blocked on), after one untimed call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def side_by_side(
    candidates: dict[str, Callable[[int], object]], repeats: int, warmup: int = 1
) -> dict[str, dict]:
    """Each candidate's wall seconds, timed in ``repeats`` interleaved rounds (one call of each
    per round, the order turned by one each round) after ``warmup`` untimed rounds, so that a
    change in the machine's load falls on every candidate alike. A candidate is called with the
    round's number (0, 1, ...: warm-up rounds first), e.g. to draw with a new seed each round; its
    result is blocked on. Per name: ``median_s``, the ``times`` and ``ratio``: the median of the
    per-round ratios to the first candidate's time (paired; 1.0 for the first)."""
    names = list(candidates)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(warmup + repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            jax.block_until_ready(candidates[name](round_))
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    base = times[names[0]]
    return {
        name: dict(
            median_s=statistics.median(ts),
            times=ts,
            ratio=statistics.median(t / b for t, b in zip(ts, base)),
        )
        for name, ts in times.items()
    }


def timed_runs(prepared, repeats: int, compiled=None):
    """``prepared``'s whole loop compiled ahead of time (or ``compiled``, that loop compiled
    already: 0 compile seconds), run once as a warm-up (first-call allocations; when
    ``repeats > 0``) and then ``max(repeats, 1)`` timed runs: ``(the last run's state, compile
    seconds, warm-up seconds, run seconds)``."""
    dynamic = prepared.inputs.kwargs()  # the decoder is compiled in
    start = time.perf_counter()
    if compiled is None:
        compiled = decode.generate.lower(prepared.decoder, **dynamic).compile()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    if repeats > 0:
        jax.block_until_ready(compiled(**dynamic))
    warmup_s = time.perf_counter() - start
    times = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        state = jax.block_until_ready(compiled(**dynamic))
        times.append(time.perf_counter() - start)
    return state, compile_s, warmup_s, times


def machine() -> dict:
    """Where a figure was measured: host, processor, CPU count, the 1-, 5- and 15-minute load
    averages (None where the platform has none), Python, jax and its devices."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        load = None
    devices = jax.devices()
    return dict(
        host=platform.node(),
        processor=platform.processor() or platform.machine(),
        cpus=os.cpu_count(),
        load=load,
        python=platform.python_version(),
        jax=jax.__version__,
        backend=jax.default_backend(),
        devices=f"{len(devices)} x {devices[0].device_kind}",
    )


def _stamped(value, where: dict):
    """``value`` with ``machine=where`` in each row: a list of dicts, or a dict whose list values
    hold the rows."""
    if isinstance(value, list):
        return [dict(row, machine=where) if isinstance(row, dict) else row for row in value]
    if isinstance(value, dict):
        return {k: _stamped(v, where) if isinstance(v, list) else v for k, v in value.items()}
    return value


def write_json(path: str, value) -> None:
    """Write ``value`` (a list of rows, or a dict of them) as JSON to ``path``, with the machine
    and its load at the time of writing recorded in every row (:func:`machine`)."""
    with open(path, "w") as f:
        json.dump(_stamped(value, machine()), f, indent=2, default=str)
        f.write("\n")
