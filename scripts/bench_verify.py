"""Time jitted verification after warm-up; print a Markdown table, optionally write JSON.

Each case is a row ``(method, n, K, V, batch)``: n draft tokens per chain, K chains (1 for the
single-chain methods of ``verify_chain``), vocabulary V, and ``batch`` independent verifications
(vmapped when > 1). The ``ratio`` column divides a case's time by the baseline method's time on the
same ``(n, K, V, batch)``. Multi-draft methods plug in by adding a builder to ``BUILDERS`` and
their rows to ``default_cases``.

    python scripts/bench_verify.py [--quick] [--repeats R] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

import asps_jax


@dataclasses.dataclass(frozen=True)
class Case:
    method: str
    n: int
    K: int  # noqa: N815 -- the letter of STYLE.md
    V: int  # noqa: N815
    batch: int


def _chain_inputs(key, case: Case):
    """Random laws and drafts drawn from them: ``[B, n]``, ``[B, n, V]``, ``[B, n+1, V]``."""
    k_q, k_p, k_x = jax.random.split(key, 3)
    shape = (case.batch,)
    # Logits with a realistic spread so that acceptance is neither ~0 nor ~1.
    lq = jax.nn.log_softmax(3.0 * jax.random.normal(k_q, shape + (case.n, case.V)), axis=-1)
    noise = jax.random.normal(k_p, shape + (case.n + 1, case.V))
    lq_ext = jnp.concatenate([lq, lq[..., -1:, :]], axis=-2)
    lp = jax.nn.log_softmax(lq_ext + 1.0 * noise, axis=-1)
    x = jax.random.categorical(k_x, lq, axis=-1).astype(jnp.int32)
    return x, lq, lp


def _build_chain(case: Case) -> tuple[Callable, tuple]:
    """A jitted ``fn(keys, x, lq, lp)`` for one chain method, and its inputs."""
    verify = functools.partial(asps_jax.verify_chain, method=case.method)
    fn = jax.jit(jax.vmap(verify))
    x, lq, lp = _chain_inputs(jax.random.key(0), case)
    keys = jax.random.split(jax.random.key(1), case.batch)
    return fn, (keys, x, lq, lp)


BUILDERS: dict[str, Callable[[Case], tuple[Callable, tuple]]] = {
    "sps": _build_chain,
    "asps": _build_chain,
}
BASELINE = "sps"


def default_cases(quick: bool) -> list[Case]:
    ns, vocabs, batches = (
        ((1, 8), (32000,), (1, 64)) if quick else ((1, 4, 8, 16), (32000, 50272), (1, 64))
    )
    return [
        Case(method, n, 1, vocab, batch)
        for vocab in vocabs
        for batch in batches
        for n in ns
        for method in ("sps", "asps")
    ]


def time_case(case: Case, repeats: int, warmup: int = 2) -> dict:
    """Median and minimum wall time of one jitted call (compile and warm-up excluded)."""
    fn, args = BUILDERS[case.method](case)
    jax.block_until_ready(args)
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return {
        **dataclasses.asdict(case),
        "median_us": 1e6 * statistics.median(times),
        "min_us": 1e6 * min(times),
        "compile_s": compile_s,
        "repeats": repeats,
    }


def add_ratios(rows: list[dict]) -> None:
    base = {
        (r["n"], r["K"], r["V"], r["batch"]): r["median_us"]
        for r in rows
        if r["method"] == BASELINE
    }
    for r in rows:
        ref = base.get((r["n"], r["K"], r["V"], r["batch"]))
        r["ratio"] = r["median_us"] / ref if ref else None


def markdown(rows: list[dict]) -> str:
    lines = [
        f"| method | n | K | V | batch | median (us) | min (us) | ratio to {BASELINE} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(
            f"| {r['method']} | {r['n']} | {r['K']} | {r['V']} | {r['batch']} | "
            f"{r['median_us']:.0f} | {r['min_us']:.0f} | {ratio} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a few small cases (smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per case")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    args = parser.parse_args(argv)
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 10)
    if repeats < 1:
        parser.error("--repeats must be >= 1")

    rows = [time_case(case, repeats) for case in default_cases(args.quick)]
    add_ratios(rows)
    device = jax.devices()[0]
    print(f"backend: {jax.default_backend()} ({device.device_kind}), jax {jax.__version__}")
    print(markdown(rows))
    if args.json:
        meta = {
            "backend": jax.default_backend(),
            "device": device.device_kind,
            "jax": jax.__version__,
            "machine": platform.machine(),
            "python": platform.python_version(),
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
