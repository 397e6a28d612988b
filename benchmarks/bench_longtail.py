"""Continuous batching against chunking by hand: useful tokens/s on a long-tailed mix of budgets.

Workload ``longtail``: 64 prompts (consecutive tinyshakespeare lines, at most ``--prompt-tokens``
tokens each), 56 with a 16-token budget and 8 with 192, the long ones at positions drawn once with
``--seed``; ``uniform``: the same 64 prompts, every budget 64. EOS never ends a row, so every
prompt generates exactly its budget (the useful tokens).

For each workload, in the same process: **refill**, one ``sample(..., batch_size=8)`` call (8
slots, a finished slot takes the next prompt inside the compiled loop), against **chunks**, the
prompts in consecutive chunks of 8, one ``sample`` call per chunk with the chunk's budgets (each
chunk runs until its longest row is done: what a user without continuous batching does). Every
program is compiled (and run once) before the timed runs; the figure is the median of
``--repeats`` timed runs of the whole workload. Useful tokens/s = sum of the budgets / wall seconds.

    python benchmarks/bench_longtail.py [--workloads longtail uniform] [--method asps] [--json PATH]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
from harness import write_json

import asps_jax

CORPUS = Path(__file__).resolve().parents[1] / "data/tinyshakespeare.txt"
SLOTS = 8


def budgets_for(workload: str, count: int, seed: int) -> list[int]:
    if workload == "uniform":
        return [64] * count
    long_at = set(np.random.default_rng(seed).choice(count, size=count // 8, replace=False))
    return [192 if i in long_at else 16 for i in range(count)]


def prompts_for(tokenizer, count: int, width: int) -> list[list[int]]:
    lines = [line for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]
    out = []
    for line in lines[:count]:
        ids = tokenizer.encode(line, verbose=False)[-width:]
        out.append(ids or [0])
    return out


def run_workload(target, draft, prompts, budgets, args) -> dict:
    common = dict(
        method=args.method,
        num_draft_tokens=args.num_draft_tokens,
        eos_token_id=-1,
        temperature=args.temperature,
    )

    def refill(seed):
        out = asps_jax.sample(
            target,
            draft,
            prompts,
            key=jax.random.key(seed),
            max_new_tokens=budgets,
            batch_size=SLOTS,
            **common,
        )
        return int(np.asarray(out.lengths).sum()), out

    def chunks(seed):
        total = 0
        key = jax.random.key(seed)
        for start in range(0, len(prompts), SLOTS):
            out = asps_jax.sample(
                target,
                draft,
                prompts[start : start + SLOTS],
                key=jax.random.fold_in(key, start),
                max_new_tokens=budgets[start : start + SLOTS],
                **common,
            )
            total += int(np.asarray(out.lengths).sum())
        return total, out

    figures = {}
    for name, fn in (("refill", refill), ("chunks", chunks)):
        fn(args.seed)  # compile (every chunk has the same shapes: one program) and warm up
        times, tokens = [], 0
        for r in range(args.repeats):
            start = time.perf_counter()
            tokens, out = fn(args.seed + 1 + r)
            jax.block_until_ready(out.tokens)
            times.append(time.perf_counter() - start)
        wall = statistics.median(times)
        figures[name] = dict(seconds=round(wall, 4), tokens=tokens, tokens_per_s=tokens / wall)
    figures["useful_tokens"] = int(sum(budgets))
    figures["ratio"] = figures["refill"]["tokens_per_s"] / figures["chunks"]["tokens_per_s"]
    return figures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--target",
        default="tinyshakespeare-target",
        help="Target model: a registered alias or a checkpoint path "
        "(default: tinyshakespeare-target).",
    )
    p.add_argument(
        "--draft",
        default="tinyshakespeare-draft",
        help="Draft model: a registered alias or a checkpoint path "
        "(default: tinyshakespeare-draft).",
    )
    p.add_argument("--method", default="asps", help="Method of every sample call (default: asps).")
    p.add_argument(
        "--num-draft-tokens", type=int, default=4, help="Draft tokens n per step (default: 4)."
    )
    p.add_argument(
        "--temperature", type=float, default=1.0, help="Sampling temperature (default: 1.0)."
    )
    p.add_argument(
        "--prompts",
        type=int,
        default=64,
        help="Number of prompts, the first non-empty tinyshakespeare lines (default: 64).",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=16,
        help="Tokens kept of each prompt line, its last ones (default: 16).",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="Timed runs of each workload per figure, reported as their median (default: 1).",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="Seed of the long budgets' positions and of the sampling (default: 0).",
    )
    p.add_argument(
        "--workloads",
        nargs="+",
        default=["longtail", "uniform"],
        help="Workloads to run: longtail = one prompt in 8 with a 192-token budget, the others "
        "16; uniform = every budget 64 (default: longtail uniform).",
    )
    p.add_argument("--json", metavar="PATH", help="Also write the figures as JSON to PATH.")
    p.add_argument(
        "--quick", action="store_true", help="A small run: 16 prompts, the long-tail mix only."
    )
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.workloads = 16, ["longtail"]
    target = asps_jax.load_model(args.target)
    draft = asps_jax.load_model(args.draft)
    prompts = prompts_for(target.tokenizer, args.prompts, args.prompt_tokens)
    results = {}
    for workload in args.workloads:
        budgets = budgets_for(workload, len(prompts), args.seed)
        fig = run_workload(target, draft, prompts, budgets, args)
        results[workload] = fig
        print(
            f"{workload:>9}: refill {fig['refill']['tokens_per_s']:8.1f} tok/s "
            f"({fig['refill']['seconds']:.2f} s)   chunks {fig['chunks']['tokens_per_s']:8.1f} "
            f"tok/s ({fig['chunks']['seconds']:.2f} s)   ratio {fig['ratio']:.2f}x",
            flush=True,
        )
    if args.json:
        meta = dict(
            argv=sys.argv[1:] if argv is None else list(argv),
            device=str(jax.devices()[0]),
            platform=platform.platform(),
        )
        write_json(args.json, dict(meta=meta, results=results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
