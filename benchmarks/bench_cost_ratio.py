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

The pair is written once as Hugging Face checkpoints (``--checkpoints``, default
``~/.cache/asps_jax/bench_cost_ratio``, one folder per shape, seed and perturbation; reused when
present) and both our runs and transformers' load those files, so both sides decode the same
weights.

Per method (default ar; sps and asps with K = 1; specinfer, is, is_bv and tv with K = 2; any method
of ``sampler.METHODS``, K = 2 unless it verifies one chain) and draft length n, the jitted
``decode.generate`` loop runs batch 1 for ``--max-new-tokens`` tokens (EOS off), medians of
``--repeats`` runs in CPU time (``time.process_time``) and wall time. Beside ours, on the same
checkpoints and prompt: transformers ``generate(do_sample=True)`` and assisted generation
(``assistant_model=draft``, ``do_sample=True``, ``num_assistant_tokens=n`` with the ``"constant"``
schedule and the confidence early exit off, so that every step drafts exactly n tokens), torch
float32, eager attention, ``--torch-threads`` threads; their tokens per step are the new tokens
over the target's forward calls (``--no-hf`` skips them). Reported: tokens/s, tokens
per step (ATN, mean +- standard error over all steps of all runs), the cost ratio
``c = draft one-token forward / target one-token forward`` (measured here, same cache length), the
speedup over our AR, and ``efficiency = speedup / (ATN / (1 + n c))``, the fraction of the ideal
speedup a step reaches when the target scores the tree at the cost of one forward. Beside it, the
measured cost ``k_n`` of the target's (n+1)-token chain forward in one-token forwards (on the
wide run layout the loop scores chains on; beside it, on the one-row layout) and the
speedup bound ``ATN / (k_n + (n + 1) c)`` a step has on this machine (draft rollout: n + 1
one-token draft forwards), with the fraction of it reached: what the ideal misses on hardware
where scoring n + 1 tokens costs more than one (a CPU) and what the decoding machinery loses.
Last, the level race's per-node fit (``is`` and ``optimal`` defaults, K = 2, at the target's V) in
CPU time beside the target's one-token forward, measured in the same run.

``--quick`` (about 2 minutes on 2 cores, compilation included): n = 4, 16 new tokens, one timed
run, methods ar and asps, no transformers rows, on a pair of the same construction sized to fit in
4 GB (``QUICK_TARGET``: hidden 1024, 8 layers, 16 heads, MLP 2816, 168M parameters;
``QUICK_DRAFT``: hidden 384, 2 layers, 6 heads, MLP 1536, 29M; the same vocabulary of 32,000 and a
cost ratio c near the full pair's 0.1). It measures everything the full run does (c, k_n, the
bounds, the level race's fit at V = 32,000), so it checks the whole script and gives the same kind
of figures in minutes; the figures docs/benchmarks.md quotes are the full pair's.

Memory: the full float32 pair is 2.4 GB of weights (target 2.17 GB, draft 0.27 GB), but building it
(one random draw for all of a model's weights) and the run layouts of its weights take far more:
at the 0.5B shape, without transformers, the run peaked at 11.0 GB resident, and the full run adds
the checkpoints' write and transformers' float32 copy of both models (one was killed at 8.6 GB
while it built the pair). Give it 12 GB or more; ``--quick`` (its smaller pair) peaks under 4 GB and
``--smoke`` (tiny shapes) runs anywhere. The script says so on stderr where less memory is free.

    python benchmarks/bench_cost_ratio.py [--quick] [--n 2 4 8] [--methods ar sps ...] [--no-hf]
                                          [--drafters model quant:int8] [--checkpoints DIR]
                                          [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from bench_model import SHAPES
from harness import cpu_wall, fill_quick, skip_hf, write_json

import asps_jax
from asps_jax import decode, drafters, sampler
from asps_jax.kv_cache import init_cache
from asps_jax.models import LlamaConfig, Model
from asps_jax.models.base import run_params
from asps_jax.models.llama import init_params
from asps_jax.models.loader import save_checkpoint
from asps_jax.scoring import score_chain
from asps_jax.verify import options as verify_options
from asps_jax.verify import tokenlevel
from asps_jax.verify.registry import REGISTRY

# The shapes of benchmarks/bench_model.py: a ~0.5B-shaped target, the llama-68m-shaped draft.
TARGET, DRAFT = SHAPES["0.5b"], SHAPES["68m"]
SMOKE_TARGET = dict(TARGET, vocab_size=256, hidden_size=64, intermediate_size=128)
SMOKE_TARGET.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
SMOKE_DRAFT = dict(DRAFT, vocab_size=256, hidden_size=32, intermediate_size=64)
SMOKE_DRAFT.update(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4)
# --quick's pair: the same construction at about a third of the widths, the draft's width and the
# target's kept in about the full pair's ratio, so that c stays near 0.1 (module docstring).
QUICK_TARGET = dict(TARGET, hidden_size=1024, intermediate_size=2816)
QUICK_DRAFT = dict(DRAFT, hidden_size=384, intermediate_size=1536, num_attention_heads=6)
QUICK_DRAFT.update(num_key_value_heads=6)
DEFAULT_METHODS = ("ar", "sps", "asps", "specinfer", "is", "is_bv", "tv")
# --quick: no transformers rows, so no checkpoints written and no torch copy of the pair; the
# smaller pair (QUICK_TARGET, QUICK_DRAFT) is built on the device and stays under 4 GB (docstring).
QUICK = dict(methods=["ar", "asps"], n=[4], max_new_tokens=16, repeats=1, no_hf=True)
CHECKPOINTS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "asps_jax"


NEEDS_GB = 12  # the measured peak at the 0.5B shape, without transformers (11.0 GB), rounded up
QUICK_NEEDS_GB = 4  # --quick's smaller pair (module docstring)


def warn_memory(script: str, needs_gb: float = NEEDS_GB, shape: str = "the 0.5B shape") -> None:
    """One line on stderr where the machine has less than ``needs_gb`` of memory available."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError, AttributeError):  # not on this platform: nothing to say
        return
    if free < needs_gb:
        print(
            f"{script}: needs about {needs_gb} GB of memory at {shape} and {free:.1f} GB "
            "is free; it may be killed (--smoke runs tiny shapes)",
            file=sys.stderr,
        )


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
    target = Model(name=f"random-target-{Et}", path="", config=t_cfg, params=t_params)
    draft = Model(name=f"random-draft-{Ed}", path="", config=d_cfg, params=d_params)
    return target, draft


def checkpoint_pair(shapes, head_std, layer_scale, seed, root) -> tuple[Path, Path]:
    """Paths of the pair's HF checkpoints under ``root``, written by :func:`build_pair` unless a
    previous run left them (the folder name carries a hash of everything that shapes them)."""
    spec = json.dumps([shapes, head_std, layer_scale, seed], sort_keys=True)
    tag = hashlib.sha256(spec.encode()).hexdigest()[:12]
    paths = (Path(root) / f"target-{tag}", Path(root) / f"draft-{tag}")
    if not all((p / "config.json").exists() and (p / "model.safetensors").exists() for p in paths):
        for model, path in zip(build_pair(*shapes, head_std, layer_scale, seed), paths):
            tmp = path.with_name(path.name + ".partial")
            save_checkpoint(tmp, model.config, model.params)
            tmp.rename(path)  # a killed run leaves no half-written checkpoint behind
    return paths


def fit_seconds(vocab: int, method: str, repeats: int) -> float:
    """Median CPU seconds of ``method``'s default level-race fit at one node (K = 2, jitted), on
    a draft law of ~3 nats and a target that differs from it by N(0, 1) logit noise."""
    k_p, k_q = jax.random.split(jax.random.key(0))
    lq = jax.nn.log_softmax(3.0 * jax.random.normal(k_q, (vocab,)))
    p = jax.nn.softmax(lq + jax.random.normal(k_p, (vocab,)))
    qs = jnp.broadcast_to(jnp.exp(lq), (2, vocab))
    cfg = verify_options.rule_config(method, vocab, {})
    alive = jnp.ones((2,), bool)
    fn = jax.jit(lambda p, q: tokenlevel.importance_sampling_rules(p, q, alive, cfg).q_sel)
    for _ in range(2):
        jax.block_until_ready(fn(p, qs))
    cpu, _ = cpu_wall(lambda: jax.block_until_ready(fn(p, qs)), repeats)
    return statistics.median(cpu)


def run_transformers(paths, prompt, ns, args) -> list[dict]:
    """transformers ``generate`` and assisted generation (batch 1, ``do_sample=True``) on the
    checkpoints: medians of ``--repeats`` runs, CPU and wall time, tokens per target call."""
    import torch
    import transformers

    torch.set_num_threads(args.torch_threads)

    def load(path):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        model.generation_config.eos_token_id = None  # every run generates max_new_tokens
        return model

    target, draft = load(paths[0]), load(paths[1])
    calls = [0]
    forward = target.forward

    def counted(*a, **k):
        calls[0] += 1
        return forward(*a, **k)

    target.forward = counted
    ids = torch.as_tensor(np.asarray(prompt), dtype=torch.long)
    config = draft.generation_config
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0  # no early exit: exactly n drafted per step

    def generate(new_tokens, **extra):
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=True,
            top_k=0,
            pad_token_id=0,
            **extra,
        )
        return int(out.shape[1] - ids.shape[1])

    rows = []
    with torch.no_grad():
        generate(2)  # warm-up
        for n in [0, *ns]:
            extra = dict(assistant_model=draft) if n else {}
            config.num_assistant_tokens = max(n, 1)
            torch.manual_seed(args.seed)
            tokens, steps = [], []

            def once(extra=extra, tokens=tokens, steps=steps):
                calls[0] = 0
                tokens.append(generate(args.max_new_tokens, **extra))
                steps.append(calls[0])

            cpu, wall = cpu_wall(once, args.repeats)
            cpu_s, wall_s = statistics.median(cpu), statistics.median(wall)
            rows.append(
                dict(
                    method="hf assisted" if n else "hf generate",
                    n=n,
                    K=1,
                    tokens=tokens[-1],
                    steps=sum(steps),
                    tokens_per_step=sum(tokens) / sum(steps),
                    tokens_per_step_se=None,
                    compile_s=None,
                    cpu_s=cpu_s,
                    wall_s=wall_s,
                    tokens_per_cpu_s=tokens[-1] / cpu_s,
                    tokens_per_s=tokens[-1] / wall_s,
                )
            )
    return rows


def forward_seconds(
    model, cache_len: int, repeats: int, tokens: int = 1, wide: bool = False
) -> tuple[float, float]:
    """Median (CPU, wall) seconds of a forward of ``tokens`` chained tokens (the target call of an
    SpS step scores n + 1) against ``cache_len - 8`` cached slots, on the run layout ``wide``
    (``run_params``: the decoding loop's target scores its chains on the wide one)."""
    cache = init_cache(model.config, 1, cache_len, per_layer=True)  # as the decoding loop's
    cache = dataclasses.replace(cache, lengths=jnp.full_like(cache.lengths, cache_len - 8))
    fwd, params = model.forward, run_params(model, wide=wide)
    step = jax.jit(lambda p, c, t: score_chain(fwd, p, c, t, jnp.ones(t.shape, bool))[0])
    tok = jnp.ones((1, tokens), jnp.int32)
    for _ in range(2):
        jax.block_until_ready(step(params, cache, tok))
    cpu, wall = cpu_wall(lambda: jax.block_until_ready(step(params, cache, tok)), repeats)
    return statistics.median(cpu), statistics.median(wall)


def run_method(target, draft, prompt, method, n, args, drafter: str = "model") -> dict:
    """One row: ``method`` at draft length ``n``; ``drafter`` "model" drafts with ``draft``, any
    other value is passed as ``draft=`` (e.g. ``"quant:int8"``, the target's own int8 copy)."""
    k = num_drafts(method)

    def prepare(seed):
        return sampler.prepare(
            target,
            None if method == "ar" else draft if drafter == "model" else drafter,
            prompt,
            key=jax.random.key(seed),
            max_new_tokens=args.max_new_tokens,
            method=method,
            num_draft_tokens=n,
            num_drafts=k,
            eos_token_id=-1,
        )

    prepared = prepare(args.seed)
    batch, call = prepared.batch, prepared.inputs.kwargs()
    start = time.perf_counter()
    # The decoder is static: the compiled program takes the inputs.
    compiled = decode.generate.lower(prepared.decoder, **call).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(**call))  # warm-up
    # One key per run, so that tokens per step pools independent runs.
    runs = iter([prepare(args.seed + 1 + i).inputs.row_keys_B for i in range(args.repeats)])
    states = []

    def run_once():
        state = compiled(**dict(call, row_keys_B=next(runs)))
        states.append(jax.block_until_ready(state))

    cpu, wall = cpu_wall(run_once, args.repeats)
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
        method=method if drafter == "model" else f"{method} + {drafter}",
        drafter=drafter,
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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--methods",
        nargs="+",
        default=list(DEFAULT_METHODS),
        choices=list(sampler.METHODS),
        help="Methods to run: K = 1 for ar and the one-chain methods, else K = 2 "
        f"(default: {' '.join(DEFAULT_METHODS)}).",
    )
    p.add_argument(
        "--drafters",
        nargs="+",
        default=["model"],
        help="Who drafts, each a row set of its own: model (the 68M draft) or any draft= string, "
        "e.g. quant:int8 (the target's own int8 copy; its bound columns stay empty: c is the draft "
        "model's) (default: model).",
    )
    p.add_argument(
        "--n",
        nargs="+",
        type=int,
        default=[2, 4, 8],
        help="Draft lengths n to run (default: 2 4 8).",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        help="Tokens generated per run, EOS off (default: 64).",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=16,
        help="Length of the random prompt in tokens (default: 16).",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="Timed runs per figure, reported as their median (default: 3).",
    )
    p.add_argument(
        "--head-std",
        type=float,
        default=0.2,
        help="Standard deviation of the head the pair shares (default: 0.2).",
    )
    p.add_argument(
        "--layer-scale",
        type=float,
        default=0.07,
        help="Scale of the layers' wo and w_down, which sets the acceptance (default: 0.07).",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="Seed of the random weights, the prompt and the sampling (default: 0).",
    )
    p.add_argument(
        "--smoke", action="store_true", help="Use tiny shapes (a quick self-test of the script)."
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="Run a short subset on a smaller pair of the same construction (under 4 GB), which "
        f"fills only the flags left at their defaults: {QUICK}.",
    )
    p.add_argument(
        "--checkpoints",
        default=str(CHECKPOINTS / "bench_cost_ratio"),
        help="Folder of the pair's HF checkpoints, written once, then reused "
        "(default: ~/.cache/asps_jax/bench_cost_ratio, under $XDG_CACHE_HOME when it is set).",
    )
    p.add_argument("--no-hf", action="store_true", help="Skip the transformers runs.")
    p.add_argument(
        "--torch-threads", type=int, default=1, help="Torch intra-op threads (default: 1)."
    )
    p.add_argument("--json", metavar="PATH", help="Also write the results as JSON to PATH.")
    args = p.parse_args(argv)
    if args.quick:
        fill_quick(p, args, QUICK)
    if args.repeats < 1 or args.max_new_tokens < 1 or min(args.n) < 1 or args.prompt_tokens < 1:
        p.error("--repeats, --max-new-tokens, --prompt-tokens and every --n must be >= 1")
    if args.torch_threads < 1:
        p.error("--torch-threads must be >= 1")
    unknown = [d for d in args.drafters if d != "model" and not drafters.is_named(d)]
    if unknown:
        p.error(f"--drafters: {unknown} name no drafter; give model, self:L, quant:int8 or lookup")
    args.no_hf = skip_hf("bench_cost_ratio", args.no_hf, what="rows")
    if args.smoke:
        shapes = (SMOKE_TARGET, SMOKE_DRAFT)
    elif args.quick:
        shapes = (QUICK_TARGET, QUICK_DRAFT)
        warn_memory("bench_cost_ratio", QUICK_NEEDS_GB, "--quick's shape")
    else:
        shapes = (TARGET, DRAFT)
        warn_memory("bench_cost_ratio")
    if args.no_hf:  # no checkpoints to write: the same pair, made on the device
        paths = []
        target, draft = build_pair(*shapes, args.head_std, args.layer_scale, args.seed)
    else:  # transformers loads the same weights from the checkpoints (written once)
        paths = checkpoint_pair(
            shapes, args.head_std, args.layer_scale, args.seed, args.checkpoints
        )
        target, draft = (asps_jax.load_model(str(path), dtype="float32") for path in paths)
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, target.vocab_size, (1, args.prompt_tokens)).astype(np.int32)
    cache_len = args.prompt_tokens + args.max_new_tokens + max(args.n) + 2
    t_fwd = forward_seconds(target, cache_len, max(args.repeats, 5))
    d_fwd = forward_seconds(draft, cache_len, max(args.repeats, 5))
    c_cpu, c_wall = d_fwd[0] / t_fwd[0], d_fwd[1] / t_fwd[1]
    # k_n: the target's (n+1)-token chain forward in units of its one-token forward (CPU). The
    # ideal ATN / (1 + n c) takes k_n = 1; a step costs k_n + (n + 1) c here (the rollout feeds
    # n + 1 draft tokens), which bounds the speedup by ATN / (k_n + (n + 1) c).
    # Measured on both run layouts: the loop's (wide, [in, out]) and the one-row one ([out, in],
    # what the target ran a chain on before the wide layout).
    chain_cost, chain_cost_one_row = (
        {
            n: forward_seconds(target, cache_len, max(args.repeats, 5), n + 1, wide)[0] / t_fwd[0]
            for n in args.n
        }
        for wide in (True, False)
    )
    fits = {m: fit_seconds(target.vocab_size, m, max(args.repeats, 5)) for m in ("is", "optimal")}
    rows = []
    for drafter in args.drafters:
        for method in args.methods:
            if method == "ar" and drafter != "model":
                continue  # one AR row: it drafts nothing
            for n in [1] if method == "ar" else args.n:
                rows.append(run_method(target, draft, prompt, method, n, args, drafter))
                row = rows[-1]
                print(f"# {row['method']} n={row['n']}: {row}", file=sys.stderr, flush=True)
    hf = [] if args.no_hf else run_transformers(paths, prompt, args.n, args)
    for r in hf:
        print(f"# {r['method']} n={r['n']}: {r}", file=sys.stderr, flush=True)
    ar = next((r for r in rows if r["method"] == "ar"), None)
    assisted = {r["n"]: r for r in hf if r["n"]}
    for r in rows + hf:
        if r["n"] in assisted and r["method"] != "ar":
            other = assisted[r["n"]]
            r["vs_hf_assisted"] = r["tokens_per_cpu_s"] / other["tokens_per_cpu_s"]
            r["vs_hf_assisted_wall"] = r["tokens_per_s"] / other["tokens_per_s"]
        if ar is None or r["method"] == "ar":
            continue
        r["speedup"] = r["tokens_per_cpu_s"] / ar["tokens_per_cpu_s"]
        r["speedup_wall"] = r["tokens_per_s"] / ar["tokens_per_s"]
        if r["n"] == 0 or r.get("drafter", "model") != "model":
            continue  # the bounds take the draft model's c
        ideal = r["tokens_per_step"] / (1 + r["n"] * c_cpu)
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
        + ", ".join(
            f"k_{n} = {k:.2f} (one-row layout: {chain_cost_one_row[n]:.2f})"
            for n, k in chain_cost.items()
        )
        + f"; jax {jax.__version__} on {jax.default_backend()}"
        + ("" if args.no_hf else f"; transformers: torch float32, {args.torch_threads} thread(s)")
    )
    print(
        f"level-race fit per node (K = 2, V = {target.vocab_size}, CPU): "
        + ", ".join(
            f"{m} {1e3 * t:.2f} ms = {100 * t / t_fwd[0]:.1f}% of the target's one-token forward"
            for m, t in fits.items()
        )
    )
    print(
        "| method | K | n | tokens/step | tok/s CPU | tok/s wall | speedup vs AR CPU (wall) "
        "| vs HF assisted CPU (wall) | ATN/(1+n·c) | efficiency CPU (wall) | ATN/(k_n+(n+1)c) "
        "| of that | compile s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows + hf:
        speedup = f"{r['speedup']:.2f}x ({r['speedup_wall']:.2f}x)" if "speedup" in r else "–"
        vs_hf = (
            f"{r['vs_hf_assisted']:.2f}x ({r['vs_hf_assisted_wall']:.2f}x)"
            if "vs_hf_assisted" in r
            else "–"
        )
        extra = (
            f"{r['ideal_speedup']:.2f}x | {r['efficiency']:.2f} ({r['efficiency_wall']:.2f}) | "
            f"{r['step_bound']:.2f}x | {r['of_step_bound']:.2f}"
            if "ideal_speedup" in r
            else "– | – | – | –"
        )
        se = r["tokens_per_step_se"]
        atn = f"{r['tokens_per_step']:.2f}" + (f" ± {se:.2f}" if se is not None else "")
        compile_s = f"{r['compile_s']:.1f}" if r["compile_s"] is not None else "–"
        print(
            f"| {r['method']} | {r['K']} | {r['n']} | {atn} | {r['tokens_per_cpu_s']:.2f} | "
            f"{r['tokens_per_s']:.2f} | {speedup} | {vs_hf} | {extra} | {compile_s} |"
        )
    if args.json:
        meta = dict(vars(args), jax=jax.__version__, c_cpu=c_cpu, c_wall=c_wall)
        meta["chain_cost"] = {str(n): k for n, k in chain_cost.items()}
        meta["chain_cost_one_row_layout"] = {str(n): k for n, k in chain_cost_one_row.items()}
        meta.update(target_forward_s=t_fwd, draft_forward_s=d_fwd, fit_s=fits)
        meta["checkpoints"] = [str(path) for path in paths]
        write_json(args.json, {"config": meta, "rows": rows, "transformers": hf})
    return 0


if __name__ == "__main__":
    sys.exit(main())
