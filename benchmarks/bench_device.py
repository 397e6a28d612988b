"""One-shot accelerator benchmark: a llama-7B-shaped target and a llama-68m-shaped draft with
random weights in bfloat16 (nothing downloaded), each method's decode loop at several batch sizes,
milliseconds per step against the memory roofline, in one run.

For each batch size and method (AR, ASpS n = 4, SpecInfer K = 2 n = 4, TV and IS+BV on the tree
``2,2,1,1``), ``asps_jax.sample``'s whole loop (``Decoder.generate``: prefill + one
``lax.while_loop``) is compiled ahead of time, the loops of one batch size side by side on
``--compile-threads`` threads (each loop's compile time reported apart; on an H200 one loop took
22-45 s alone, which made 15 loops compiled one after another a 9-minute run), then timed over
``--repeats`` runs (median), each row printed and written to ``--json`` as soon as it is
measured. Per run: ms per target step (the loop's wall time over its steps),
the roofline (the target's weight bytes, every parameter but the embedding table, read once per
step, at the read bandwidth measured in the same run by a jitted sum over a buffer of that many
bytes), their ratio, tokens per step and tokens/s. The weights are random and the draft is not
trained against the target, so tokens per step are those of an unrelated draft: the step time
and its distance from the roofline are the figures this script is for.

The device is whatever JAX picks (``JAX_PLATFORMS`` chooses); ``--smoke`` runs tiny shapes (the
test suite runs it on the CPU).

    python benchmarks/bench_device.py [--smoke] [--batches 1,8,32] [--methods ar,asps,...]
                                      [--max-new-tokens M] [--repeats R] [--compile-threads T]
                                      [--json PATH]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from harness import timed_runs, write_json

from asps_jax import decode, sampler
from asps_jax.models import LlamaConfig, llama
from asps_jax.models.base import Model

SHAPES = {
    "7b": dict(  # llama-7B
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
    ),
    "68m": dict(  # llama-68m
        vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=2,
        num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
    ),
    "smoke_target": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    ),
    "smoke_draft": dict(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
    ),
}  # fmt: skip
METHODS = {
    "ar": {},
    "asps": dict(num_draft_tokens=4),
    "specinfer": dict(num_drafts=2, num_draft_tokens=4),
    "tv": dict(tree=(2, 2, 1, 1)),
    "is_bv": dict(tree=(2, 2, 1, 1)),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick",
        "--smoke",
        dest="smoke",
        action="store_true",
        help="Run tiny shapes at batch 2 for 8 new tokens (a self-test; --smoke is the same).",
    )
    p.add_argument(
        "--batches",
        default=None,
        help="Comma-separated batch sizes (default: 1,8,32; 2 with --quick).",
    )
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"Comma-separated methods, from {', '.join(METHODS)} (default: all of them).",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="Tokens generated per row, EOS off (default: 64; 8 with --quick).",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=32,
        help="Length of the random prompts in tokens (default: 32).",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="Timed runs per setting, reported as their median (default: 3).",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="Seed of the prompts and the sampling (default: 0)."
    )
    p.add_argument(
        "--compile-threads",
        type=int,
        default=min(os.cpu_count() or 1, 8),
        help="Loops of one batch size compiled at once (default: the CPU count, at most 8).",
    )
    p.add_argument(
        "--json", default=None, help="Also write the rows as JSON to this file, after each row."
    )
    return p


def random_model(shape: dict, dtype, name: str) -> Model:
    """A Llama of ``shape`` (LlamaConfig fields) with random weights (N(0, 0.02), made on the
    device)."""
    config = LlamaConfig(**shape)
    params = llama.init_params(config, jax.random.key(len(name)), dtype)
    return Model(name=f"random-{name}", path="", config=config, params=params)


def weight_bytes(model: Model) -> int:
    """The bytes a one-token step reads: every parameter but the embedding table."""
    leaves = jax.tree_util.tree_leaves_with_path(model.params)
    return sum(x.nbytes for path, x in leaves if "embed" not in jax.tree_util.keystr(path))


def read_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes per second of a jitted sum over a bfloat16 buffer of ``nbytes`` (median)."""
    buf = jnp.ones((max(nbytes // 2, 1024),), jnp.bfloat16)
    total = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    jax.block_until_ready(total(buf))
    times = []
    for _ in range(max(repeats, 3)):
        start = time.perf_counter()
        jax.block_until_ready(total(buf))
        times.append(time.perf_counter() - start)
    return buf.nbytes / float(np.median(times))


def prepare(target, draft, prompts, method: str, args):
    return sampler.prepare(
        target, None if method == "ar" else draft, prompts, key=jax.random.key(args.seed),
        max_new_tokens=args.max_new_tokens, method=method, eos_token_id=-1, **METHODS[method],
    )  # fmt: skip


def compile_all(programs: dict, threads: int) -> dict:
    """``{name: (compiled loop, compile seconds)}`` of ``{name: prepared}``: each whole loop
    traced in turn (Python), then compiled by XLA on ``threads`` threads at once (XLA's compiler
    runs outside the interpreter lock, so the programs compile side by side). A program's seconds
    are from its compile's start to its end, so they overlap."""
    lowered = {
        name: decode.generate.lower(prepared.decoder, **prepared.inputs.kwargs())
        for name, prepared in programs.items()
    }

    def compile_one(name):
        start = time.perf_counter()
        return name, (lowered[name].compile(), time.perf_counter() - start)

    with concurrent.futures.ThreadPoolExecutor(max(threads, 1)) as pool:
        return dict(pool.map(compile_one, lowered))


def run(prepared, compiled, compile_s: float, method: str, args) -> dict:
    state, _, _, times = timed_runs(prepared, args.repeats, compiled)
    stats = jax.device_get(sampler.summarize_stats(state, prepared.batch))
    wall = float(np.median(times))
    steps = max(int(np.max(stats["target_calls"])), 1)
    tokens = int(np.asarray(state.num_generated)[: prepared.batch].sum())
    return dict(
        method=method, batch=prepared.batch, compile_s=compile_s, wall_s=wall, steps=steps,
        ms_per_step=1e3 * wall / steps, tokens_per_step=tokens / prepared.batch / steps,
        tokens_per_s=tokens / wall,
    )  # fmt: skip


def markdown(rows: list[dict], roofline_ms: float) -> str:
    lines = [
        "| batch | method | ms / step | roofline ms | step / roofline | tokens / step | tokens/s "
        "| compile s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['method']} | {r['ms_per_step']:.2f} | {roofline_ms:.2f} | "
            f"{r['ms_per_step'] / roofline_ms:.2f} | {r['tokens_per_step']:.2f} | "
            f"{r['tokens_per_s']:.0f} | {r['compile_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        print(f"bench_device: unknown method(s) {unknown}; choose from {list(METHODS)}")
        return 2
    default_batches = "2" if args.smoke else "1,8,32"
    batches = [int(b) for b in (args.batches or default_batches).split(",")]
    if args.max_new_tokens is None:
        args.max_new_tokens = 8 if args.smoke else 64
    names = ("smoke_target", "smoke_draft") if args.smoke else ("7b", "68m")
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}", flush=True)
    start = time.perf_counter()
    target, draft = (random_model(SHAPES[name], dtype, name) for name in names)
    nbytes = weight_bytes(target)
    bandwidth = read_bandwidth(nbytes, args.repeats)
    roofline_ms = 1e3 * nbytes / bandwidth
    print(
        f"target {names[0]}: {nbytes / 1e9:.2f} GB of weights read per step; measured read "
        f"bandwidth {bandwidth / 1e9:.0f} GB/s; roofline {roofline_ms:.2f} ms per step",
        flush=True,
    )
    meta = dict(
        device=device.device_kind, platform=device.platform, host=platform.node(),
        jax=jax.__version__, weight_bytes=nbytes, bandwidth=bandwidth, roofline_ms=roofline_ms,
        shapes=names, max_new_tokens=args.max_new_tokens, compile_threads=args.compile_threads,
    )  # fmt: skip
    rng = np.random.default_rng(args.seed)
    rows = []
    for batch in batches:
        prompts = rng.integers(0, target.vocab_size, (batch, args.prompt_tokens)).tolist()
        programs = {m: prepare(target, draft, prompts, m, args) for m in methods}
        started = time.perf_counter()
        compiled = compile_all(programs, args.compile_threads)
        print(
            f"batch {batch}: {len(programs)} loops compiled in "
            f"{time.perf_counter() - started:.1f} s on {args.compile_threads} threads",
            flush=True,
        )
        for method, prepared in programs.items():
            rows.append(run(prepared, *compiled[method], method, args))
            print(markdown(rows[-1:], roofline_ms).splitlines()[-1], flush=True)
            if args.json:  # after every row: a run cut short keeps what it measured
                write_json(args.json, dict(meta=meta, rows=rows))
    print(markdown(rows, roofline_ms))
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
