"""What ``scripts/sample.py`` prints: a run's statistics (the dict and the ``--- statistics ---``
block), the ``--json`` object of a single batch, strict JSON lines (no NaN or Infinity), the
compile counts, and the message of a model that produced NaN / inf logits.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from asps_jax import compile_cache
from asps_jax.sampler import NonFiniteLogitsError
from asps_jax.statistics import histogram_mean_stderr

ZERO_PROBABILITY_LOGPROB = -9999.0
"""The ``--top-logprobs`` value of a token of probability 0 (log-probability -inf, which strict
JSON cannot write): a finite number that readers can keep treating as one, below the
log-probability of any token a float32 law can draw (exp(-104) is 0 in float32); OpenAI's API
reports such tokens with the same value."""


def result(session):
    """``(SampleOutput, failure)``: the session's output, and the NonFiniteLogitsError of a model
    that produced an unusable law (its ``.output`` keeps the tokens before), else None."""
    try:
        return session.result(), None
    except NonFiniteLogitsError as err:
        return err.output, err


def summary(session, out, args, compile_s, run_s, load_s) -> dict:
    """The statistics of a single batch's run (the ``--json`` object starts with them)."""
    stats = {k: np.asarray(v) for k, v in out.stats.items()}
    lengths = np.asarray(out.lengths)
    calls = stats["target_calls"]
    per_step = lengths / np.maximum(calls, 1)
    mean_l, stderr_l, _ = histogram_mean_stderr(stats["emitted_hist"])
    s = {
        "method": args.method,
        "draft": args.draft if args.method != "ar" else None,
        "num_draft_tokens": session.spec.num_draft_tokens if args.method != "ar" else 0,
        "num_drafts": session.spec.num_drafts if args.method != "ar" else 0,
        "batch_size": int(lengths.size),
        "samples_per_row": args.n,
        "new_tokens": int(lengths.sum()),
        "target_calls": int(calls.sum()),
        "tokens_per_step": mean_l,
        "tokens_per_step_stderr": stderr_l,
        "tokens_per_step_by_row": per_step.round(4).tolist(),
        "acceptance": float(stats["accepted"].sum() / max(stats["decisions"].sum(), 1)),
        # Steps whose drafter proposed at least one token (with --draft lookup: found a match).
        "drafted_steps": int(stats["root_steps"].sum()),
        "lp_fallbacks": int(stats["fallbacks"].sum()),
        **timings(int(lengths.sum()), load_s, compile_s, run_s),
    }
    if getattr(session, "calibration", None) is not None:  # --num-draft-tokens auto
        s["calibration"] = dataclasses.asdict(session.calibration)
    if out.incomplete is not None:  # --regex / --json-schema: rows cut before the text matched
        s["incomplete"] = np.asarray(out.incomplete).tolist()
    return s


def timings(new_tokens: int, load_s, compile_s, run_s) -> dict:
    """The three stages' wall-clock seconds (to the millisecond) and the run's tokens per
    second."""
    return {
        "load_seconds": round(load_s, 3),
        "compile_seconds": round(compile_s, 3),
        "run_seconds": round(run_s, 3),
        "tokens_per_second": float(new_tokens / run_s) if run_s > 0 else float("nan"),
    }


def print_summary(s: dict, stream) -> None:
    """The ``--- statistics ---`` block that follows the streamed text."""
    rows = [
        ("method", s["method"]),
        ("new tokens (batch)", f"{s['new_tokens']} ({s['batch_size']} rows)"),
        ("target calls", s["target_calls"]),
        ("tokens per step", f"{s['tokens_per_step']:.3f} ± {s['tokens_per_step_stderr']:.3f}"),
        ("tokens/s (run)", f"{s['tokens_per_second']:.1f}"),
        (
            "load / compile / run s",
            f"{s['load_seconds']} / {s['compile_seconds']} / {s['run_seconds']}",
        ),
    ]
    if s["method"] != "ar":  # no draft statistics without a draft
        rows.insert(
            1, ("draft tokens n / drafts K", f"{s['num_draft_tokens']} / {s['num_drafts']}")
        )
        draft_rows = [("draft acceptance", f"{s['acceptance']:.3f}")]
        if "drafted_steps" in s:
            drafted = f"{s['drafted_steps']} of {s['target_calls']}"
            if s.get("draft") == "lookup":
                drafted += " (steps where the lookup found a match)"
            draft_rows.append(("steps with a draft", drafted))
        rows[5:5] = draft_rows
    if "incomplete" in s:
        cut = [b for b, flag in enumerate(s["incomplete"]) if flag]
        value = "none: every row's text matches" if not cut else f"rows {cut} (cut before the end)"
        rows.insert(3, ("constraint incomplete", value))
    print("\n--- statistics ---", file=stream)
    for name, value in rows:
        print(f"{name:>26}: {value}", file=stream)


def batch_json(s: dict, out, texts, tokenizer) -> dict:
    """The ``--json`` object of a single batch: the statistics ``s``, then each row's prompt,
    tokens, their log-probabilities (and the top-k of each position with ``--top-logprobs``), its
    text, and the compile counts."""
    tokens = np.asarray(out.tokens)
    lengths = np.asarray(out.lengths)
    rows = [tokens[b, : lengths[b]].tolist() for b in range(lengths.size)]
    n = s.get("samples_per_row", 1)  # row b * n + i: row b's sample i
    s["prompts"] = [texts[(b // n) % len(texts)] for b in range(lengths.size)]
    s["tokens"] = rows
    logprobs = np.asarray(out.logprobs)
    s["logprobs"] = [logprobs[b, : lengths[b]].tolist() for b in range(lengths.size)]
    if out.top_logprobs is not None:
        ids, lps = (np.asarray(a) for a in out.top_logprobs)
        # Per position, [token id, log-probability] pairs, most likely first; a token outside
        # the law's support (k exceeds it) has ZERO_PROBABILITY_LOGPROB, as strict JSON has no -inf.
        s["top_logprobs"] = [
            [
                [
                    [i, lp if math.isfinite(lp) else ZERO_PROBABILITY_LOGPROB]
                    for i, lp in zip(ids[b, t].tolist(), lps[b, t].tolist())
                ]
                for t in range(lengths[b])
            ]
            for b in range(lengths.size)
        ]
    s["texts"] = [tokenizer.decode(r, skip_special_tokens=True) for r in rows]
    s.update(compile_counts())
    return s


def compiled_note(before: dict, seconds: float) -> str:
    """What the compile stage did since ``before`` (:func:`asps_jax.compile_cache.compiles`):
    programs compiled, or all of them loaded from the persistent cache."""
    now = compile_cache.compiles()
    programs = now["programs"] - before["programs"]
    hits = now["cache_hits"] - before["cache_hits"]
    if not programs:
        return "nothing to compile: the programs were already built in this process"
    if hits == programs:
        return f"loaded the compiled programs from the cache in {seconds:.1f} s"
    loaded = f", {hits} loaded from the cache" if hits else ""
    return f"compiled {programs - hits} programs in {seconds:.1f} s{loaded}"


def compile_counts() -> dict:
    """``compiles``: XLA programs this process compiled; ``compile_cache_hits``: programs it
    loaded from the persistent cache instead (both are jit cache misses: a new shape)."""
    counts = compile_cache.compiles()
    return {
        "compiles": counts["programs"] - counts["cache_hits"],
        "compile_cache_hits": counts["cache_hits"],
    }


def strict_json(value):
    """``value`` with every non-finite float replaced by None: strict JSON has no NaN or Infinity
    (a figure undefined by the run, such as a standard error over one step, is ``null``)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    return value


def write_json(value, stream) -> None:
    """``value`` as one line of strict JSON."""
    print(json.dumps(strict_json(value), allow_nan=False), file=stream)


def nonfinite_message(err) -> str:
    """The one-line error of a run whose model produced NaN or inf logits (``err``: the
    NonFiniteLogitsError, or the same rows and positions)."""
    where = ", ".join(f"row {r} at new token {p}" for r, p in zip(err.rows, err.positions))
    return (
        f"the model produced NaN or inf logits ({where}); the text printed is what was generated "
        "before (check the checkpoint and --dtype)"
    )
