"""Drafters and stopping rules, same run each: prompt lookup vs the draft model vs AR on a
copy-heavy task, and confidence-stopped vs fixed-n chains at the realistic cost ratio.

``copy`` (the bundled tiny Shakespeare pair): each prompt quotes a passage of
data/tinyshakespeare.txt, a blank line, then the passage's first quarter again; the model is asked
to go on (a continuation of text seen in the prompt). Rows: AR, the draft model (asps, n), prompt
lookup (asps, n, ``lookup_ngram``), at each ``--temperatures``.

``stop`` (the ~0.5B / llama-68m-shaped random pair of scripts/bench_cost_ratio.py, its
checkpoints): AR, asps at fixed n, and asps at n_max with ``draft_stop="confidence:τ"`` for each
``--taus``, random prompts as there.

Per row: tokens per step (mean over all steps of all runs), wall tokens/s (median of
``--repeats`` compiled runs, compilation excluded), the draft tokens verified per step.

    python scripts/bench_drafters.py copy [--n 4] [--temperatures 0 1] [--max-new-tokens 64]
    python scripts/bench_drafters.py stop [--n 4 8] [--taus 0.3 0.5 0.7] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

import asps_jax
from asps_jax import decode, sampler

ROOT = Path(__file__).resolve().parents[1]


def run(target, draft, prompts, *, repeats, seed=0, **kwargs) -> dict:
    """Compile once, then ``repeats`` timed runs of the whole loop (one key each)."""

    def prepare(s):
        return sampler.prepare(target, draft, prompts, key=jax.random.key(s), eos_token_id=-1,
                               **kwargs)  # fmt: skip

    prepared = prepare(seed)
    batch, decoder, call = prepared.batch, prepared.decoder, prepared.inputs.kwargs()
    start = time.perf_counter()
    compiled = decode.generate.lower(decoder, **call).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(**call))
    walls, hist, tokens, decisions = [], 0, 0, 0
    for i in range(repeats):
        keys = prepare(seed + 1 + i).inputs.row_keys_B
        start = time.perf_counter()
        state = jax.block_until_ready(compiled(**dict(call, row_keys_B=keys)))
        walls.append(time.perf_counter() - start)
        stats = jax.device_get(sampler.summarize_stats(state, batch))
        hist = hist + np.asarray(stats["emitted_hist"]).sum(0)
        tokens = int(np.asarray(state.num_generated)[:batch].sum())
        decisions += int(np.asarray(stats["decisions"]).sum())
    steps = float(hist.sum())
    wall = statistics.median(walls)
    return dict(
        tokens_per_step=float((np.arange(hist.shape[0]) * hist).sum() / steps),
        tokens_per_s=tokens / wall,
        drafted_per_step=decisions / steps,
        compile_s=compile_s,
    )


def copy_prompts(tokenizer, count: int, chars: int) -> list[list[int]]:
    text = (ROOT / "data" / "tinyshakespeare.txt").read_text()
    rng = np.random.default_rng(0)
    prompts = []
    for start in rng.integers(0, len(text) - chars, count):
        passage = text[start : start + chars]
        passage = passage[passage.find("\n") + 1 :]  # from a line start
        prompts.append(tokenizer.encode(passage + "\n\n" + passage[: len(passage) // 4]))
    return prompts


def bench_copy(args) -> None:
    target = asps_jax.load_model("tinyshakespeare-target", dtype="float32")
    draft = asps_jax.load_model("tinyshakespeare-draft", dtype="float32")
    prompts = copy_prompts(target.tokenizer, args.batch, args.chars)
    common = dict(max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    print("| temperature | drafter | n | tokens/step | tokens/s | drafted/step | compile s |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for temperature in args.temperatures:
        rows = [("AR", None, dict(method="ar"))]
        for n in args.n:
            rows.append(("draft model (asps)", draft, dict(method="asps", num_draft_tokens=n)))
            lookup = dict(method="asps", num_draft_tokens=n, lookup_ngram=args.ngram)
            rows.append((f"lookup m={args.ngram} (asps)", "lookup", lookup))
        for name, drafter, kw in rows:
            r = run(target, drafter, prompts, temperature=temperature, **common, **kw)
            n = kw.get("num_draft_tokens", 0)
            print(f"| {temperature:g} | {name} | {n} | {r['tokens_per_step']:.2f} | "
                  f"{r['tokens_per_s']:.1f} | {r['drafted_per_step']:.2f} | {r['compile_s']:.0f} |",
                  flush=True)  # fmt: skip


def bench_stop(args) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_cost_ratio import CHECKPOINTS, DRAFT, TARGET, checkpoint_pair

    paths = checkpoint_pair((TARGET, DRAFT), 0.2, 0.07, 0, CHECKPOINTS / "bench_cost_ratio")
    target, draft = (asps_jax.load_model(str(p), dtype="float32") for p in paths)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, target.vocab_size, (1, 16)).astype(np.int32).tolist()
    common = dict(max_new_tokens=args.max_new_tokens, repeats=args.repeats, temperature=1.0)
    rows = [("AR", None, dict(method="ar"))]
    for n in args.n:
        rows.append((f"asps n={n}", draft, dict(method="asps", num_draft_tokens=n)))
    for tau in args.taus:
        rows.append((f"asps n={max(args.n)}, confidence:{tau:g}", draft,
                     dict(method="asps", num_draft_tokens=max(args.n),
                          draft_stop=f"confidence:{tau:g}")))  # fmt: skip
    print("| drafting | tokens/step | tokens/s | drafted/step | compile s |")
    print("|---|---:|---:|---:|---:|")
    for name, drafter, kw in rows:
        r = run(target, drafter, prompts, **common, **kw)
        print(f"| {name} | {r['tokens_per_step']:.2f} | {r['tokens_per_s']:.2f} | "
              f"{r['drafted_per_step']:.2f} | {r['compile_s']:.0f} |", flush=True)  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("task", choices=("copy", "stop"))
    p.add_argument("--n", nargs="+", type=int, default=None)
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    p.add_argument("--taus", nargs="+", type=float, default=[0.3, 0.5, 0.7])
    p.add_argument("--ngram", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--chars", type=int, default=400)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--quick", action="store_true", help="A small run (one n, temperature 0, 2 rows)."
    )
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.temperatures, args.taus = [4], [0.0], [0.5]
        args.batch, args.chars, args.repeats = 2, 200, 1
    if args.task == "copy":
        args.n = args.n or [4]
        args.max_new_tokens = args.max_new_tokens or 64
        bench_copy(args)
    else:
        args.n = args.n or [4, 8]
        args.max_new_tokens = args.max_new_tokens or 32
        bench_stop(args)
    print(f"# jax {jax.__version__} on {jax.default_backend()}; {' '.join(sys.argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
