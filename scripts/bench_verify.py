"""Time jitted verification after warm-up; print a Markdown table, optionally write JSON.

Each case is a row ``(method, n, K, V, batch)``: K draft chains of n tokens, vocabulary V, and
``batch`` independent verifications vmapped into one call. Two suites:

- single chain (default): ``"sps"`` and ``"asps"`` through ``verify_chain``, K = 1;
- multi-draft (``--drafts``, implied when ``--methods`` names a multi-draft method): every method
  of ``verify_drafts`` with its default options (``"is"``: truncated LP with s = 5 on a 40-token
  alphabet; ``"optimal"``: full pairwise LP on 16 tokens); ``is[rule]`` rows set ``rule=``; the
  ``"sps"`` row verifies chain 0 only. All K chains share the root draft and target laws.

The ``ratio`` column divides a case's time by ``"sps"`` on the same ``(n, K, V, batch)``; ``mean
tokens`` is the mean number of tokens a verification emits and ``LP fallbacks`` counts selection
solves that fell back (always 0 for one chain).

    python scripts/bench_verify.py [--drafts] [--quick] [--methods M ...] [--vocab V]
                                   [--repeats R] [--json PATH]
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

import jax
import jax.numpy as jnp

import asps_jax

CHAIN_METHODS = ("sps", "asps")
DRAFTS_METHODS = (
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
    K: int  # noqa: N815 -- the shape letter of the glossary
    V: int  # noqa: N815
    batch: int
    drafts: bool  # through verify_drafts (K chains) rather than verify_chain (one chain)


@functools.partial(jax.jit, static_argnums=1)  # one compile per case, not one per eager op
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
    # All chains start at the same root: one draft law and one target law there (docs/api.md §1).
    lq = lq.at[:, :, 0].set(jnp.broadcast_to(lq[:, :1, 0], lq[:, :, 0].shape))
    lp = lp.at[:, :, 0].set(jnp.broadcast_to(lp[:, :1, 0], lp[:, :, 0].shape))
    x = jax.random.categorical(k_x, lq, axis=-1).astype(jnp.int32)
    return x, lq, lp


def _verifier(case: Case):
    """``fn(key, x, lq, lp) -> Verdict`` for one unbatched case."""
    name, _, rule = case.method.partition("[")
    if not case.drafts:
        return lambda key, x, lq, lp: asps_jax.verify_chain(key, x[0], lq[0], lp[0], method=name)
    options = {"rule": rule.rstrip("]")} if rule else {}
    return lambda key, x, lq, lp: asps_jax.verify_drafts(key, x, lq, lp, method=name, **options)


def time_case(case: Case, repeats: int, warmup: int = 2) -> dict:
    """Median and minimum wall time of one jitted call (compile and warm-up excluded)."""
    fn = jax.jit(jax.vmap(_verifier(case)))
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


def default_cases(quick: bool, drafts: bool = False, vocab: int | None = None) -> list[Case]:
    if drafts:
        if quick:
            return [Case(m, 3, 2, vocab or 4096, b, True) for b in (1, 4) for m in DRAFTS_METHODS]
        return [
            Case(m, 5, k, vocab or 50272, b, True)
            for b in (1, 32)
            for k in (2, 4, 6)
            for m in DRAFTS_METHODS
        ]
    ns, vocabs, batches = (
        ((1, 8), (32000,), (1, 64)) if quick else ((1, 4, 8, 16), (32000, 50272), (1, 64))
    )
    return [
        Case(method, n, 1, vocab, batch, False)
        for vocab in ((vocab,) if vocab else vocabs)
        for batch in batches
        for n in ns
        for method in CHAIN_METHODS
    ]


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
    known = tuple(dict.fromkeys(CHAIN_METHODS + DRAFTS_METHODS))
    parser.add_argument("--quick", action="store_true", help="a few small cases (smoke test)")
    parser.add_argument(
        "--drafts", action="store_true", help="the multi-draft suite (verify_drafts, K >= 2)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per case")
    parser.add_argument("--methods", nargs="*", default=None, help=f"subset of {known}")
    parser.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="override V (default 32000 and 50272 for one chain, 50272 for --drafts; "
        "4096 for --drafts --quick)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    args = parser.parse_args(argv)
    unknown = set(args.methods or ()) - set(known)
    if unknown:
        parser.error(f"unknown --methods {sorted(unknown)}; choose from {known}")
    drafts = args.drafts or any(m not in CHAIN_METHODS for m in args.methods or ())
    if drafts and set(args.methods or ()) - set(DRAFTS_METHODS):
        parser.error(f"--methods: the multi-draft suite runs only {DRAFTS_METHODS}")
    if args.repeats is None:
        repeats = (2 if drafts else 3) if args.quick else 10
    else:
        repeats = args.repeats
    if repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.vocab is not None and args.vocab < 2:
        parser.error("--vocab must be >= 2")

    cases = [
        c
        for c in default_cases(args.quick, drafts, args.vocab)
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
