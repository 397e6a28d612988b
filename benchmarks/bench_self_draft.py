"""Drafts from the target itself (``draft="self:L"``, ``draft="quant:int8"``) beside the draft model
and AR, in one run.

``--pair bundled`` (default): the bundled tinyshakespeare pair (target: 4 layers; draft: its own
small checkpoint), prompts of ``--prompt-tokens`` consecutive corpus tokens (one starting line per
row). ``--pair random-0.5b``: the random-weight ~0.5B-shaped target and llama-68m-shaped draft of
``benchmarks/bench_cost_ratio.py`` (8 layers; acceptance there says how the *random* construction's
layers perturb the logits, not what a trained model gives), tokens per step only unless
``--repeats`` > 0.

Per configuration (AR; each of ``--methods``, default SpS and ASpS, with the draft model, with
``self:L`` for each ``--layers`` L and with the target's quantized copy ``quant:S`` for each
``--quant`` scheme S, e.g. ``int8 int4:16``; ``--drafts K`` chains), the jitted
``decode.generate`` loop runs compiled ahead of time (compilation reported apart), EOS off,
temperature 1: tokens per step (mean over all steps of all rows, with its standard error),
token-level acceptance, wall tokens/s and CPU tokens/s (medians of ``--repeats`` runs).

    python benchmarks/bench_self_draft.py [--pair bundled|random-0.5b] [--layers 1 2 3] [--n 4]
                                          [--quant int8 int4:16] [--drafts 1] [--batch-size 4]
                                          [--max-new-tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
from harness import write_json

import asps_jax
from asps_jax import decode, drafters, sampler

ROOT = Path(__file__).resolve().parents[1]


def _prompts(tokenizer, vocab: int, batch: int, length: int) -> list[list[int]]:
    lines = [line for line in (ROOT / "data/tinyshakespeare.txt").read_text().splitlines() if line]
    text = "\n".join(lines)
    out = []
    for b in range(batch):
        start = text.index(lines[1 + 37 * b])
        ids = tokenizer.encode(text[start : start + 8 * length]) if tokenizer else None
        if ids is None:
            ids = [c % vocab for c in text[start : start + length].encode()]
        out.append(ids[:length])
    return out


def run(target, draft, prompts, method, args) -> dict:
    def prepare(seed):
        return sampler.prepare(
            target,
            None if method == "ar" else draft,
            prompts,
            key=jax.random.key(seed),
            max_new_tokens=args.max_new_tokens,
            method=method,
            num_draft_tokens=args.n,
            num_drafts=None if method == "ar" else args.drafts,
            eos_token_id=-1,
        )

    prepared = prepare(args.seed)
    batch, decoder, call = prepared.batch, prepared.decoder, prepared.inputs.kwargs()
    start = time.perf_counter()
    compiled = decode.generate.lower(decoder, **call).compile()
    compile_s = time.perf_counter() - start
    states, wall, cpu = [], [], []
    for i in range(max(args.repeats, 1)):
        keys = prepare(args.seed + 1 + i).inputs.row_keys_B
        w, c = time.perf_counter(), time.process_time()
        states.append(jax.block_until_ready(compiled(**dict(call, row_keys_B=keys))))
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    hist = sum(np.asarray(sampler.summarize_stats(s, batch)["emitted_hist"]).sum(0) for s in states)
    sizes = np.arange(hist.shape[0], dtype=np.float64)
    steps = hist.sum()
    atn = float((sizes * hist).sum() / steps)
    se = math.sqrt(float(((sizes - atn) ** 2 * hist).sum() / max(steps - 1, 1)) / steps)
    stats = [sampler.summarize_stats(s, batch) for s in states]
    accepted = sum(float(np.asarray(s["accepted"]).sum()) for s in stats)
    decisions = sum(float(np.asarray(s["decisions"]).sum()) for s in stats)
    tokens = int(np.asarray(states[-1].num_generated)[:batch].sum())
    return dict(
        method=method,
        draft="-" if method == "ar" else draft.name,
        tokens_per_step=atn,
        tokens_per_step_se=se,
        acceptance=accepted / decisions if decisions else float("nan"),
        compile_s=compile_s,
        tokens_per_s=tokens / statistics.median(wall) if args.repeats else float("nan"),
        tokens_per_cpu_s=tokens / statistics.median(cpu) if args.repeats else float("nan"),
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--pair",
        choices=("bundled", "random-0.5b"),
        default="bundled",
        help="Target and draft model: bundled = the bundled tinyshakespeare pair, random-0.5b = "
        "the random ~0.5B / llama-68m pair of benchmarks/bench_cost_ratio.py (default: bundled).",
    )
    p.add_argument(
        "--layers",
        type=int,
        nargs="+",
        default=None,
        help="Layers L of the self:L drafts (default: every L from 1 to the target's layer "
        "count minus 1).",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        default=["sps", "asps"],
        help="Methods run with each draft (default: sps asps).",
    )
    p.add_argument("--n", type=int, default=4, help="Draft tokens per step (default: 4).")
    p.add_argument("--drafts", type=int, default=1, help="Draft chains K per step (default: 1).")
    p.add_argument(
        "--quant",
        nargs="*",
        default=[],
        help="Schemes S of the quant:S drafts, e.g. int8 int4:16 (default: none).",
    )
    p.add_argument(
        "--batch-size", type=int, default=4, help="Prompts decoded together (default: 4)."
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=128,
        help="Tokens generated per row, EOS off (default: 128).",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=32,
        help="Prompt length in tokens, consecutive corpus text per row (default: 32).",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="Timed runs per configuration, reported as their median (default: 3); 0 gives "
        "tokens per step only, from one untimed run, and leaves out the AR row.",
    )
    p.add_argument("--seed", type=int, default=0, help="Seed of the sampling (default: 0).")
    p.add_argument("--json", metavar="PATH", help="Also write the rows as JSON to PATH.")
    p.add_argument(
        "--quick", action="store_true", help="A small run: self:2 with asps, 32 tokens, timed once."
    )
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.methods, args.max_new_tokens, args.repeats = [2], ["asps"], 32, 1
    if args.pair == "bundled":
        target = asps_jax.load_model("tinyshakespeare-target")
        draft = asps_jax.load_model("tinyshakespeare-draft")
    else:
        from bench_cost_ratio import CHECKPOINTS, DRAFT, TARGET, checkpoint_pair

        # The checkpoints bench_cost_ratio.py writes once (and reuses): loading them needs a
        # fraction of the memory of building the random pair in this process.
        paths = checkpoint_pair((TARGET, DRAFT), 0.2, 0.07, 0, CHECKPOINTS / "bench_cost_ratio")
        target, draft = (asps_jax.load_model(str(path), dtype="float32") for path in paths)
    layers = args.layers or list(range(1, target.config.num_hidden_layers))
    prompts = _prompts(target.tokenizer, target.vocab_size, args.batch_size, args.prompt_tokens)
    # AR only when timed: its tokens per step is 1.
    configs = [("ar", None)] * (args.repeats > 0) + [(m, draft) for m in args.methods]
    configs += [
        (m, drafters.draft_model(target, f"self:{L}")) for L in layers for m in args.methods
    ]
    configs += [
        (m, drafters.draft_model(target, f"quant:{S}")) for S in args.quant for m in args.methods
    ]
    rows = []
    print(
        f"{'method':>7} {'draft':>34} {'tok/step':>14} {'accept':>7} {'tok/s':>8} {'tok/cpu-s':>9}"
    )
    for method, d in configs:
        r = run(target, d, prompts, method, args)
        rows.append(r)
        print(
            f"{r['method']:>7} {r['draft']:>34} {r['tokens_per_step']:>7.3f} ± "
            f"{r['tokens_per_step_se']:.3f} {r['acceptance']:>7.3f} {r['tokens_per_s']:>8.1f} "
            f"{r['tokens_per_cpu_s']:>9.1f}",
            flush=True,
        )
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
