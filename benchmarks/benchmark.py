"""End-to-end speculative sampling benchmark: every method of ``asps_jax.sample`` beside
transformers' ``generate`` and assisted generation, on the same checkpoints, in one run.

For AR, SpS / ASpS (K = 1) and each multi-draft method (K >= 2) over the chosen draft lengths n,
ours runs the whole decoding loop (``Decoder.generate``: prefill + one ``lax.while_loop``, what
``asps_jax.sample`` calls) compiled ahead of time, so the timed run excludes compilation (reported
apart). Per run: tokens per step (ATN / block efficiency, mean +- standard error over all steps of
all rows, from ``emitted_hist``), target calls per row, token-level acceptance (accepted / verified
draft tokens), wall tokens/s, and the speedup over our AR decode and over transformers.

transformers runs the same checkpoints in torch float32 with eager attention: ``generate(
do_sample=True)`` on the whole batch, and assisted generation (``assistant_model=draft``,
``num_assistant_tokens=n`` with the ``"constant"`` schedule and the confidence early-exit off, so
that every step drafts exactly n tokens), which transformers supports for batch size 1 only, so it
runs row by row. EOS never stops a row on either side: every row generates ``--max-new-tokens``.

Prompts are, by default, ``--prompt-tokens`` tokens of consecutive corpus lines (tinyshakespeare,
one starting line per row); ``--prompts FILE`` reads them from a file (one prompt per line, or JSON
lines with a ``prompt`` field), and ``--task`` builds them from the papers' data sets with the
``datasets`` package (network needed): ``wmt16`` ("Translate from English to Romanian: " + the
English source of WMT16 ro-en test), ``cnndm`` (a CNN/DailyMail test article + "\nTL;DR:\n"),
``dolly`` (a databricks-dolly-15k instruction, with its context when it has one). Row b takes
prompt b (cycling when there are fewer prompts than rows), keeping its last ``--prompt-tokens``
tokens. Text is encoded by the target's tokenizer (UTF-8 bytes modulo the vocabulary when the
checkpoint has none). A progress bar runs on stderr when stdout is a terminal (``--quiet`` turns
it off).

    python benchmarks/benchmark.py [--quick] [--methods M ...] [--n N ...] [--k K ...] [--json PATH]
                                   [--prompts FILE | --task wmt16|cnndm|dolly] [--quiet]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np
from harness import fill_quick, missing_hf, skip_hf, timed_runs, write_json  # noqa: F401
from tqdm import tqdm

import asps_jax
from asps_jax import sampler, statistics
from asps_jax.trees import parse_widths
from asps_jax.verify.registry import REGISTRY

SPEC = tuple(m for m in sampler.METHODS if m in REGISTRY)  # every method but ar
CHAIN = tuple(m for m in SPEC if REGISTRY[m].kind == "chain")  # sps, asps: K = 1
MULTI = tuple(m for m in SPEC if REGISTRY[m].kind != "chain")
FULL_N = (1, 2, 4, 6, 8, 10)
FULL_K = (1, 2, 4)
# --quick: enough steps (32 rows of 128 tokens, ~1,200 steps per method) for the tokens-per-step
# standard errors to tell the methods apart, no transformers runs (their row-by-row assisted
# generation alone takes minutes); separation() says which pairs it could not tell apart.
QUICK = dict(
    methods=["ar", "sps", "asps", "specinfer"],
    n=[4],
    k=[2],
    batch_size=32,
    max_new_tokens=128,
    no_hf=True,
)
CORPUS = Path(__file__).resolve().parents[1] / "data/tinyshakespeare.txt"
FALLBACK_TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
    "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\nResolved. "
    "resolved.\n\nFirst Citizen:\nFirst, you know Caius Marcius is chief enemy to the people.\n"
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--target",
        default="tinyshakespeare-target",
        help="Target model: a registered alias or a checkpoint path "
        "(default: tinyshakespeare-target).",
    )
    p.add_argument(
        "--draft",
        default="tinyshakespeare-draft",
        help="Draft model: a registered alias or a checkpoint path "
        "(default: tinyshakespeare-draft).",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        choices=sampler.METHODS,
        default=list(sampler.METHODS),
        help="Methods to run (default: all of them); AR always runs, as the speedup baseline.",
    )
    p.add_argument(
        "--n",
        nargs="+",
        type=int,
        default=list(FULL_N),
        help=f"Draft lengths n to run (default: {' '.join(map(str, FULL_N))}).",
    )
    p.add_argument(
        "--k",
        nargs="+",
        type=int,
        default=list(FULL_K),
        help="Numbers of drafts K for the multi-draft methods "
        f"(default: {' '.join(map(str, FULL_K))}); only the values K >= 2 are used (sps / asps "
        "run at K = 1).",
    )
    p.add_argument(
        "--trees",
        nargs="+",
        default=[],
        metavar="W1,W2,...",
        help="Also run the tree methods of --methods (tv, tv_wr, is_bv) on these branching draft "
        "trees, W_d children per node at depth d, e.g. 4,2,1,1 (K = the leaves, n = the depth). "
        "Default: no trees.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"Run a ~1 minute subset (a quiet 2-core CPU), which fills only the flags left at "
        f"their defaults: {QUICK}; the methods' tokens per step are told apart, or said not to be.",
    )
    p.add_argument(
        "--batch-size", type=int, default=4, help="Prompts decoded together (default: 4)."
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=128,
        help="Tokens generated per row; EOS never stops a row (default: 128).",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=32,
        help="Prompt length in tokens: each row keeps the last this many tokens of its prompt "
        "(default: 32).",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--prompts",
        metavar="FILE",
        help="Read the prompts from FILE: one per line, or JSON lines with a 'prompt' field "
        "(default: consecutive tinyshakespeare lines).",
    )
    source.add_argument(
        "--task",
        choices=sorted(TASKS),
        help="Use the papers' prompts (needs the datasets package and the network): wmt16 = "
        "WMT16 en->ro translation, cnndm = CNN/DailyMail summarisation, dolly = Dolly "
        "instructions.",
    )
    p.add_argument("--quiet", action="store_true", help="Show no progress bar or per-run lines.")
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="Sampling temperature, 0 for greedy (default: 1.0).",
    )
    p.add_argument(
        "--draft-temperature",
        type=float,
        default=None,
        help="Temperature the drafts sample at (default: --temperature); verification uses the "
        "law actually drawn, so the output law is still the target's (the transformers runs "
        "ignore it).",
    )
    p.add_argument("--top-k", type=int, default=None, help="Top-k filter (default: off).")
    p.add_argument("--top-p", type=float, default=None, help="Top-p filter (default: off).")
    p.add_argument(
        "--seed", type=int, default=0, help="PRNG seed, of ours and of torch (default: 0)."
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="Timed runs per config after a warm-up, reported as their median (default: 3); "
        "0 means a single run and no warm-up, for the tokens/step figures (its wall time "
        "includes first-call allocations).",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="Torch intra-op threads (default: 1): tiny models gain nothing from more, and on a "
        "busy machine spinning thread pools slow torch down by orders of magnitude.",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        help="Dtype of our models (default: float32; torch always runs in float32).",
    )
    p.add_argument("--no-hf", action="store_true", help="Skip the transformers runs.")
    p.add_argument(
        "--controls",
        action="store_true",
        help="Also run every config of ours with every sampling control on (CONTROLS: "
        "repetition / presence / frequency penalties, no-repeat n-grams, min-p, logit bias) "
        "and report the time per step with / without.",
    )
    p.add_argument(
        "--json-schema",
        action="store_true",
        help="Also run every config of ours constrained by a JSON schema (BENCH_SCHEMA) and "
        "report tokens/step and tokens/s with / without.",
    )
    p.add_argument("--json", metavar="PATH", help="Also write every figure as JSON to PATH.")
    return p


def _draft_temperature(args: argparse.Namespace) -> float:
    return args.temperature if args.draft_temperature is None else args.draft_temperature


def check_args(args: argparse.Namespace) -> None:
    """Raise a ValueError naming the flag for values argparse cannot check by itself."""
    for flag, values in (("--n", args.n), ("--k", args.k)):
        if not values or min(values) < 1:
            raise ValueError(f"{flag}: every value must be an integer >= 1, got {values}")
    for flag in ("batch_size", "max_new_tokens", "prompt_tokens", "torch_threads"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.repeats < 0:
        raise ValueError(f"--repeats must be >= 0, got {args.repeats}")
    try:
        args.trees = [parse_widths(text) for text in args.trees]
    except ValueError as err:
        raise ValueError(f"--trees: {err}") from None
    if args.temperature < 0 or not math.isfinite(args.temperature):
        raise ValueError(f"--temperature must be finite and >= 0, got {args.temperature}")
    dt = args.draft_temperature
    if dt is not None and (dt < 0 or not math.isfinite(dt)):
        raise ValueError(f"--draft-temperature must be finite and >= 0, got {dt}")
    if args.top_k is not None and args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must lie in (0, 1], got {args.top_p}")


def _dolly_prompt(row: dict) -> str:
    context = row.get("context") or ""
    return row["instruction"] + (f"\n\n{context}" if context.strip() else "") + "\n"


# task -> (datasets.load_dataset arguments, row -> prompt text)
TASKS = {
    "wmt16": (
        ("wmt16", "ro-en", "test"),
        lambda row: "Translate from English to Romanian: " + row["translation"]["en"],
    ),
    "cnndm": (("cnn_dailymail", "3.0.0", "test"), lambda row: row["article"] + "\nTL;DR:\n"),
    "dolly": (("databricks/databricks-dolly-15k", None, "train"), _dolly_prompt),
}


def read_prompts(path: str) -> list[str]:
    """Prompts of a file: JSON lines with a ``prompt`` field, else one prompt per line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"--prompts: cannot read {path}: {err.strerror or err}") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"--prompts: {path} holds no prompt")
    if not lines[0].lstrip().startswith("{"):
        return lines
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"--prompts: {path}:{number} is not valid JSON ({err.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"--prompts: {path}:{number} has no string 'prompt' field")
        prompts.append(row["prompt"])
    return prompts


def task_prompts(task: str, count: int) -> list[str]:
    """The first ``count`` prompts of a paper's data set, through the ``datasets`` package."""
    (name, config, split), template = TASKS[task]
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"--task {task} needs the datasets package (pip install datasets) and network "
            "access; without them pass the prompts with --prompts FILE"
        ) from None
    try:
        rows = datasets.load_dataset(name, config, split=f"{split}[:{count}]")
    except Exception as err:  # network, hub or cache errors: one line, not a traceback
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"--task {task}: cannot load {name} ({first})") from None
    return [template(row) for row in rows]


def plan(methods, ns, ks, trees=()) -> list[tuple[str, int, int, tuple]]:
    """``(method, n, K, tree)`` runs: AR once, SpS/ASpS at K = 1, multi-draft methods at each
    K >= 2 (``tree = ()``: K chains), then each tree method on each branching tree."""
    runs = [("ar", 1, 1, ())]
    for method in dict.fromkeys(methods):
        if method in CHAIN:
            runs += [(method, n, 1, ()) for n in ns]
        elif method in MULTI:
            runs += [(method, n, k, ()) for k in sorted(set(ks)) if k >= 2 for n in ns]
    for method in dict.fromkeys(methods):
        if method in SPEC and REGISTRY[method].kind == "tree":
            runs += [(method, len(w), math.prod(w), tuple(w)) for w in trees]
    return runs


def _encoder(tokenizer, vocab_size: int):
    def encode(s: str) -> list[int]:
        if tokenizer is None:
            return [b % vocab_size for b in s.encode("utf-8")]
        return list(tokenizer.encode(s, add_special_tokens=False))

    return encode


def encode_prompts(texts, tokenizer, vocab_size: int, batch: int, length: int) -> list[list[int]]:
    """Row b: the last ``length`` tokens of ``texts[b % len(texts)]`` (ragged rows)."""
    encode = _encoder(tokenizer, vocab_size)
    rows = [encode(texts[b % len(texts)])[-length:] for b in range(batch)]
    empty = [b for b, row in enumerate(rows) if not row]
    if empty:
        raise ValueError(f"prompt {empty[0] % len(texts)} encodes to no token")
    return rows


def build_prompts(tokenizer, vocab_size: int, batch: int, length: int) -> np.ndarray:
    """int32[B, P]: row b encodes consecutive corpus lines from its own starting line."""
    text = CORPUS.read_text(encoding="utf-8") if CORPUS.is_file() else FALLBACK_TEXT
    lines = [line for line in text.splitlines() if line.strip()]
    stride = max(len(lines) // batch, 1)
    encode = _encoder(tokenizer, vocab_size)
    rows = []
    for b in range(batch):
        ids, i = [], b * stride
        while len(ids) < length:  # wraps around a short corpus
            ids += encode(lines[i % len(lines)] + "\n")
            i += 1
        rows.append(ids[:length])
    return np.asarray(rows, np.int32)


def atn(hist: np.ndarray) -> tuple[float, float, int]:
    """Tokens per step over all steps of all rows: (mean, standard error, steps)."""
    return statistics.histogram_mean_stderr(hist)


def ratio_se(a: float, se_a: float, b: float, se_b: float) -> tuple[float, float]:
    """a / b with the first-order (delta-method) standard error of independent estimates."""
    r = a / b
    return r, abs(r) * math.hypot(se_a / a, se_b / b)


# Every sampling control on at once (--controls): the cost of the per-node processing.
CONTROLS = dict(
    repetition_penalty=1.2,
    presence_penalty=0.3,
    frequency_penalty=0.2,
    no_repeat_ngram_size=3,
    min_p=0.02,
    logit_bias={0: -math.inf, 1: 0.5},
)


# --json-schema: a record with long free-text strings, so that most of a run is constrained
# decoding rather than the short fixed parts. Rows end where the schema allows nothing more.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "speaker": {"type": "string", "maxLength": 24},
        "line": {"type": "string", "maxLength": 160},
        "aside": {"type": "boolean"},
    },
    "required": ["speaker", "line", "aside"],
    "additionalProperties": False,
}


def run_ours(target, draft, prompts, method, n, k, args, tree=(), controls=None) -> dict:
    sizes = dict(tree=tree) if tree else dict(num_draft_tokens=n, num_drafts=k)
    sizes.update(controls or {})
    prepared = sampler.prepare(
        target,
        None if method == "ar" else draft,
        prompts,
        key=jax.random.key(args.seed),
        max_new_tokens=args.max_new_tokens,
        method=method,
        **sizes,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        draft_temperature=args.draft_temperature,
        eos_token_id=-1,
        diagnostics=True,  # the root optimal-acceptance column
    )
    batch = prepared.batch
    state, compile_s, _, times = timed_runs(prepared, args.repeats)
    stats = jax.device_get(sampler.summarize_stats(state, batch))
    if np.any(stats["bad_logits"]):
        raise FloatingPointError(f"{method} n={n} K={k}: a model produced non-finite logits")
    tokens = int(np.asarray(state.num_generated)[:batch].sum())
    mean, se, steps = atn(np.asarray(stats["emitted_hist"]))
    decisions = int(np.sum(stats["decisions"]))
    wall = float(np.median(times))
    # Pooled over rows, each row's rate weighted by its root steps (None without any).
    root = {
        name: statistics.pooled_rate(stats[name], stats["root_steps"])
        for name in ("root_acceptance", "root_optimal_acceptance")
    }
    return dict(
        method=method,
        n=n if method != "ar" else 0,
        K=k,
        tree=list(tree),
        controls=bool(controls) and "json_schema" not in controls,
        json_schema="json_schema" in (controls or {}),
        ms_per_step=1e3 * wall / max(int(np.max(stats["target_calls"])), 1),
        scored_nodes_per_step=float(
            np.sum(stats["scored_nodes_per_step"] * stats["target_calls"])
            / max(np.sum(stats["target_calls"]), 1)
        ),
        tokens=tokens,
        steps=steps,
        tokens_per_step=mean,
        tokens_per_step_se=se,
        target_calls_per_row=float(np.mean(stats["target_calls"])),
        acceptance=float(np.sum(stats["accepted"]) / decisions) if decisions else None,
        fallbacks=int(np.sum(stats["fallbacks"])),
        compile_s=compile_s,
        wall_s=wall,
        wall_s_runs=times,
        tokens_per_s=tokens / wall,
        root_acceptance=root.get("root_acceptance"),
        root_optimal_acceptance=root.get("root_optimal_acceptance"),
    )


def run_hf(target, draft, prompts, ns, args, progress=None) -> list[dict]:
    """transformers ``generate`` (whole batch) and assisted generation (row by row) per n.

    Ragged prompts are left-padded for the batched ``generate`` (with their attention mask).
    """
    import torch
    import transformers

    torch.set_num_threads(args.torch_threads)

    def load(path):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        model.generation_config.eos_token_id = None  # every row runs to max_new_tokens, as ours
        return model

    hf_target, hf_draft = load(target.path), load(draft.path)
    sampling = dict(do_sample=args.temperature > 0, top_k=args.top_k or 0, top_p=args.top_p or 1.0)
    if args.temperature > 0:
        sampling["temperature"] = args.temperature
    rows_b = [list(map(int, row)) for row in prompts]
    width = max(len(row) for row in rows_b)
    ids = torch.as_tensor([[0] * (width - len(r)) + r for r in rows_b], dtype=torch.long)
    mask = torch.as_tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows_b])

    def generate(rows, new_tokens, attention_mask=None, **extra):
        out = hf_target.generate(
            rows,
            attention_mask=torch.ones_like(rows) if attention_mask is None else attention_mask,
            max_new_tokens=new_tokens,
            pad_token_id=0,
            **sampling,
            **extra,
        )
        return int(out.shape[0] * (out.shape[1] - rows.shape[1]))

    def timed(name, n, fn):
        torch.manual_seed(args.seed)
        times, tokens = [], 0
        for _ in range(max(args.repeats, 1)):
            start = time.perf_counter()
            tokens = fn()
            times.append(time.perf_counter() - start)
        wall = float(np.median(times))
        if progress is not None:
            progress.update()
        return dict(run=name, n=n, tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall)

    results = []
    with torch.no_grad():
        one = torch.as_tensor([rows_b[0]], dtype=torch.long)
        generate(one, 2)  # warm-up: first-call allocations are not decoding speed
        results.append(
            timed("generate", 0, lambda: generate(ids, args.max_new_tokens, attention_mask=mask))
        )
        config = hf_draft.generation_config
        config.num_assistant_tokens_schedule = "constant"
        config.assistant_confidence_threshold = 0.0  # off: no early exit, exactly n per step
        for n in ns:
            config.num_assistant_tokens = n
            results.append(
                timed(
                    "assisted",
                    n,
                    lambda: sum(
                        generate(
                            torch.as_tensor([row], dtype=torch.long),
                            args.max_new_tokens,
                            assistant_model=hf_draft,
                        )
                        for row in rows_b
                    ),
                )
            )
    return results


def asps_gain(rows: list[dict]) -> list[dict]:
    """ASpS's tokens per step over SpS's at each n (the ASpS paper's ATN gain)."""
    by = {(r["method"], r["n"]): r for r in rows if r["K"] == 1}
    gains = []
    for (method, n), a in sorted(by.items(), key=lambda item: item[0][1]):
        s = by.get(("sps", n))
        if method != "asps" or s is None:
            continue
        g, se = ratio_se(
            a["tokens_per_step"],
            a["tokens_per_step_se"],
            s["tokens_per_step"],
            s["tokens_per_step_se"],
        )
        gains.append(
            dict(n=n, sps=s["tokens_per_step"], asps=a["tokens_per_step"], gain=g, gain_se=se)
        )
    return gains


def separation(rows: list[dict]) -> list[str]:
    """For each draft length, the speculative runs in order of tokens per step, each beside the
    next: separated when their difference exceeds twice its standard error, else said to be
    within it (a larger --batch-size / --max-new-tokens would tell them apart)."""
    lines = []
    for n in sorted({r["n"] for r in rows if r["method"] != "ar"}):
        runs = sorted(
            (r for r in rows if r["method"] != "ar" and r["n"] == n),
            key=lambda r: -r["tokens_per_step"],
        )
        for a, b in zip(runs, runs[1:]):
            diff = a["tokens_per_step"] - b["tokens_per_step"]
            se = math.hypot(a["tokens_per_step_se"], b["tokens_per_step_se"])
            names = f"{a['method']} (K={a['K']}) vs {b['method']} (K={b['K']}), n={n}"
            verdict = "separated" if diff > 2 * se else "NOT separated at this size"
            lines.append(f"- {names}: {diff:+.3f} ± {se:.3f} tokens per step: {verdict}")
    return lines


def add_speedups(rows: list[dict], hf: list[dict]) -> None:
    ar = next(r for r in rows if r["method"] == "ar")["tokens_per_s"]
    gen = next((h["tokens_per_s"] for h in hf if h["run"] == "generate"), None)
    assisted = {h["n"]: h["tokens_per_s"] for h in hf if h["run"] == "assisted"}
    for r in rows:
        r["speedup_vs_ar"] = r["tokens_per_s"] / ar
        r["speedup_vs_hf_generate"] = r["tokens_per_s"] / gen if gen else None
        a = assisted.get(r["n"])
        r["speedup_vs_hf_assisted"] = r["tokens_per_s"] / a if a else None


def _x(value) -> str:
    return "—" if value is None else f"{value:.2f}x"


def markdown(rows, hf, gains) -> str:
    out = [
        "| method | K | n | tokens/step | target calls/row | acceptance | root acc (optimal) "
        "| compile s | run s "
        "| tok/s | vs our AR | vs HF generate | vs HF assisted (same n) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        acc = "—" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
        root = "—"
        if r["root_acceptance"] is not None:
            root = f"{r['root_acceptance']:.3f} ({r['root_optimal_acceptance']:.3f})"
        name = r["method"] + (f" tree={','.join(map(str, r['tree']))}" if r.get("tree") else "")
        out.append(
            f"| {name} | {r['K']} | {r['n'] or '—'} | {r['tokens_per_step']:.3f} ± "
            f"{r['tokens_per_step_se']:.3f} | {r['target_calls_per_row']:.1f} | {acc} | {root} | "
            f"{r['compile_s']:.1f} | {r['wall_s']:.3f} | {r['tokens_per_s']:.0f} | "
            f"{_x(r['speedup_vs_ar'])} | {_x(r['speedup_vs_hf_generate'])} | "
            f"{_x(r['speedup_vs_hf_assisted'])} |"
        )
    if hf:
        out += ["", "| transformers | n | run s | tok/s |", "|---|---:|---:|---:|"]
        out += [
            f"| {h['run']} | {h['n'] or '—'} | {h['wall_s']:.3f} | {h['tokens_per_s']:.0f} |"
            for h in hf
        ]
    if gains:
        out += ["", "| n | SpS tokens/step | ASpS tokens/step | ASpS gain ± SE |"]
        out += ["|---:|---:|---:|---:|"]
        out += [
            f"| {g['n']} | {g['sps']:.3f} | {g['asps']:.3f} | "
            f"{g['gain']:.3f} ± {g['gain_se']:.3f} |"
            for g in gains
        ]
    return "\n".join(out)


def _source(args) -> str:
    if args.prompts:
        return f" (at most, from {args.prompts})"
    return f" (at most, {args.task})" if args.task else ""


def controls_markdown(rows: list[dict], controlled: list[dict]) -> str:
    """Time per step (one target call of the loop) without and with every control on."""
    lines = [
        f"Sampling controls on ({CONTROLS}):",
        "",
        "| method | n | K | ms/step | ms/step, controls | ratio | tok/s | tok/s, controls |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a, b in zip(rows, controlled):
        lines.append(
            f"| {a['method']}{' tree=' + str(a['tree']) if a['tree'] else ''} | {a['n']} | "
            f"{a['K']} | {a['ms_per_step']:.2f} | {b['ms_per_step']:.2f} | "
            f"{b['ms_per_step'] / a['ms_per_step']:.3f} | {a['tokens_per_s']:.0f} | "
            f"{b['tokens_per_s']:.0f} |"
        )
    return "\n".join(lines)


def schema_markdown(rows: list[dict], constrained: list[dict]) -> str:
    """Tokens per step and tokens/s without and with the JSON-schema constraint."""
    lines = [
        f"JSON-schema constraint (BENCH_SCHEMA: {json.dumps(BENCH_SCHEMA)}):",
        "",
        "| method | n | K | tok/step | tok/step, schema | ms/step | ms/step, schema | tok/s | "
        "tok/s, schema |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for a, b in zip(rows, constrained):
        lines.append(
            f"| {a['method']}{' tree=' + str(a['tree']) if a['tree'] else ''} | {a['n']} | "
            f"{a['K']} | {a['tokens_per_step']:.2f} | {b['tokens_per_step']:.2f} | "
            f"{a['ms_per_step']:.2f} | {b['ms_per_step']:.2f} | {a['tokens_per_s']:.0f} | "
            f"{b['tokens_per_s']:.0f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        fill_quick(parser, args, QUICK)
    try:
        check_args(args)
    except ValueError as err:
        parser.error(str(err))
    args.no_hf = skip_hf("benchmark", args.no_hf)

    try:  # prompt sources fail before any model is loaded
        if args.prompts:
            texts = read_prompts(args.prompts)
        elif args.task:
            texts = task_prompts(args.task, args.batch_size)
        else:
            texts = None
    except ValueError as err:
        parser.error(str(err))
    target = asps_jax.load_model(args.target, dtype=args.dtype)
    draft = asps_jax.load_model(args.draft, dtype=args.dtype)
    if texts is None:
        prompts = build_prompts(
            target.tokenizer, target.vocab_size, args.batch_size, args.prompt_tokens
        ).tolist()
    else:
        prompts = encode_prompts(
            texts, target.tokenizer, target.vocab_size, args.batch_size, args.prompt_tokens
        )
    runs = plan(args.methods, args.n, args.k, args.trees)
    ns = sorted(set(args.n))
    progress = tqdm(
        total=len(runs) + (0 if args.no_hf else 1 + len(ns)),
        desc="benchmark",
        unit="run",
        file=sys.stderr,
        delay=2.0,  # short runs show no bar
        disable=args.quiet or not sys.stdout.isatty(),
    )
    rows, controlled, constrained = [], [], []
    for method, n, k, tree in runs:
        label = f"{method} n={n} K={k}" + (f" tree={tree}" if tree else "")
        progress.set_postfix_str(label)
        rows.append(run_ours(target, draft, prompts, method, n, k, args, tree))
        if args.controls:
            controlled.append(run_ours(target, draft, prompts, method, n, k, args, tree, CONTROLS))
        if args.json_schema:
            schema = dict(json_schema=BENCH_SCHEMA)
            constrained.append(run_ours(target, draft, prompts, method, n, k, args, tree, schema))
        progress.update()
        if not args.quiet:
            progress.write(f"# {label}: {rows[-1]['tokens_per_s']:.0f} tok/s", file=sys.stderr)
    if not args.no_hf:
        progress.set_postfix_str("transformers")
    hf = [] if args.no_hf else run_hf(target, draft, prompts, ns, args, progress)
    progress.close()
    add_speedups(rows, hf)
    gains = asps_gain(rows)

    header = (
        f"target {args.target}, draft {args.draft}; batch {args.batch_size}, prompt "
        f"{args.prompt_tokens} tokens{_source(args)},"
        f" {args.max_new_tokens} new tokens, temperature "
        f"{args.temperature}, draft temperature {_draft_temperature(args)}, top-k {args.top_k}, "
        f"top-p {args.top_p}, seed {args.seed}; ours "
        f"{args.dtype} jax {jax.__version__} ({jax.default_backend()}); "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    )
    if hf:
        import torch
        import transformers

        header += (
            f"; transformers {transformers.__version__}, torch {torch.__version__} float32 eager "
            f"attention, {args.torch_threads} thread(s)"
        )
    print(header + "\n\n" + markdown(rows, hf, gains))
    apart = separation(rows)
    if apart:
        print("\nTokens per step, each run against the next (difference ± standard error):")
        print("\n".join(apart))
    if controlled:
        print("\n" + controls_markdown(rows, controlled))
    if constrained:
        print("\n" + schema_markdown(rows, constrained))
    if args.json:
        meta = dict(vars(args), header=header, jax=jax.__version__, prompts=prompts)
        rows_by_kind = {
            "config": meta,
            "ours": rows,
            "ours_with_controls": controlled,
            "ours_with_json_schema": constrained,
            "transformers": hf,
            "asps_gain": gains,
        }
        write_json(args.json, rows_by_kind)
    return 0


if __name__ == "__main__":
    sys.exit(main())
