"""Wall time per rollout: tunix's native sampler against asps_jax's tunix back end (AR and
speculative with ``self:L``) on the same tunix Llama3 module, side by side in one run.

The module has the bundled target's shape (hidden 192, 4 layers, 4 query / 2 KV heads, head size
48) with random weights, and the bundled tokenizer (2,048 tokens). Each sampler draws the same
prompts (``--batch`` rows, ``--max-new-tokens`` tokens, temperature 1, top-p 1) after one warm-up
call that compiles; the timed calls alternate between the samplers (``--repeats`` rounds, the
order turned each round: ``harness.side_by_side``) and each one's median is printed beside tunix's.
Needs google-tunix (see ``.ci/run`` for its light install).

Usage: ``python benchmarks/bench_tunix.py`` (about a minute); ``--quick`` runs 2 rounds of 4 rows.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
from harness import side_by_side


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="Rows per call (default 8).")
    parser.add_argument(
        "--max-new-tokens", type=int, default=32, help="Tokens per row (default 32)."
    )
    parser.add_argument("--repeats", type=int, default=5, help="Timed rounds (default 5).")
    parser.add_argument("--layers", type=int, default=2, help="L of the self:L draft (default 2).")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="Run 2 rounds of 4 rows, overriding --repeats and --batch.",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.repeats = 4, 2
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        from flax import nnx
        from tunix.generate import sampler as tunix_sampler
        from tunix.models.llama3 import model as llama3
    except ImportError as err:
        raise SystemExit(
            f"bench_tunix: google-tunix is not installed ({err}); install it as .ci/run does: "
            "pip install --no-deps google-tunix==0.1.7 google-metrax clu tensorboardX jaxtyping "
            "wadler-lindig sentencepiece perfetto pandas"
        ) from err

    import asps_jax
    from asps_jax.integrations.tunix import AspsSampler

    tok = asps_jax.load_model("tinyshakespeare-target").tokenizer
    config = llama3.ModelConfig(
        num_layers=4, vocab_size=2048, embed_dim=192, hidden_dim=512, num_heads=4,
        head_dim=48, num_kv_heads=2, rope_theta=10_000, norm_eps=1e-5, weight_tying=False,
    )  # fmt: skip
    graphdef, state = nnx.split(nnx.eval_shape(lambda: llama3.Llama3(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    leaves, tree = jax.tree.flatten(state)
    leaves = [
        jax.device_put(
            np.asarray(
                1 + 0.1 * rng.standard_normal(x.shape)
                if x.ndim == 1
                else 2.0 * rng.standard_normal(x.shape) / np.sqrt(x.shape[0]),
                x.dtype,
            )
        )
        for x in leaves
    ]
    model = nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))
    cache = tunix_sampler.CacheConfig(cache_size=256, num_layers=4, num_kv_heads=2, head_dim=48)
    samplers = {
        "tunix native": tunix_sampler.Sampler(model, tok, cache),
        "ours ar": AspsSampler(model, tok, None, method="ar"),
        f"ours asps, self:{args.layers}, n=4": AspsSampler(
            model, tok, f"self:{args.layers}", num_draft_tokens=4
        ),
    }
    prompts = ["ROMEO:", "JULIET:\nO", "KING HENRY:\nThe", "First Citizen:\nWe"]
    prompts = [prompts[i % len(prompts)] for i in range(args.batch)]
    call = dict(max_generation_steps=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=None)
    # One warm-up round (seed 0: it compiles), then the timed rounds interleaved (seeds 1, 2, ...).
    rollouts = {
        name: (lambda r, s=s: s(prompts, seed=r, **call).tokens) for name, s in samplers.items()
    }
    with jax.numpy_rank_promotion("allow"):  # tunix's own code promotes ranks
        timed = side_by_side(rollouts, args.repeats, warmup=1)
    times = {name: row["times"] for name, row in timed.items()}
    base = np.median(times["tunix native"])
    print(
        f"{args.batch} rows x {args.max_new_tokens} tokens, temperature 1; median of {args.repeats}"
    )
    for name, t in times.items():
        med = np.median(t)
        print(f"  {name:28s} {1000 * med:8.1f} ms per rollout   {base / med:5.2f}x tunix native")


if __name__ == "__main__":
    main()
