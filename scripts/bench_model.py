"""Forward throughput of the JAX Llama port vs transformers' PyTorch forward, side by side.

A llama-68m-shaped model (768 hidden, 2 layers, 12 heads, vocab 32000) with random weights is
written by transformers, loaded by ``asps_jax.load_model``, and timed on three workloads, each
against a prefix of ``--prefix`` tokens in the KV cache (except prefill, which fills it):

* prefill: ``--prefix`` tokens in one forward;
* decode: one token;
* chain9: scoring a 9-node chain (root + 8 draft tokens), the target call of one SpS step.

Ours is jitted and warmed up; transformers runs ``torch.no_grad`` with its KV cache cropped back
after every call so that each call sees the same prefix. Both in float32 on the same machine.

    python scripts/bench_model.py [--repeats R] [--batch-size B] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax.kv_cache import commit, init_cache
from asps_jax.models import load_model
from asps_jax.scoring import score_chain, score_tree
from asps_jax.trees import build_chain_tree

SHAPE = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=2,
    num_attention_heads=12,
    num_key_value_heads=12,
    max_position_embeddings=2048,
)
# --smoke: a tiny shape so that tests can run the whole script in seconds.
SMOKE_SHAPE = dict(
    SHAPE,
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def _median_seconds(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _ours(model, tokens: np.ndarray, repeats: int) -> dict[str, float]:
    B, P = tokens.shape
    fwd = model.forward
    tree = build_chain_tree(1, 8)
    cache0 = init_cache(model.config, B, P + 16, jnp.float32)

    @jax.jit
    def prefill(params, cache, toks):
        logits, kv = score_chain(fwd, params, cache, toks, jnp.ones(toks.shape, bool))
        nodes = jnp.broadcast_to(jnp.arange(toks.shape[1], dtype=jnp.int32), toks.shape)
        return logits, commit(cache, kv, nodes, jnp.full((B,), toks.shape[1], jnp.int32))

    decode = jax.jit(lambda p, c, t: score_chain(fwd, p, c, t, jnp.ones(t.shape, bool)))
    chain = jax.jit(lambda p, c, t: score_tree(fwd, p, c, t, tree, jnp.ones(t.shape, bool)))
    toks = jnp.asarray(tokens)
    _, cache = prefill(model.params, cache0, toks)
    one, nine = toks[:, :1], toks[:, :9]
    run = {
        "prefill": lambda: jax.block_until_ready(prefill(model.params, cache0, toks)),
        "decode": lambda: jax.block_until_ready(decode(model.params, cache, one)),
        "chain9": lambda: jax.block_until_ready(chain(model.params, cache, nine)),
    }
    return {name: _median_seconds(fn, repeats) for name, fn in run.items()}


def _torch(hf, tokens: np.ndarray, repeats: int) -> dict[str, float]:
    import torch

    P = tokens.shape[1]
    ids = torch.as_tensor(tokens, dtype=torch.long)

    with torch.no_grad():
        cache = hf(ids, use_cache=True).cache

        def step(t):
            hf(ids[:, :t], cache=cache, use_cache=True)
            cache.crop(-t)  # back to the prefix, so every call sees the same cache
            assert cache.get_seq_length() == P

        run = {
            "prefill": lambda: hf(ids, use_cache=True),
            "decode": lambda: step(1),
            "chain9": lambda: step(9),
        }
        return {name: _median_seconds(fn, repeats) for name, fn in run.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=128, help="prefill / cached prefix length")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--torch-attn", default="sdpa", choices=["sdpa", "eager"], help="transformers attention"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model (a quick self-test)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.prefix < 9 or args.batch_size < 1 or args.repeats < 1:
        parser.error("--prefix must be >= 9, --batch-size and --repeats >= 1")

    import torch
    import transformers

    torch.manual_seed(args.seed)
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    hf_config = transformers.LlamaConfig(**shape)
    hf_config._attn_implementation = args.torch_attn
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    rng = np.random.default_rng(args.seed)
    tokens = rng.integers(0, shape["vocab_size"], (args.batch_size, args.prefix)).astype(np.int32)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        model = load_model(tmp)
    ours = _ours(model, tokens, args.repeats)
    theirs = _torch(hf, tokens, args.repeats)

    n_tokens = {"prefill": args.prefix, "decode": 1, "chain9": 9}
    rows = []
    for name, n in n_tokens.items():
        tps_ours = args.batch_size * n / ours[name]
        tps_torch = args.batch_size * n / theirs[name]
        rows.append(
            dict(
                workload=name,
                tokens=n,
                ours_ms=1e3 * ours[name],
                torch_ms=1e3 * theirs[name],
                ours_tok_s=tps_ours,
                torch_tok_s=tps_torch,
                speedup=tps_ours / tps_torch,
            )
        )
    print(
        f"{'smoke' if args.smoke else 'llama-68m'} shape, float32, batch {args.batch_size}, "
        f"prefix {args.prefix}; "
        f"jax {jax.__version__} on {jax.default_backend()}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads, {args.torch_attn} attention), "
        f"{platform.processor() or platform.machine()}"
    )
    print("| workload | tokens | ours ms | torch ms | ours tok/s | torch tok/s | ours/torch |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['workload']} | {r['tokens']} | {r['ours_ms']:.2f} | {r['torch_ms']:.2f} | "
            f"{r['ours_tok_s']:.0f} | {r['torch_tok_s']:.0f} | {r['speedup']:.2f}x |"
        )
    if args.json:
        meta = dict(vars(args), jax=jax.__version__, torch=torch.__version__)
        with open(args.json, "w") as f:
            json.dump({"config": meta, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
