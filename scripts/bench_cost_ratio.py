"""Speculative sampling at a realistic cost ratio: a ~0.5B-shaped target, a llama-68m-shaped draft.

Both models have random weights, built so that their laws agree about as much as a real small
draft agrees with its target (independent random models would give near-uniform laws and an
acceptance the machinery alone decides):

* the draft (hidden 768, 2 layers, 12 heads, MLP 3072) draws an embedding ``e ~ N(0, 1)`` and a head
  ``W ~ N(0, --head-std)``; the target (hidden 2048, 8 layers, 16 heads, MLP 5632) uses the same
  ones lifted by a random orthonormal ``P [2048, 768]``: embedding ``e P^T``, head
  ``P W sqrt(768 / 2048)`` (the RMS norm of a 2048-vector of the same length is that much
  smaller). With no layers, both would compute exactly the same logits;
* each model's layers are its own random draw (initializer range 0.02), with the attention and MLP
  output projections (``wo``, ``w_down``) scaled by ``--layer-scale``: they perturb the shared
  token-to-logits map independently in the two models, which sets the acceptance. The defaults
  (head std 0.2, layer scale 0.07) give a target law of ~2.3 nats of entropy and a mean one-token
  overlap ``1 - TV(target, draft)`` of ~0.75 on random contexts, the range of llama-68m drafting
  for a 7B target.

Per method (default ar; sps and asps with K = 1; specinfer with K = 2; any method of
``sampler.METHODS``, K = 2 unless it verifies one chain) and draft length n, the jitted
``decode.generate`` loop runs batch 1 for ``--max-new-tokens`` tokens (EOS off), medians of
``--repeats`` runs in CPU time (``time.process_time``) and wall time. Reported: tokens/s, tokens
per step (ATN, mean +- standard error over all steps of all runs), the cost ratio
``c = draft one-token forward / target one-token forward`` (measured here, same cache length), the
speedup over our AR, and ``efficiency = speedup / (ATN / (1 + n c))``, the fraction of the ideal
speedup a step reaches when the target scores the tree at the cost of one forward. Beside it, the
measured cost ``k_n`` of the target's (n+1)-token chain forward in one-token forwards and the
speedup bound ``ATN / (k_n + (n + 1) c)`` a step has on this machine (draft rollout: n + 1
one-token draft forwards), with the fraction of it reached: what the ideal misses on hardware
where scoring n + 1 tokens costs more than one (a CPU) and what the decoding machinery loses.

    python scripts/bench_cost_ratio.py [--n 2 4 8] [--methods ar sps asps specinfer] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax import decode, sampler
from asps_jax.kv_cache import init_cache
from asps_jax.models import LlamaConfig, Model
from asps_jax.models.base import run_params
from asps_jax.models.llama import init_params
from asps_jax.scoring import score_chain
from asps_jax.verify.registry import REGISTRY

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import SHAPES  # noqa: E402

# The shapes of scripts/bench_model.py: a ~0.5B-shaped target, the llama-68m-shaped draft.
TARGET, DRAFT = SHAPES["0.5b"], SHAPES["68m"]
SMOKE_TARGET = dict(TARGET, vocab_size=256, hidden_size=64, intermediate_size=128)
SMOKE_TARGET.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
SMOKE_DRAFT = dict(DRAFT, vocab_size=256, hidden_size=32, intermediate_size=64)
SMOKE_DRAFT.update(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4)
DEFAULT_METHODS = ("ar", "sps", "asps", "specinfer")


def num_drafts(method: str) -> int:
    """K: 1 for ar and the one-chain methods, 2 for the others."""
    return 1 if method == "ar" or REGISTRY[method].kind == "chain" else 2


def build_pair(target_shape, draft_shape, head_std, layer_scale, seed=0):
    """(target Model, draft Model) sharing a token-to-logits map (see the module docstring)."""
    t_cfg = LlamaConfig(**target_shape)
    d_cfg = LlamaConfig(**draft_shape)
    k_t, k_d, k_e, k_w, k_p = jax.random.split(jax.random.key(seed), 5)
    t_params, d_params = init_params(t_cfg, k_t), init_params(d_cfg, k_d)
    V, Et, Ed = t_cfg.vocab_size, t_cfg.hidden_size, d_cfg.hidden_size
    embed = jax.random.normal(k_e, (V, Ed), jnp.float32)
    head = head_std * jax.random.normal(k_w, (Ed, V), jnp.float32)
    lift, _ = jnp.linalg.qr(jax.random.normal(k_p, (Et, Ed), jnp.float32))  # P^T P = I
    d_params.update(embed=embed, lm_head=head)
    t_params.update(embed=embed @ lift.T, lm_head=(lift @ head) * math.sqrt(Ed / Et))
    for params in (t_params, d_params):
        for name in ("wo", "w_down"):
            params["layers"][name] = params["layers"][name] * layer_scale
    target = Model(name="random-0.5b", path="", config=t_cfg, params=t_params)
    draft = Model(name="random-68m", path="", config=d_cfg, params=d_params)
    return target, draft


def _times(fn, repeats: int) -> tuple[list[float], list[float]]:
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return cpu, wall


def forward_seconds(model, cache_len: int, repeats: int, tokens: int = 1) -> tuple[float, float]:
    """Median (CPU, wall) seconds of a forward of ``tokens`` chained tokens (the target call of an
    SpS step scores n + 1) against ``cache_len - 8`` cached slots."""
    cache = init_cache(model.config, 1, cache_len, per_layer=True)  # as the decoding loop's
    cache = dataclasses.replace(cache, lengths=jnp.full_like(cache.lengths, cache_len - 8))
    fwd, params = model.forward, run_params(model)
    step = jax.jit(lambda p, c, t: score_chain(fwd, p, c, t, jnp.ones(t.shape, bool))[0])
    tok = jnp.ones((1, tokens), jnp.int32)
    for _ in range(2):
        jax.block_until_ready(step(params, cache, tok))
    cpu, wall = _times(lambda: jax.block_until_ready(step(params, cache, tok)), repeats)
    return statistics.median(cpu), statistics.median(wall)


def run_method(target, draft, prompt, method, n, args) -> dict:
    k = num_drafts(method)

    def prepare(seed):
        return sampler.prepare(
            target,
            None if method == "ar" else draft,
            prompt,
            key=jax.random.key(seed),
            max_new_tokens=args.max_new_tokens,
            method=method,
            num_draft_tokens=n,
            num_drafts=k,
            eos_token_id=-1,
        )

    batch, call = prepare(args.seed)
    start = time.perf_counter()
    decoder = call.pop("decoder")  # static: the compiled program takes the rest
    compiled = decode.generate.lower(decoder, **call).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(**call))  # warm-up
    # One key per run, so that tokens per step pools independent runs.
    runs = iter([prepare(args.seed + 1 + i)[1]["row_keys_B"] for i in range(args.repeats)])
    states = []

    def run_once():
        state = compiled(**dict(call, row_keys_B=next(runs)))
        states.append(jax.block_until_ready(state))

    cpu, wall = _times(run_once, args.repeats)
    hist = []
    tokens = 0
    for state in states:
        stats = jax.device_get(sampler.summarize_stats(state, batch))
        if np.any(stats["bad_logits"]):
            raise FloatingPointError(f"{method} n={n}: non-finite logits")
        hist.append(np.asarray(stats["emitted_hist"]))
        tokens = int(np.asarray(state.num_generated)[:batch].sum())
    counts = np.sum([h.sum(0) for h in hist], axis=0).astype(np.float64)
    sizes = np.arange(counts.shape[0], dtype=np.float64)
    steps = counts.sum()
    atn = float((sizes * counts).sum() / steps)
    var = float(((sizes - atn) ** 2 * counts).sum() / max(steps - 1, 1))
    cpu_s, wall_s = statistics.median(cpu), statistics.median(wall)
    return dict(
        method=method,
        n=0 if method == "ar" else n,
        K=k,
        tokens=tokens,
        steps=int(steps),
        tokens_per_step=atn,
        tokens_per_step_se=math.sqrt(var / steps),
        compile_s=compile_s,
        cpu_s=cpu_s,
        wall_s=wall_s,
        tokens_per_cpu_s=tokens / cpu_s,
        tokens_per_s=tokens / wall_s,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--methods", nargs="+", default=list(DEFAULT_METHODS), choices=list(sampler.METHODS)
    )
    p.add_argument("--n", nargs="+", type=int, default=[2, 4, 8], help="draft lengths")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="medians of this many runs")
    p.add_argument("--head-std", type=float, default=0.2, help="std of the shared head")
    p.add_argument("--layer-scale", type=float, default=0.07, help="scale of wo and w_down")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (a quick self-test)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.max_new_tokens < 1 or min(args.n) < 1 or args.prompt_tokens < 1:
        p.error("--repeats, --max-new-tokens, --prompt-tokens and every --n must be >= 1")
    shapes = (SMOKE_TARGET, SMOKE_DRAFT) if args.smoke else (TARGET, DRAFT)
    target, draft = build_pair(*shapes, args.head_std, args.layer_scale, args.seed)
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, target.vocab_size, (1, args.prompt_tokens)).astype(np.int32)
    cache_len = args.prompt_tokens + args.max_new_tokens + max(args.n) + 2
    t_fwd = forward_seconds(target, cache_len, max(args.repeats, 5))
    d_fwd = forward_seconds(draft, cache_len, max(args.repeats, 5))
    c_cpu, c_wall = d_fwd[0] / t_fwd[0], d_fwd[1] / t_fwd[1]
    # k_n: the target's (n+1)-token chain forward in units of its one-token forward (CPU). The
    # ideal ATN / (1 + n c) takes k_n = 1; a step costs k_n + (n + 1) c here (the rollout feeds
    # n + 1 draft tokens), which bounds the speedup by ATN / (k_n + (n + 1) c).
    chain_cost = {
        n: forward_seconds(target, cache_len, max(args.repeats, 5), n + 1)[0] / t_fwd[0]
        for n in args.n
    }
    rows = []
    for method in args.methods:
        for n in [1] if method == "ar" else args.n:
            rows.append(run_method(target, draft, prompt, method, n, args))
            print(f"# {method} n={rows[-1]['n']}: {rows[-1]}", file=sys.stderr, flush=True)
    ar = next((r for r in rows if r["method"] == "ar"), None)
    for r in rows:
        if ar is None or r["method"] == "ar":
            continue
        ideal = r["tokens_per_step"] / (1 + r["n"] * c_cpu)
        r["speedup"] = r["tokens_per_cpu_s"] / ar["tokens_per_cpu_s"]
        r["speedup_wall"] = r["tokens_per_s"] / ar["tokens_per_s"]
        r["ideal_speedup"] = ideal
        r["efficiency"] = r["speedup"] / ideal
        r["efficiency_wall"] = r["speedup_wall"] / (r["tokens_per_step"] / (1 + r["n"] * c_wall))
        r["chain_cost"] = k_n = chain_cost[r["n"]]
        r["step_bound"] = r["tokens_per_step"] / (k_n + (r["n"] + 1) * c_cpu)
        r["of_step_bound"] = r["speedup"] / r["step_bound"]
    print(
        f"target {sum(a.size for a in jax.tree.leaves(target.params)) / 1e6:.0f}M params, draft "
        f"{sum(a.size for a in jax.tree.leaves(draft.params)) / 1e6:.0f}M, float32, batch 1, "
        f"{args.max_new_tokens} new tokens, medians of {args.repeats}; one-token forward: target "
        f"{1e3 * t_fwd[0]:.1f} ms CPU ({1e3 * t_fwd[1]:.1f} wall), draft {1e3 * d_fwd[0]:.1f} ms "
        f"CPU ({1e3 * d_fwd[1]:.1f} wall): c = {c_cpu:.3f} CPU ({c_wall:.3f} wall); target "
        "(n+1)-token chain / one-token forward, CPU: "
        + ", ".join(f"k_{n} = {k:.2f}" for n, k in chain_cost.items())
        + f"; jax {jax.__version__} on {jax.default_backend()}"
    )
    print(
        "| method | K | n | tokens/step | tok/s CPU | tok/s wall | speedup vs AR CPU (wall) "
        "| ATN/(1+n·c) | efficiency CPU (wall) | ATN/(k_n+(n+1)c) | of that | compile s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        extra = (
            f"{r['speedup']:.2f}x ({r['speedup_wall']:.2f}x) | {r['ideal_speedup']:.2f}x | "
            f"{r['efficiency']:.2f} ({r['efficiency_wall']:.2f}) | {r['step_bound']:.2f}x | "
            f"{r['of_step_bound']:.2f}"
            if "speedup" in r
            else "– | – | – | – | –"
        )
        print(
            f"| {r['method']} | {r['K']} | {r['n']} | {r['tokens_per_step']:.2f} ± "
            f"{r['tokens_per_step_se']:.2f} | {r['tokens_per_cpu_s']:.2f} | "
            f"{r['tokens_per_s']:.2f} | {extra} | {r['compile_s']:.1f} |"
        )
    if args.json:
        meta = dict(vars(args), jax=jax.__version__, c_cpu=c_cpu, c_wall=c_wall)
        meta["chain_cost"] = {str(n): k for n, k in chain_cost.items()}
        meta.update(target_forward_s=t_fwd, draft_forward_s=d_fwd)
        with open(args.json, "w") as f:
            json.dump({"config": meta, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
