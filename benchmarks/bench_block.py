"""The bundled block drafter beside the bundled EAGLE-3 head and the bundled draft model, one run.

On the bundled tiny Shakespeare target, on prompts that are passages of the text's held-out tail
(benchmarks/bench_drafters.py's ``head`` prompts): first the cost of one drafting stage
(``decode._draft``: the whole proposal of the batch, forwards and draws) and of one whole step per
drafter (``block:tinyshakespeare-block``, ``eagle3:tinyshakespeare-eagle3``,
``tinyshakespeare-draft``) at the largest ``--n``, jitted, median of 30 calls; then AR at each
``--temperatures``; then asps at each ``--n`` and temperature, and is (K = 2 chains) and is_bv (the
tree ``2,2`` + ``1`` per extra depth) at each ``--n`` at the first temperature (at every one with
``--all-methods``), for each drafter.

Per row: tokens per step (mean over all steps of all runs), wall tokens/s (median of
``--repeats`` compiled runs, compilation excluded), tokens/s over AR's at the same temperature in
the same run.

    python benchmarks/bench_block.py [--quick] [--n 2 4 8] [--temperatures 1 0]
                                     [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
from bench_drafters import run, text_prompts
from harness import fill_quick, median_call_s

import asps_jax
from asps_jax import decode, sampler

BLOCK, HEAD = "block:tinyshakespeare-block", "eagle3:tinyshakespeare-eagle3"

# --quick: one draft length at one temperature, short rows, one timed run.
QUICK = dict(n=[4], temperatures=[1.0], max_new_tokens=32, repeats=1)


def methods(n: int) -> list[tuple[str, dict]]:
    tree = (2, 2) + (1,) * (n - 2)
    return [
        (f"asps n={n}", dict(method="asps", num_draft_tokens=n)),
        (f"is K=2 n={n}", dict(method="is", num_drafts=2, num_draft_tokens=n)),
        (f"is_bv {','.join(map(str, tree))}", dict(method="is_bv", tree=tree)),
    ]


def stage_costs(target, drafter, prompts, max_new_tokens: int, **kw) -> tuple[float, float]:
    """Seconds of one drafting stage and of one whole step of the batch after its prefill."""
    call = sampler.prepare(target, drafter, prompts, key=jax.random.key(0),
                           max_new_tokens=max_new_tokens, eos_token_id=-1, **kw)  # fmt: skip
    dec, args = call.decoder, call.inputs.kwargs()
    tp, dp, sampling = args["target_params"], args["draft_params"], args["sampling"]
    state = jax.jit(decode._prefill, static_argnums=0)(
        dec, tp, dp, args["prompts_BP"], args["prompt_lengths_B"], args["row_keys_B"]
    )
    step = jax.jit(lambda tp, dp, s, st: decode._step(dec, tp, dp, s, st))
    step_s = median_call_s(step, tp, dp, sampling, state)
    if drafter is None:
        return float("nan"), step_s
    draft = jax.jit(lambda dp, s, st: decode._draft(dec, dp, s, st))
    return median_call_s(draft, dp, sampling, state), step_s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--n", nargs="+", type=int, default=[2, 4, 8], help="Draft lengths (default: 2 4 8)."
    )
    p.add_argument(
        "--temperatures",
        nargs="+",
        type=float,
        default=[1.0, 0.0],
        help="Sampling temperatures (default: 1 0).",
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=64, help="Tokens generated per row (default: 64)."
    )
    p.add_argument("--batch", type=int, default=4, help="Prompts (rows) (default: 4).")
    p.add_argument(
        "--chars", type=int, default=400, help="Characters per prompt passage (default: 400)."
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="Timed runs per row, their median (default: 3)."
    )
    p.add_argument("--block", default=BLOCK, help="The block drafter (a draft= string).")
    p.add_argument(
        "--all-methods", action="store_true", help="Run is and is_bv at every temperature."
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"Run a short subset, which fills only the flags left at their defaults: {QUICK}.",
    )
    args = p.parse_args(argv)
    if args.quick:
        fill_quick(p, args, QUICK)
    print(f"load average before: {os.getloadavg()}", flush=True)
    target = asps_jax.load_model("tinyshakespeare-target", dtype="float32")
    draft = asps_jax.load_model("tinyshakespeare-draft", dtype="float32")
    prompts = text_prompts(target.tokenizer, args.batch, args.chars)
    drafters = [("block", args.block), ("eagle3 head", HEAD), ("draft model", draft)]
    common = dict(max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    print(f"One drafting stage / one step of {args.batch} rows, asps, T = 1 (median of 30):")
    print("| drafter | n | drafting stage ms | step ms |")
    print("|---|---:|---:|---:|")
    _, s = stage_costs(target, None, prompts, args.max_new_tokens, method="ar")
    print(f"| - (ar) | 0 | - | {1e3 * s:.2f} |", flush=True)
    for name, drafter in drafters:
        d, s = stage_costs(target, drafter, prompts, args.max_new_tokens, method="asps",
                           num_draft_tokens=max(args.n))  # fmt: skip
        print(f"| {name} | {max(args.n)} | {1e3 * d:.2f} | {1e3 * s:.2f} |", flush=True)
    print("\n| temperature | method | drafter | tokens/step | tokens/s | vs AR |")
    print("|---:|---|---|---:|---:|---:|")
    ar = {}
    for temperature in args.temperatures:
        r = run(target, None, prompts, temperature=temperature, method="ar", **common)
        ar[temperature] = r["tokens_per_s"]
        print(f"| {temperature:g} | ar | - | 1.00 | {ar[temperature]:.1f} | 1.00 |", flush=True)
    # The chains first at every temperature, then the multi-draft rows (at the first only
    # unless --all-methods): the rows most asked for come out first.
    grid = [(t, label, kw) for t in args.temperatures for n in args.n
            for label, kw in methods(n)[:1]]  # fmt: skip
    grid += [(t, label, kw) for t in args.temperatures[: None if args.all_methods else 1]
             for n in args.n for label, kw in methods(n)[1:]]  # fmt: skip
    for temperature, label, kw in grid:
        for name, drafter in drafters:
            r = run(target, drafter, prompts, temperature=temperature, **common, **kw)
            speed = r["tokens_per_s"]
            print(f"| {temperature:g} | {label} | {name} | {r['tokens_per_step']:.2f} | "
                  f"{speed:.1f} | {speed / ar[temperature]:.2f} |", flush=True)  # fmt: skip
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
