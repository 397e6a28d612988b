"""The JAX Llama port beside transformers (PyTorch) and beside the memory roofline, in one run.

For each shape, a model with random weights is written by transformers, loaded by
``asps_jax.load_model`` and timed, ours and theirs in the same process, in CPU time
(``time.process_time``: all threads of this process) and wall time, medians of ``--repeats``:

* prefill: ``--prefix`` tokens in one forward;
* decode: the one-token forward against a cached prefix of ``--prefix`` tokens;
* chain{w} for each w of ``--widths`` (default 2, 5, 9, 17): scoring a w-node chain (root + w - 1
  draft tokens) against that prefix, the target call of one SpS step with n = w - 1;
* ar_token: autoregressive sampling (temperature 1, no top-k/top-p, no EOS) of ``--ar-tokens``
  tokens after a 4-token prompt, per token: ours is the jitted ``decode.generate`` loop (method
  ``ar``), theirs ``generate(do_sample=True)``.

Ours runs each forward workload on both run layouts of the weights (``llama.prepare_params``):
``[out, in]``, the one-row layout (what the draft and AR at batch 1 run on), and ``[in, out]``,
the wide one (what the target runs on when it scores a chain or a tree); ``k`` is a row's time
over the one-token forward's on the one-row layout, the cost of a chain in one-token forwards
(``k_n`` of ``bench_cost_ratio.py``). transformers has one layout: its figure is the same on both
rows.

Roofline: a one-token step must read every weight once (all parameters except the embedding
table, of which it gathers one row; a tied head counts once). Its time is those bytes divided by
the read bandwidth of a float32 matrix-vector product over a matrix of the *same* number of bytes,
measured by XLA in the same run (CPU and wall separately): the rate depends on the bytes read
(a server's last-level cache can hold a good part of a 174 MB model; 98 MB read at 23 GB per CPU
second here, 393 MB at 16). ``roofline/ours`` is the fraction of that bound a workload reaches.

Shapes: ``68m`` (llama-68m: hidden 768, 2 layers, 12 heads, MLP 3072, vocab 32000) and ``0.5b``
(hidden 2048, 8 layers, 16 heads, MLP 5632, vocab 32000: 0.54B parameters, 2.2 GB in float32).

    python benchmarks/bench_model.py [--shapes 68m,0.5b] [--widths 2,5,9,17] [--repeats R]
                                     [--ar-tokens M] [--json PATH]
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
from harness import median_times, skip_hf, write_json

from asps_jax import decode, sampler
from asps_jax.kv_cache import commit, init_cache
from asps_jax.models import LlamaConfig, llama, load_model
from asps_jax.models.base import Model, run_params
from asps_jax.scoring import score_chain, score_tree
from asps_jax.trees import build_chain_tree

SHAPES = {
    "68m": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=2,
        num_attention_heads=12,
        num_key_value_heads=12,
        max_position_embeddings=2048,
    ),
    "0.5b": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=2048,
    ),
}
# --smoke: a tiny shape so that tests can run the whole script in seconds.
SMOKE_SHAPE = dict(
    SHAPES["68m"],
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
)
AR_PROMPT = 4


def read_bandwidth(repeats: int, nbytes: int) -> tuple[float, float]:
    """Bytes per CPU second and per wall second of a jitted float32 ``x @ W`` over a ``W`` of
    about ``nbytes`` bytes."""
    rows = 4096
    cols = max(nbytes // (4 * rows), 1)
    w = jax.random.normal(jax.random.key(0), (rows, cols), jnp.float32)
    x = jnp.ones((1, rows), jnp.float32)
    gemv = jax.jit(lambda x, w: x @ w)
    cpu, wall = median_times(lambda: jax.block_until_ready(gemv(x, w)), max(repeats, 5), 2)
    return w.nbytes / cpu, w.nbytes / wall


def weight_bytes(model) -> int:
    """Bytes a one-token forward reads: every parameter but the embedding table (one row)."""
    total = sum(a.nbytes for a in jax.tree.leaves(model.params))
    if model.config.tie_word_embeddings:
        return total
    return total - model.params["embed"].nbytes


def _call(f, *args):
    """``f(*args)``, waited for, as a function of nothing."""
    return lambda: jax.block_until_ready(f(*args))


# Our two run layouts (``llama.prepare_params``): name -> ``wide``.
LAYOUTS = {"[out, in]": False, "[in, out]": True}


def _ours(model, tokens: np.ndarray, widths, repeats: int) -> dict:
    """``{(workload, layout): (CPU s, wall s)}`` of each forward workload on each run layout."""
    B, P = tokens.shape
    fwd = model.forward
    cache0 = init_cache(model.config, B, P + max(widths), jnp.float32, per_layer=True)  # decode's

    @jax.jit
    def prefill(params, cache, toks):
        logits, kv = score_chain(fwd, params, cache, toks, jnp.ones(toks.shape, bool))
        nodes = jnp.broadcast_to(jnp.arange(toks.shape[1], dtype=jnp.int32), toks.shape)
        return logits, commit(cache, kv, nodes, jnp.full((B,), toks.shape[1], jnp.int32))

    one_token = jax.jit(lambda p, c, t: score_chain(fwd, p, c, t, jnp.ones(t.shape, bool)))

    def chain(width):
        tree = build_chain_tree(1, width - 1)
        return jax.jit(lambda p, c, t: score_tree(fwd, p, c, t, tree, jnp.ones(t.shape, bool)))

    toks = jnp.asarray(tokens)
    times = {}
    for layout, wide in LAYOUTS.items():
        params = run_params(model, wide=wide)
        _, cache = prefill(params, cache0, toks)
        run = {
            "prefill": _call(prefill, params, cache0, toks),
            "decode": _call(one_token, params, cache, toks[:, :1]),
        }
        run.update({f"chain{w}": _call(chain(w), params, cache, toks[:, :w]) for w in widths})
        times.update({(name, layout): median_times(fn, repeats) for name, fn in run.items()})
    return times


def _ours_ar(model, prompt: np.ndarray, new_tokens: int, repeats: int) -> tuple[float, float]:
    prepared = sampler.prepare(
        model,
        None,
        prompt,
        key=jax.random.key(0),
        max_new_tokens=new_tokens,
        method="ar",
        eos_token_id=-1,
    )
    call = prepared.inputs.kwargs()  # the decoder is static: the compiled program takes these
    compiled = decode.generate.lower(prepared.decoder, **call).compile()

    def run():
        state = jax.block_until_ready(compiled(**call))
        assert int(state.num_generated[0]) == new_tokens

    cpu, wall = median_times(run, repeats)
    return cpu / new_tokens, wall / new_tokens


def _torch(hf, tokens: np.ndarray, widths, repeats: int) -> dict[str, tuple[float, float]]:
    import torch

    P = tokens.shape[1]
    ids = torch.as_tensor(tokens, dtype=torch.long)

    with torch.no_grad():
        cache = hf(ids, use_cache=True).cache

        def step(t):
            hf(ids[:, :t], cache=cache, use_cache=True)
            cache.crop(-t)  # back to the prefix, so every call sees the same cache
            assert cache.get_seq_length() == P

        run = {"prefill": lambda: hf(ids, use_cache=True), "decode": lambda: step(1)}
        run.update({f"chain{w}": lambda w=w: step(w) for w in widths})
        return {name: median_times(fn, repeats) for name, fn in run.items()}


def _torch_ar(hf, prompt: np.ndarray, new_tokens: int, repeats: int) -> tuple[float, float]:
    import torch

    ids = torch.as_tensor(prompt, dtype=torch.long)
    kwargs = dict(
        do_sample=True,
        top_k=0,
        top_p=1.0,
        temperature=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=0,
    )

    def run():
        with torch.no_grad():
            out = hf.generate(ids, **kwargs)
        assert out.shape[1] == prompt.shape[1] + new_tokens

    cpu, wall = median_times(run, repeats)
    return cpu / new_tokens, wall / new_tokens


def _random_pair(name: str, shape: dict, args):
    """``(transformers model or None, our model)`` of ``shape`` with the same random weights: the
    transformers model written and loaded through our loader; without torch (``args.no_hf``) our
    model alone, initialised on the device."""
    if args.no_hf:
        config = LlamaConfig.from_hf(shape)
        params = llama.init_params(config, jax.random.key(args.seed), jnp.float32)
        return None, Model(name=f"random-{name}", path="", config=config, params=params)
    import torch
    import transformers

    torch.manual_seed(args.seed)
    hf_config = transformers.LlamaConfig(**shape)
    hf_config._attn_implementation = args.torch_attn
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        return hf, load_model(tmp)


def bench_shape(name: str, shape: dict, args) -> list[dict]:
    hf, model = _random_pair(name, shape, args)
    rng = np.random.default_rng(args.seed)
    tokens = rng.integers(0, shape["vocab_size"], (args.batch_size, args.prefix)).astype(np.int32)
    nbytes = weight_bytes(model)
    bandwidth = read_bandwidth(args.repeats, nbytes)
    ours = _ours(model, tokens, args.widths, args.repeats)
    none = (None, None)
    theirs = defaultdict(lambda: none)
    if hf is not None:
        theirs = _torch(hf, tokens, args.widths, args.repeats)
    n_tokens = {"prefill": args.prefix, "decode": 1} | {f"chain{w}": w for w in args.widths}
    workloads = [(name, layout) for name in n_tokens for layout in LAYOUTS]
    if args.ar_tokens > 0:
        prompt = tokens[:, :AR_PROMPT]
        ours["ar_token", None] = _ours_ar(model, prompt, args.ar_tokens, args.repeats)
        if hf is not None:
            theirs["ar_token"] = _torch_ar(hf, prompt, args.ar_tokens, args.repeats)
        n_tokens["ar_token"] = 1
        workloads.append(("ar_token", None))
    roof_cpu, roof_wall = nbytes / bandwidth[0], nbytes / bandwidth[1]
    one_token = ours["decode", "[out, in]"][0]
    rows = []
    for workload, layout in workloads:
        n = n_tokens[workload]
        (o_cpu, o_wall), (t_cpu, t_wall) = ours[workload, layout], theirs[workload]
        one_step = workload in ("decode", "ar_token")
        torch_ran = t_cpu is not None
        rows.append(
            dict(
                shape=name,
                workload=workload,
                layout=layout or "auto",
                tokens=n,
                ours_ms=1e3 * o_cpu,
                ours_wall_ms=1e3 * o_wall,
                k=o_cpu / one_token,
                torch_ms=1e3 * t_cpu if torch_ran else None,
                torch_wall_ms=1e3 * t_wall if torch_ran else None,
                ours_tok_s=args.batch_size * n / o_cpu,
                torch_tok_s=args.batch_size * n / t_cpu if torch_ran else None,
                speedup=t_cpu / o_cpu if torch_ran else None,
                speedup_wall=t_wall / o_wall if torch_ran else None,
                roofline_ms=1e3 * roof_cpu if one_step else None,
                roofline_wall_ms=1e3 * roof_wall if one_step else None,
                ours_of_roofline=roof_cpu / o_cpu if one_step else None,
                ours_of_roofline_wall=roof_wall / o_wall if one_step else None,
                torch_of_roofline=roof_cpu / t_cpu if one_step and torch_ran else None,
                weight_mb=nbytes / 1e6,
                bandwidth_cpu_gb_s=bandwidth[0] / 1e9,
                bandwidth_wall_gb_s=bandwidth[1] / 1e9,
            )
        )
    del hf, model
    return rows


def _fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes",
        default="68m,0.5b",
        help=f"Comma-separated shapes, from {', '.join(SHAPES)} (default: 68m,0.5b; --quick runs "
        "a tiny shape instead).",
    )
    parser.add_argument(
        "--prefix",
        type=int,
        default=128,
        help="Prefill length and cached prefix length in tokens, at least the widest chain "
        "(default: 128).",
    )
    parser.add_argument("--batch-size", type=int, default=1, help="Rows per call (default: 1).")
    parser.add_argument(
        "--widths",
        default="2,5,9,17",
        help="Comma-separated chain widths in tokens to score against the prefix, each at most "
        "--prefix (default: 2,5,9,17).",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="Calls per figure, reported as their median (default: 5).",
    )
    parser.add_argument(
        "--ar-tokens",
        type=int,
        default=None,
        help="AR tokens sampled per run, 0 to skip the ar_token workload (default: 128; 16 at "
        "0.5b; 0 with --quick).",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="Seed of the random weights and of the prompt tokens (default: 0).",
    )
    parser.add_argument(
        "--torch-attn",
        default="sdpa",
        choices=["sdpa", "eager"],
        help="Attention implementation of transformers (default: sdpa).",
    )
    parser.add_argument(
        "--torch-threads", type=int, default=1, help="Torch intra-op threads (default: 1)."
    )
    parser.add_argument(
        "--quick",
        "--smoke",
        dest="smoke",
        action="store_true",
        help="Run a tiny model (a self-test; --smoke is the same).",
    )
    parser.add_argument("--json", metavar="PATH", help="Also write the results as JSON to PATH.")
    args = parser.parse_args(argv)
    try:
        args.widths = sorted({int(w) for w in args.widths.split(",")})
    except ValueError:
        parser.error(f"--widths: comma-separated integers, got {args.widths!r}")
    if args.widths[0] < 2 or args.prefix < args.widths[-1]:
        parser.error("--widths must be >= 2 and at most --prefix")
    if args.batch_size < 1 or args.repeats < 1:
        parser.error("--batch-size and --repeats must be >= 1")
    shapes = {"smoke": SMOKE_SHAPE} if args.smoke else {}
    if not args.smoke:
        for name in args.shapes.split(","):
            if name not in SHAPES:
                parser.error(f"--shapes: unknown shape {name!r}; known: {', '.join(SHAPES)}")
            shapes[name] = SHAPES[name]
    ar_default = args.ar_tokens

    args.no_hf = skip_hf("bench_model", False, flag=False)
    if not args.no_hf:
        import torch

        torch.set_num_threads(args.torch_threads)
    torch_about = (
        "no torch"
        if args.no_hf
        else f"torch {torch.__version__} ({torch.get_num_threads()} threads, "
        f"{args.torch_attn} attention)"
    )
    rows = []
    for name, shape in shapes.items():
        args.ar_tokens = (
            ar_default if ar_default is not None else {"smoke": 0, "0.5b": 16}.get(name, 128)
        )
        rows += bench_shape(name, shape, args)
    args.ar_tokens = ar_default
    print(
        f"float32, batch {args.batch_size}, prefix {args.prefix}, medians of {args.repeats}; "
        f"jax {jax.__version__} on {jax.default_backend()}, {torch_about}, "
        f"{platform.processor() or platform.machine()}; read bandwidth (XLA GEMV over the "
        "model's weight bytes): "
        + "; ".join(
            f"{r['shape']} {r['weight_mb']:.0f} MB at {r['bandwidth_cpu_gb_s']:.1f} GB per CPU s, "
            f"{r['bandwidth_wall_gb_s']:.1f} GB/s wall"
            for r in rows
            if r["workload"] == "decode" and r["layout"] == "[out, in]"
        )
    )
    print(
        "| workload | tokens | shape | layout | ours CPU ms | ours wall ms | k | torch CPU ms "
        "| torch wall ms | torch/ours CPU | torch/ours wall | roofline CPU ms "
        "| roofline/ours CPU (wall) | roofline/torch CPU |"
    )
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    x = "" if args.no_hf else "x"  # no ratio without torch
    for r in rows:
        print(
            f"| {r['workload']} | {r['tokens']} | {r['shape']} | {r['layout']} | "
            f"{r['ours_ms']:.2f} | {r['ours_wall_ms']:.2f} | {r['k']:.2f} | "
            f"{_fmt(r['torch_ms'], '.2f')} | "
            f"{_fmt(r['torch_wall_ms'], '.2f')} | {_fmt(r['speedup'], '.2f')}{x} | "
            f"{_fmt(r['speedup_wall'], '.2f')}{x} | {_fmt(r['roofline_ms'], '.2f')} | "
            f"{_fmt(r['ours_of_roofline'], '.2f')} ({_fmt(r['ours_of_roofline_wall'], '.2f')}) | "
            f"{_fmt(r['torch_of_roofline'], '.2f')} |"
        )
    if args.json:
        meta = dict(
            vars(args), jax=jax.__version__, torch=None if args.no_hf else torch.__version__
        )
        write_json(args.json, {"config": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
