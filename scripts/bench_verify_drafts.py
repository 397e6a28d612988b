"""Time jitted multi-draft verification (``verify_drafts``) after warm-up; Markdown table + JSON.

Each case is ``(method, n, K, V, batch)``: K draft chains of n tokens, vocabulary V, ``batch``
independent verifications vmapped into one call. Methods use their default options (``"is"``:
truncated LP with s = 5 on a 40-token alphabet; ``"optimal"``: full pairwise LP on 16 tokens);
``is[rule]`` rows set ``rule=``. The ``ratio`` column divides by single-draft ``"sps"`` (chain 0
only) on the same ``(n, K, V, batch)``.

    python scripts/bench_verify_drafts.py [--quick] [--repeats R] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import asps_jax
from asps_jax.verify import multi

METHODS = (
    "sps",
    "specinfer",
    "specinfer_wor",
    "spectr",
    "is",
    "is[fixed_order]",
    "is[sir]",
    "optimal",
)
BASELINE = "sps"


@dataclasses.dataclass(frozen=True)
class Case:
    method: str
    n: int
    K: int  # noqa: N815 -- the letter of STYLE.md
    V: int  # noqa: N815
    batch: int


def _inputs(key, case: Case):
    """Random laws and K chains drawn from them.

    Returns ``x [B, K, n]``, ``lq [B, K, n, V]``, ``lp [B, K, n+1, V]``.
    """
    k_q, k_p, k_x = jax.random.split(key, 3)
    shape = (case.batch, case.K)
    # A realistic spread so that acceptance is neither ~0 nor ~1.
    lq = jax.nn.log_softmax(3.0 * jax.random.normal(k_q, shape + (case.n, case.V)), axis=-1)
    noise = jax.random.normal(k_p, shape + (case.n + 1, case.V))
    lq_ext = jnp.concatenate([lq, lq[..., -1:, :]], axis=-2)
    lp = jax.nn.log_softmax(lq_ext + noise, axis=-1)
    # All chains start at the same root: one draft law and one target law there (API.md §1).
    lq = lq.at[:, :, 0].set(jnp.broadcast_to(lq[:, :1, 0], lq[:, :, 0].shape))
    lp = lp.at[:, :, 0].set(jnp.broadcast_to(lp[:, :1, 0], lp[:, :, 0].shape))
    x = jax.random.categorical(k_x, lq, axis=-1).astype(jnp.int32)
    return x, lq, lp


def _verifier(method: str):
    name, _, rule = method.partition("[")
    options = {"rule": rule.rstrip("]")} if rule else {}
    if name not in asps_jax.verify.DRAFTS_METHODS:  # registered, not yet routed by verify_drafts

        def call(key, x, lq, lp):
            length = jnp.full((x.shape[0],), x.shape[1], jnp.int32)
            return multi.METHODS[name](key, x, lq, lp, length, **options)

        return call
    return lambda key, x, lq, lp: asps_jax.verify_drafts(key, x, lq, lp, method=name, **options)


def time_case(case: Case, repeats: int, warmup: int = 2) -> dict:
    """Median and minimum wall time of one jitted call (compile and warm-up excluded)."""
    fn = jax.jit(jax.vmap(_verifier(case.method)))
    x, lq, lp = _inputs(jax.random.key(0), case)
    keys = jax.random.split(jax.random.key(1), case.batch)
    args = (keys, x, lq, lp)
    jax.block_until_ready(args)
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
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
        "mean_tokens": float(jnp.mean(out.num_tokens)),
        "fallbacks": int(jnp.sum(out.num_fallbacks)),
    }


def default_cases(quick: bool, vocab: int | None = None) -> list[Case]:
    if quick:
        return [Case(m, 3, 2, vocab or 4096, b) for b in (1, 4) for m in METHODS]
    return [Case(m, 5, k, vocab or 50272, b) for b in (1, 32) for k in (2, 4, 6) for m in METHODS]


def add_ratios(rows: list[dict]) -> None:
    key = lambda r: (r["n"], r["K"], r["V"], r["batch"])  # noqa: E731
    base = {key(r): r["median_us"] for r in rows if r["method"] == BASELINE}
    for r in rows:
        ref = base.get(key(r))
        r["ratio"] = r["median_us"] / ref if ref else None


def markdown(rows: list[dict]) -> str:
    lines = [
        f"| method | n | K | V | batch | median (us) | min (us) | ratio to {BASELINE} "
        "| mean tokens | LP fallbacks |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(
            f"| {r['method']} | {r['n']} | {r['K']} | {r['V']} | {r['batch']} | "
            f"{r['median_us']:.0f} | {r['min_us']:.0f} | {ratio} | {r['mean_tokens']:.2f} | "
            f"{r['fallbacks']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a few small cases (smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per case")
    parser.add_argument("--methods", nargs="*", default=None, help=f"subset of {METHODS}")
    parser.add_argument("--vocab", type=int, default=None, help="override V (default 50272)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    args = parser.parse_args(argv)
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 10)
    if repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.vocab is not None and args.vocab < 2:
        parser.error("--vocab must be >= 2")
    unknown = set(args.methods or ()) - set(METHODS)
    if unknown:
        parser.error(f"unknown --methods {sorted(unknown)}; choose from {METHODS}")

    cases = [
        c
        for c in default_cases(args.quick, args.vocab)
        if args.methods is None or c.method in args.methods
    ]
    rows = []
    for case in cases:
        rows.append(time_case(case, repeats))
        print(f"  {case}: {rows[-1]['median_us']:.0f} us", file=sys.stderr, flush=True)
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
