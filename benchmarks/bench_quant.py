"""Quantized weights (``load_model(..., quantize=...)``) in one run: AR decode speed and bytes per
token against the memory roofline, and the logit error against full precision.

1. **Speed** (``--shapes``, default the random-weight llama-68m and ~0.5B shapes of
   ``benchmarks/bench_model.py``): per weight format (float32, bfloat16, int8 per channel, int4 per
   group of ``--group``), AR decoding of ``--new-tokens`` tokens after a 4-token prompt (the
   jitted loop compiled ahead of time), median over ``--repeats`` runs: milliseconds per token
   (CPU and wall), the bytes a one-token forward reads (every matrix at its stored width, int4
   at half a byte, plus the scales; the embedding table counts one row) and the roofline: those
   bytes at the read bandwidth of a float32 matrix-vector product of the same size.
2. **Error** (the bundled tinyshakespeare target, upcast to float32 from its bfloat16 checkpoint,
   ``--error-tokens`` corpus tokens in one forward): per format, the largest absolute logit
   difference from float32 and the mean and largest KL(float32 law || quantized law) over the
   positions.

    python benchmarks/bench_quant.py [--shapes 68m 0.5b] [--new-tokens 32] [--repeats 3]
                                     [--group 128] [--json PATH]

``--smoke``: a tiny shape, a few tokens, one repeat (a self-test of the script in seconds).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from bench_model import SHAPES, SMOKE_SHAPE, read_bandwidth
from harness import median_times, write_json

import asps_jax
from asps_jax import decode, sampler
from asps_jax.models import LlamaConfig, Model, quant
from asps_jax.models.base import forward_for, run_params
from asps_jax.models.llama import init_params

ROOT = Path(__file__).resolve().parents[1]


def formats(group: int) -> dict:
    """Name -> how to make the model from float32 weights."""
    return {
        "float32": lambda m: m,
        "bfloat16": lambda m: Model(
            m.name, m.path, m.config, jax.tree.map(lambda a: a.astype(jnp.bfloat16), m.params)
        ),
        "int8": lambda m: quant.quantize_model(m, "int8"),
        f"int4:{group}": lambda m: quant.quantize_model(m, f"int4:{group}"),
    }


def read_bytes(model) -> int:
    """Bytes a one-token forward reads: every leaf at its stored width (int4: half a byte),
    quantized values and their scales; of the embedding table one row (unless tied)."""

    def nbytes(a) -> float:
        bits = jnp.iinfo(a.dtype).bits if jnp.issubdtype(a.dtype, jnp.integer) else None
        return a.size * (bits / 8 if bits else a.dtype.itemsize)

    total = sum(nbytes(a) for a in jax.tree.leaves(model.params))
    if not model.config.tie_word_embeddings:
        embed = model.params["embed"]
        total -= nbytes(embed) - nbytes(embed[0])
    return int(total)


def ar_ms_per_token(model, new_tokens: int, repeats: int) -> tuple[float, float]:
    """(CPU, wall) milliseconds per AR token, the loop compiled ahead of time."""
    prepared = sampler.prepare(
        model,
        None,
        [[1, 2, 3, 4]],
        key=jax.random.key(0),
        max_new_tokens=new_tokens,
        method="ar",
        eos_token_id=-1,
    )
    call = prepared.inputs.kwargs()
    compiled = decode.generate.lower(prepared.decoder, **call).compile()
    cpu, wall = median_times(lambda: jax.block_until_ready(compiled(**call)), repeats)
    return 1e3 * cpu / new_tokens, 1e3 * wall / new_tokens


def speed(shapes: dict, args) -> list[dict]:
    rows = []
    for name, shape in shapes.items():
        config = LlamaConfig(**shape)
        base = Model(name, "", config, init_params(config, jax.random.key(0)))
        float_bytes = read_bytes(base)
        bandwidth_cpu, bandwidth_wall = read_bandwidth(args.repeats, float_bytes)
        for fmt, make in formats(args.group).items():
            model = make(base)
            cpu_ms, wall_ms = ar_ms_per_token(model, args.new_tokens, args.repeats)
            nbytes = read_bytes(model)
            rows.append(
                dict(
                    shape=name,
                    format=fmt,
                    ms_per_token_cpu=cpu_ms,
                    ms_per_token_wall=wall_ms,
                    tokens_per_s=1e3 / wall_ms,
                    mb_per_token=nbytes / 1e6,
                    roofline_ms_cpu=1e3 * nbytes / bandwidth_cpu,
                    roofline_ms_wall=1e3 * nbytes / bandwidth_wall,
                )
            )
            r = rows[-1]
            print(
                f"{name:>5} {fmt:>9} {r['ms_per_token_cpu']:>8.2f} {r['ms_per_token_wall']:>8.2f} "
                f"{r['tokens_per_s']:>7.1f} {r['mb_per_token']:>8.1f} "
                f"{r['roofline_ms_cpu']:>8.2f} {r['roofline_ms_wall']:>8.2f}",
                flush=True,
            )
            del model
    return rows


def error(target, tokens: np.ndarray, group: int) -> list[dict]:
    """Logit error of each format against float32 on ``tokens`` (one forward)."""
    T = tokens.shape[1]
    forward = jax.jit(forward_for(target.config))
    positions = np.arange(T, dtype=np.int32)[None]
    mask = np.tril(np.ones((1, T, T), bool))

    def logits(model):
        out, _ = forward(run_params(model), tokens, positions, mask, None)
        return np.asarray(out, np.float64)[0]

    ref = logits(target)
    log_p = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    rows = []
    for fmt, make in list(formats(group).items())[1:]:
        got = logits(make(target))
        log_q = got - np.logaddexp.reduce(got, axis=-1, keepdims=True)
        kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
        rows.append(
            dict(
                format=fmt,
                max_abs_logit=float(np.abs(got - ref).max()),
                kl_mean=float(kl.mean()),
                kl_max=float(kl.max()),
            )
        )
        r = rows[-1]
        print(
            f"{fmt:>9} {r['max_abs_logit']:>10.4f} {r['kl_mean']:>10.2e} {r['kl_max']:>10.2e}",
            flush=True,
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--shapes",
        nargs="+",
        default=["68m", "0.5b"],
        choices=sorted(SHAPES),
        help="Random-weight shapes of the speed runs, those of benchmarks/bench_model.py "
        "(default: 68m 0.5b; --quick runs a tiny shape instead).",
    )
    p.add_argument(
        "--new-tokens",
        type=int,
        default=32,
        help="AR tokens decoded per speed run, after a 4-token prompt (default: 32).",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="Timed runs per format, reported as their median (default: 3).",
    )
    p.add_argument(
        "--group",
        type=int,
        default=128,
        help="Group size of the int4 format in the speed runs (default: 128); the error runs "
        "use int4:16, as the bundled target's head size of 48 takes groups of 16.",
    )
    p.add_argument(
        "--error-tokens",
        type=int,
        default=128,
        help="Corpus tokens the bundled target scores in one forward for the error runs "
        "(default: 128).",
    )
    p.add_argument(
        "--json", metavar="PATH", help="Also write the speed and error rows as JSON to PATH."
    )
    p.add_argument(
        "--quick",
        "--smoke",
        dest="smoke",
        action="store_true",
        help="Run a tiny shape for a few tokens, once (a self-test; --smoke is the same).",
    )
    args = p.parse_args(argv)
    shapes = {name: SHAPES[name] for name in args.shapes}
    # Its checkpoint is stored in bfloat16: float32 is its exact upcast, so bfloat16's error is
    # that of bfloat16 activations alone.
    target = asps_jax.load_model("tinyshakespeare-target", dtype="float32")
    error_group = 16  # the bundled target's head_dim of 48 takes groups of 16 (or 48)
    if args.smoke:
        shapes = {"smoke": SMOKE_SHAPE}
        args.new_tokens, args.repeats, args.group, args.error_tokens = 4, 1, 32, 16
    print(
        f"{'shape':>5} {'format':>9} {'ms/tok':>8} {'(wall)':>8} {'tok/s':>7} {'MB/tok':>8} "
        f"{'roof ms':>8} {'(wall)':>8}"
    )
    rows = speed(shapes, args)
    text = (ROOT / "data/tinyshakespeare.txt").read_text()[: 16 * args.error_tokens]
    tokens = np.asarray([target.tokenizer.encode(text)[: args.error_tokens]], np.int32)
    print(f"\nlogit error on the bundled target, {tokens.shape[1]} tokens, against float32")
    print(f"{'format':>9} {'max |dz|':>10} {'KL mean':>10} {'KL max':>10}")
    errors = error(target, tokens, error_group)
    if args.json:
        write_json(args.json, dict(speed=rows, error=errors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
