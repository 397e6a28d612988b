"""Drafters and stopping rules, same run each: prompt lookup vs the draft model vs AR on a
copy-heavy task, and confidence-stopped vs fixed-n chains at the realistic cost ratio.

``copy`` (the bundled tiny Shakespeare pair): each prompt quotes a passage of
data/tinyshakespeare.txt, a blank line, then the passage's first quarter again; the model is asked
to go on (a continuation of text seen in the prompt). Rows: AR, the draft model (asps, n), prompt
lookup (asps, n, ``lookup_ngram``), at each ``--temperatures``.

``stop`` (the ~0.5B / llama-68m-shaped random pair of benchmarks/bench_cost_ratio.py, its
checkpoints): AR, asps at fixed n, and asps at n_max with ``draft_stop="confidence:τ"`` for each
``--taus``, random prompts as there.

``head`` (the bundled tiny Shakespeare target): the bundled EAGLE-3 head
(``eagle3:tinyshakespeare-eagle3``) against the bundled draft model, ``self:2`` and prompt lookup,
for asps at each ``--n``, is with K = 2 chains and is_bv on the tree ``2,2,1,1``, at each
``--temperatures``, on prompts that are passages of the text's held-out tail; then each drafter's
cost per draft token (one drafting forward of the batch) against the target's one-token forward.

Per row: tokens per step (mean over all steps of all runs), wall tokens/s (median of
``--repeats`` compiled runs, compilation excluded), the draft tokens verified per step.

    python benchmarks/bench_drafters.py copy [--n 4] [--temperatures 0 1] [--max-new-tokens 64]
    python benchmarks/bench_drafters.py stop [--n 4 8] [--taus 0.3 0.5 0.7] [--max-new-tokens 32]
    python benchmarks/bench_drafters.py head [--n 4 8] [--temperatures 1 0.7] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from harness import median_call_s

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


HEAD = "eagle3:tinyshakespeare-eagle3"


def text_prompts(tokenizer, count: int, chars: int) -> list[list[int]]:
    """Passages of the last 5 % of the text (the held-out tail of the head's training)."""
    text = (ROOT / "data" / "tinyshakespeare.txt").read_text()
    tail = text[len(text) - len(text) // 20 :]
    rng = np.random.default_rng(1)
    prompts = []
    for start in rng.integers(0, len(tail) - chars, count):
        passage = tail[start : start + chars]
        prompts.append(tokenizer.encode(passage[passage.find("\n") + 1 :]))
    return prompts


def draft_costs(target, draft, rows: int, slots: int) -> dict:
    """Seconds of one drafting forward of ``rows`` rows over ``slots`` cached positions: the
    target's one-token forward, the draft model's, ``self:2``'s (two target layers) and the
    head's one entry (each jitted, median of 30 calls)."""
    from asps_jax import kv_cache
    from asps_jax.drafters import draft_model
    from asps_jax.drafters import head as head_lib
    from asps_jax.models.base import run_params

    def model_cost(model):
        config, params = model.config, run_params(model)
        cache = kv_cache.init_cache(config, rows, slots, jax.tree.leaves(params)[0].dtype,
                                    per_layer=kv_cache.per_layer_params(params))  # fmt: skip
        cache = dataclasses.replace(cache, lengths=jnp.full((rows,), slots - 1, jnp.int32))
        tokens, positions = jnp.ones((rows, 1), jnp.int32), jnp.full((rows, 1), slots - 1)
        mask = jnp.ones((rows, 1, slots + 1), bool)
        fn = jax.jit(lambda p, c: model.forward(p, tokens, positions, mask, c)[0])
        return median_call_s(fn, params, cache)

    head = draft_model(target, HEAD)
    c = head.config
    cache = kv_cache.init_cache(c, rows, slots, head.params["wq"].dtype)
    cache = dataclasses.replace(cache, lengths=jnp.full((rows,), slots - 1, jnp.int32))
    hidden = jnp.zeros((rows, 1, c.hidden_size), head.params["wq"].dtype)
    tokens, positions = jnp.ones((rows, 1), jnp.int32), jnp.full((rows, 1), slots - 1)
    mask = jnp.ones((rows, 1, slots + 1), bool)
    head_fn = jax.jit(
        lambda p, cache: head_lib.target_logits(
            p, head_lib.forward(c, p, hidden, tokens, positions, mask, cache)[0], c.vocab_size
        )
    )
    return {
        "target": model_cost(target),
        "draft model": model_cost(draft),
        "self:2": model_cost(draft_model(target, "self:2")),
        "eagle3 head": median_call_s(head_fn, head.params, cache),
    }


def bench_head(args) -> None:
    target = asps_jax.load_model("tinyshakespeare-target", dtype="float32")
    draft = asps_jax.load_model("tinyshakespeare-draft", dtype="float32")
    prompts = text_prompts(target.tokenizer, args.batch, args.chars)
    common = dict(max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    drafters = [("eagle3 head", HEAD), ("draft model", draft), ("self:2", "self:2"),
                ("lookup", "lookup")]  # fmt: skip
    print("| temperature | method | drafter | tokens/step | tokens/s | drafted/step |")
    print("|---:|---|---|---:|---:|---:|")
    for temperature in args.temperatures:
        r = run(target, None, prompts, temperature=temperature, method="ar", **common)
        print(f"| {temperature:g} | ar | - | 1.00 | {r['tokens_per_s']:.1f} | 0 |", flush=True)
        methods = [(f"asps n={n}", dict(method="asps", num_draft_tokens=n)) for n in args.n]
        methods += [("is K=2 n=4", dict(method="is", num_drafts=2, num_draft_tokens=4)),
                    ("is_bv 2,2,1,1", dict(method="is_bv", tree=(2, 2, 1, 1)))]  # fmt: skip
        for label, kw in methods:
            for name, drafter in drafters:
                if drafter == "lookup" and "tree" in kw:  # point-mass chains: no tree methods
                    continue
                r = run(target, drafter, prompts, temperature=temperature, **common, **kw)
                print(f"| {temperature:g} | {label} | {name} | {r['tokens_per_step']:.2f} | "
                      f"{r['tokens_per_s']:.1f} | {r['drafted_per_step']:.2f} |",
                      flush=True)  # fmt: skip
    slots = max(len(p) for p in prompts) + args.max_new_tokens
    costs = draft_costs(target, draft, args.batch, slots)
    print(f"\nOne drafting forward of {args.batch} rows over {slots} positions (median of 30):")
    print("| forward | ms | x the target's |")
    print("|---|---:|---:|")
    for name, seconds in costs.items():
        print(f"| {name} | {1e3 * seconds:.2f} | {seconds / costs['target']:.2f} |")


def bench_stop(args) -> None:
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
    p.add_argument(
        "task",
        choices=("copy", "stop", "head"),
        help="Benchmark to run: copy = AR, the draft model and prompt lookup on a copy-heavy "
        "task (the bundled tiny Shakespeare pair); stop = AR, asps at fixed n and "
        "confidence-stopped asps chains at the realistic cost ratio (the random ~0.5B / "
        "llama-68m pair of benchmarks/bench_cost_ratio.py); head = the bundled EAGLE-3 head beside "
        "the draft model, self:2 and prompt lookup on the bundled target, then each drafter's "
        "cost per draft token.",
    )
    p.add_argument(
        "--n",
        nargs="+",
        type=int,
        default=None,
        help="Draft lengths n (default: 4 for copy, 4 8 for stop and head); the "
        "confidence-stopped chains of stop draft up to the largest.",
    )
    p.add_argument(
        "--temperatures",
        nargs="+",
        type=float,
        default=None,
        help="Sampling temperatures of copy and head (default: 0 1 for copy, 1 0.7 for head; "
        "stop samples at 1).",
    )
    p.add_argument(
        "--taus",
        nargs="+",
        type=float,
        default=[0.3, 0.5, 0.7],
        help='Thresholds τ of stop\'s draft_stop="confidence:τ" chains (default: 0.3 0.5 0.7).',
    )
    p.add_argument(
        "--ngram",
        type=int,
        default=3,
        help="N-gram length m of copy's prompt lookup, lookup_ngram (default: 3).",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=4,
        help="Prompts decoded together in copy and head (default: 4; stop runs one row).",
    )
    p.add_argument(
        "--chars",
        type=int,
        default=400,
        help="Characters of corpus text each prompt of copy and head is cut from (default: 400).",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="Tokens generated per row, EOS off (default: 64 for copy and head, 32 for stop).",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="Timed runs per row after compilation; tokens/s is their median (default: 2).",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="A small run, overriding --n, --temperatures, --taus, --batch, --chars and "
        "--repeats: n = 4, temperature 0 (1 for head), τ = 0.5, 2 rows of 200-character "
        "passages, one timed run.",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.temperatures, args.taus = [4], [0.0], [0.5]
        args.batch, args.chars, args.repeats = 2, 200, 1
    if args.task == "head":
        args.temperatures = args.temperatures or [1.0, 0.7]
        args.n = args.n or [4, 8]
        args.max_new_tokens = args.max_new_tokens or 64
        if args.quick:
            args.temperatures = [1.0]
        bench_head(args)
    elif args.task == "copy":
        args.temperatures = args.temperatures or [0.0, 1.0]
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
