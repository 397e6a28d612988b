"""Time jitted verification after warm-up; print a Markdown table, optionally write JSON.

Each case is a row ``(method, n, K, V, batch)``: K draft chains of n tokens, vocabulary V, and
``batch`` independent verifications vmapped into one call. Two suites:

- single chain (default): ``"sps"`` and ``"asps"`` through ``verify_chain``, K = 1;
- multi-draft (``--drafts``, implied when ``--methods`` names a multi-draft method): every method
  of ``verify_drafts`` with its default options (``"is"``: the level race, J = 16, T = 15;
  ``"optimal"``: the gradient-fitted level race); ``is[rule]`` rows set ``rule=``; the
  ``"sps"`` row verifies chain 0 only. All K chains share the root draft and target laws.

The ``ratio`` column divides a case's time by ``"sps"`` on the same ``(n, K, V, batch)``; ``mean
tokens`` is the mean number of tokens a verification emits and ``LP fallbacks`` counts selection
solves that fell back (always 0 for one chain).

``--real`` measures node acceptance instead of time, on real next-token laws: the bundled pair
(``tinyshakespeare-target`` / ``-draft``) is run over windows of data/tinyshakespeare.txt, and at
``--positions`` positions the target law (temperature 1) and the draft law (each
``--draft-temperatures``) give one root node with K identical drafts. Per K and method it prints the
mean *accept-part* acceptance, computed exactly (no sampling): the probability that an accept test
emits a draft token (a residual draw that happens to equal a draft token is not counted), beside
the mean ``optimal_acceptance`` (the best ``P(Y in drafts)`` of any exact scheme, exact for
identical drafts). IS-type rules: ``sum_y min(p, q_I)``; SpecTr: ``1 - (1 - beta(rho))^K``;
SpecInfer: ``1 - prod_k (1 - sum_y min(q, t_k))`` with the deterministic residuals ``t_k``. It also
times the default ``is`` rule's per-node preparation (one node, K = 4) at the pair's V and at
V = 32000.

    python benchmarks/bench_verify.py [--drafts] [--quick] [--methods M ...] [--vocab V]
                                      [--repeats R] [--json PATH]
    python benchmarks/bench_verify.py --real [--positions N] [--ks K ...]
                                      [--draft-temperatures T ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from harness import write_json

import asps_jax
from asps_jax.verify import options as verify_options
from asps_jax.verify import registry, tokenlevel
from asps_jax.verify.acceptance import optimal_acceptance
from asps_jax.verify.selection import PAIRWISE_RULES, RULES

BASELINE = "sps"
CHAIN_METHODS = registry.names("chain")
# The multi-draft suite: the SpS baseline on chain 0, then every multi-draft method; "is" also
# with each pairwise rule, written "is[rule]".
DRAFTS_METHODS = (BASELINE,) + tuple(
    v
    for m in registry.names("drafts")
    for v in ((m,) + tuple(f"is[{r}]" for r in PAIRWISE_RULES) if m == "is" else (m,))
)


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


CORPUS = Path(__file__).resolve().parents[1] / "data/tinyshakespeare.txt"
# Exact node acceptance with K i.i.d. drafts: the multi-draft methods for that law, "is" with
# each of its rules.
REAL_METHODS = tuple(
    v
    for m in registry.names("drafts")
    if registry.REGISTRY[m].law == "iid"
    for v in (tuple(f"is[{r}]" for r in RULES) if m == "is" else (m,))
)


def real_logits(num_positions: int, target="tinyshakespeare-target", draft="tinyshakespeare-draft"):
    """Target and draft logits ``[N, V]`` (float32) at ``num_positions`` corpus positions.

    Four windows of the corpus (evenly spaced), each read causally in one forward; the positions
    are the last ``N / 4`` of each window, so every one has at least as many tokens of context.
    """
    tm, dm = asps_jax.load_model(target), asps_jax.load_model(draft)
    windows = 4
    per = -(-num_positions // windows)
    length = min(max(2 * per, 64), tm.config.max_position_embeddings)
    if per > length:
        raise ValueError(f"--positions {num_positions} needs windows longer than the context")
    text = CORPUS.read_text(encoding="utf-8")[:200_000]
    ids = tm.tokenizer.encode(text, add_special_tokens=False)
    starts = np.linspace(0, len(ids) - length - 1, windows).astype(int)
    tokens = np.stack([ids[s : s + length] for s in starts]).astype(np.int32)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape)
    mask = np.broadcast_to(np.tril(np.ones((length, length), bool)), (windows, length, length))
    out = []
    for model in (tm, dm):
        logits, _ = jax.jit(model.forward)(model.params, tokens, positions, mask, None)
        out.append(logits[:, length - per :].reshape(-1, logits.shape[-1])[:num_positions])
    return out


def specinfer_accept(p, q, num_drafts: int):
    """Accept part of RRS with K identical drafts: the residuals t_k are deterministic."""

    def test(t, _):
        beta = jnp.sum(jnp.minimum(q, t))
        rest = jnp.maximum(t - q, 0.0)
        tot = jnp.sum(rest)
        return jnp.where(tot > 0, rest / jnp.where(tot > 0, tot, 1.0), t), 1.0 - beta

    _, miss = jax.lax.scan(test, p, None, length=num_drafts)
    return 1.0 - jnp.prod(miss)


def spectr_accept(p, q, num_drafts: int):
    qs = jnp.broadcast_to(q, (num_drafts,) + q.shape)
    rho = tokenlevel.spectr_division_factor(p, qs, jnp.ones((num_drafts,), bool))
    beta = jnp.sum(jnp.minimum(q, p / rho))
    return 1.0 - (1.0 - beta) ** num_drafts


def is_accept(p, q, num_drafts: int, method: str, options: dict):
    cfg = verify_options.rule_config(method, p.shape[-1], options)
    qs = jnp.broadcast_to(q, (num_drafts,) + q.shape)
    prepared = tokenlevel.importance_sampling_rules(p, qs, jnp.ones((num_drafts,), bool), cfg)
    q_sel = prepared.q_sel if hasattr(prepared, "q_sel") else prepared[2]
    return jnp.sum(jnp.minimum(p, q_sel))


def accept_fn(method: str, num_drafts: int):
    """``fn(p [V], q [V]) -> []``: exact accept-part acceptance of ``method`` at one node."""
    name, _, rule = method.partition("[")
    if name == "specinfer":
        return functools.partial(specinfer_accept, num_drafts=num_drafts)
    if name == "spectr":
        return functools.partial(spectr_accept, num_drafts=num_drafts)
    options = {"rule": rule.rstrip("]")} if rule else {}
    return functools.partial(is_accept, num_drafts=num_drafts, method=name, options=options)


def time_rule(vocab: int, method: str = "is", num_drafts: int = 4, repeats: int = 5) -> float:
    """Median ms of ``method``'s default rule preparation (the fit) at one node, jitted."""
    k_p, k_q = jax.random.split(jax.random.key(0))
    lq = jax.nn.log_softmax(3.0 * jax.random.normal(k_q, (vocab,)))
    p = jax.nn.softmax(lq + jax.random.normal(k_p, (vocab,)))
    qs = jnp.broadcast_to(jnp.exp(lq), (num_drafts, vocab))
    cfg = verify_options.rule_config(method, vocab, {})
    fn = jax.jit(
        lambda p, q: (
            tokenlevel.importance_sampling_rules(p, q, jnp.ones((num_drafts,), bool), cfg).q_sel
        )
    )
    jax.block_until_ready(fn(p, qs))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(p, qs))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def real_rows(positions: int, ks, temperatures, methods) -> tuple[list[dict], int]:
    """Rows of mean accept-part acceptance per (draft temperature, K), and the vocabulary size."""
    target_logits, draft_logits = real_logits(positions)
    lp = jax.nn.log_softmax(target_logits, axis=-1)
    rows = []
    for temp in temperatures:
        lq = jax.nn.log_softmax(draft_logits / temp, axis=-1)
        p, q = jnp.exp(lp), jnp.exp(lq)
        for k in ks:
            lqs = jnp.broadcast_to(lq[:, None], (lq.shape[0], k, lq.shape[-1]))
            optimum = float(jnp.mean(jax.jit(optimal_acceptance)(lp, lqs)))
            row = {"draft_temperature": temp, "K": k, "optimum": optimum}
            for method in methods:
                fn = jax.jit(jax.vmap(accept_fn(method, k)))
                row[method] = float(jnp.mean(fn(p, q)))
            rows.append(row)
            print(f"  T={temp} K={k}: done", file=sys.stderr, flush=True)
    return rows, lp.shape[-1]


def real_markdown(rows: list[dict], methods) -> str:
    lines = [
        "| draft T | K | optimum | " + " | ".join(methods) + " |",
        "|---:|---:|---:|" + "---:|" * len(methods),
    ]
    for r in rows:
        cells = " | ".join(f"{r[m]:.4f}" for m in methods)
        lines.append(f"| {r['draft_temperature']} | {r['K']} | {r['optimum']:.4f} | {cells} |")
    return "\n".join(lines)


def main_real(args, parser) -> int:
    methods = args.methods or list(REAL_METHODS)
    unknown = set(methods) - set(REAL_METHODS)
    if unknown:
        parser.error(f"--real: unknown --methods {sorted(unknown)}; choose from {REAL_METHODS}")
    if args.positions < 1:
        parser.error("--positions must be >= 1")
    if not args.ks or min(args.ks) < 2:
        parser.error("--ks: every K must be >= 2")
    if not args.draft_temperatures or min(args.draft_temperatures) <= 0:
        parser.error("--draft-temperatures: every temperature must be > 0")
    rows, vocab = real_rows(args.positions, args.ks, args.draft_temperatures, methods)
    print(
        f"accept-part acceptance (exact), mean over {args.positions} positions of "
        "data/tinyshakespeare.txt; target tinyshakespeare-target (T = 1), K i.i.d. drafts from "
        "tinyshakespeare-draft at the draft temperature"
    )
    print(real_markdown(rows, methods))
    timing_opt = {}
    vocabs = (vocab,) if args.quick else tuple(dict.fromkeys((vocab, 32000)))
    timing = {v: time_rule(v) for v in vocabs}
    for v, ms in timing.items():
        print(f"default is rule (level race), one node, K = 4, V = {v}: {ms:.2f} ms")
    if "optimal" in methods:
        timing_opt = {v: time_rule(v, "optimal") for v in vocabs}
        for v, ms in timing_opt.items():
            print(f"optimal (gradient-fitted level race), one node, K = 4, V = {v}: {ms:.2f} ms")
    if args.json:
        write_json(args.json, {"rows": rows, "rule_ms": timing, "optimal_ms": timing_opt})
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        # The docstring without its closing usage lines, which argparse's own usage replaces.
        description=__doc__.partition("\n\n    python ")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    known = tuple(dict.fromkeys(CHAIN_METHODS + DRAFTS_METHODS))
    parser.add_argument(
        "--quick",
        action="store_true",
        help="Run a few small cases (a smoke test); with --real, time the rule at the pair's V "
        "only.",
    )
    parser.add_argument(
        "--drafts",
        action="store_true",
        help="Run the multi-draft suite (verify_drafts, K >= 2) instead of the single-chain one; "
        "a multi-draft method in --methods implies it.",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="Timed calls per case (default: 10; 3 with --quick, 2 with --drafts --quick).",
    )
    parser.add_argument(
        "--methods",
        nargs="*",
        default=None,
        help=f"Methods to run, a subset of {', '.join(known)} (default: all of the suite's; "
        f"with --real, a subset of {', '.join(REAL_METHODS)}, default all).",
    )
    parser.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="Vocabulary size V of every case (default: 32000 and 50272 for one chain, 50272 "
        "for --drafts; 32000 with --quick, 4096 with --drafts --quick).",
    )
    parser.add_argument("--json", metavar="PATH", help="Also write the rows as JSON to PATH.")
    parser.add_argument(
        "--real",
        action="store_true",
        help="Measure node acceptance on the bundled pair's real laws instead of timings.",
    )
    parser.add_argument(
        "--positions", type=int, default=200, help="Corpus positions of --real (default: 200)."
    )
    parser.add_argument(
        "--ks",
        type=int,
        nargs="*",
        default=[2, 3, 4, 8],
        help="Numbers of drafts K of --real, each >= 2 (default: 2 3 4 8).",
    )
    parser.add_argument(
        "--draft-temperatures",
        type=float,
        nargs="*",
        default=[1.0, 1.4],
        help="Draft temperatures of --real, each > 0 (default: 1.0 1.4).",
    )
    args = parser.parse_args(argv)
    if args.real:
        return main_real(args, parser)
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
        write_json(args.json, {"meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
