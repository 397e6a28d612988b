"""Dump ``sample``'s outputs for every method x drafter x feature family on the bundled pair, so two
checkouts can be compared draw for draw (a refactoring must leave every draw as it was).

    python scripts/compare_outputs.py --out new.npz          # in one checkout
    python scripts/compare_outputs.py --out old.npz          # in the other (same script)
    python scripts/compare_outputs.py --compare old.npz new.npz

Each case samples a few rows with a fixed key and records the tokens, lengths, log-probabilities,
top log-probabilities and the step statistics; ``--compare`` prints one line per case (identical
or the first difference) and exits 1 if any case differs.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

PROMPTS = ["ROMEO:", "JULIET:\nO, wherefore", "KING HENRY:", "First Citizen:\nWe"]

_HEAD, _BLOCK = "eagle3:tinyshakespeare-eagle3", "block:tinyshakespeare-block"

# name -> (draft: "model", another draft= value (e.g. "self:2", "lookup", the bundled head or block
# drafter) or None, sample kwargs)
CASES = {
    "ar": (None, dict(method="ar")),
    "ar greedy": (None, dict(method="ar", temperature=0.0)),
    "sps": ("model", dict(method="sps", num_draft_tokens=4)),
    "asps": ("model", dict(method="asps", num_draft_tokens=5)),
    "asps T=0.7 top-p": ("model", dict(method="asps", temperature=0.7, top_p=0.9, top_k=40)),
    "specinfer K=3": ("model", dict(method="specinfer", num_drafts=3, num_draft_tokens=4)),
    "spectr K=2": ("model", dict(method="spectr", num_drafts=2, num_draft_tokens=4)),
    "is K=3": ("model", dict(method="is", num_drafts=3, num_draft_tokens=4)),
    "is fixed_order": ("model", dict(method="is", num_drafts=2, rule="fixed_order")),
    "tv K=2": ("model", dict(method="tv", num_drafts=2, num_draft_tokens=4)),
    "tv tree (2,2,1)": ("model", dict(method="tv", tree=(2, 2, 1))),
    "tv_wr tree (2,1,2)": ("model", dict(method="tv_wr", tree=(2, 1, 2))),
    "is_bv tree (2,2,1)": ("model", dict(method="is_bv", tree=(2, 2, 1))),
    "asps draft T=1.3": ("model", dict(method="asps", draft_temperature=1.3)),
    "self:2 asps": ("self:2", dict(method="asps", num_draft_tokens=4)),
    "self:2 is K=2": ("self:2", dict(method="is", num_drafts=2, num_draft_tokens=3)),
    "self:2 tv tree": ("self:2", dict(method="tv", tree=(2, 2))),
    "lookup sps": ("lookup", dict(method="sps", num_draft_tokens=4)),
    "lookup asps ngram 2": ("lookup", dict(method="asps", lookup_ngram=2, lookup_max=3)),
    "confidence stop asps": ("model", dict(method="asps", draft_stop="confidence:0.3")),
    "confidence stop specinfer": (
        "model",
        dict(method="specinfer", num_drafts=2, draft_stop="confidence:0.5"),
    ),
    "controls asps": (
        "model",
        dict(
            method="asps",
            repetition_penalty=1.2,
            presence_penalty=0.3,
            frequency_penalty=0.2,
            min_p=0.05,
            no_repeat_ngram_size=3,
            logit_bias={5: 2.0, 7: -3.0},
        ),
    ),
    "controls is K=2": ("model", dict(method="is", num_drafts=2, repetition_penalty=1.3)),
    "regex tv": ("model", dict(method="tv", tree=(2, 2), regex=r"[A-Z][a-z ]{3,30}\.")),
    "regex asps": ("model", dict(method="asps", regex=r"(ROMEO|JULIET): [a-z ]{5,40}\.")),
    "stop strings asps": ("model", dict(method="asps", stop=[".", "\n\n"])),
    "stop strings lookup": ("lookup", dict(method="sps", stop=["e"])),
    "slots asps": ("model", dict(method="asps", batch_size=2)),
    "slots self:2": ("self:2", dict(method="asps", batch_size=3)),
    "slots lookup": ("lookup", dict(method="sps", batch_size=2)),
    "top logprobs": ("model", dict(method="asps", top_logprobs=3)),
    "budgets per prompt": ("model", dict(method="asps", max_new_tokens=[5, 30, 17, 40])),
    "quant:int8 asps": ("quant:int8", dict(method="asps", num_draft_tokens=4)),
    "eagle3 asps": (_HEAD, dict(method="asps", num_draft_tokens=5)),
    "eagle3 is_bv tree": (_HEAD, dict(method="is_bv", tree=(2, 2, 1))),
    "block asps n=8": (_BLOCK, dict(method="asps", num_draft_tokens=8)),
    "block greedy": (_BLOCK, dict(method="asps", temperature=0.0)),
    "block tv tree (2,2)": (_BLOCK, dict(method="tv", tree=(2, 2))),
    "block is K=2 top-p": (_BLOCK, dict(method="is", num_drafts=2, top_p=0.9, temperature=0.8)),
    "block regex asps": (_BLOCK, dict(method="asps", regex=r"(ROMEO|JULIET): [a-z ]{5,40}\.")),
    "slots block": (_BLOCK, dict(method="asps", batch_size=2)),
}


def dump(out_path: str, max_new_tokens: int, only: list[str]) -> None:
    import jax

    import asps_jax

    target = asps_jax.load_model("tinyshakespeare-target")
    model = asps_jax.load_model("tinyshakespeare-draft")
    prompts = [target.tokenizer.encode(p) for p in PROMPTS]
    arrays = {}
    for name, (draft, kwargs) in CASES.items():
        if only and name not in only:
            continue
        kwargs = dict(kwargs)
        draft = model if draft == "model" else draft
        budget = kwargs.pop("max_new_tokens", max_new_tokens)
        start = time.perf_counter()
        out = asps_jax.sample(
            target, draft, prompts, key=jax.random.key(7), max_new_tokens=budget,
            return_logprobs=True, **kwargs,
        )  # fmt: skip
        arrays[f"{name}|tokens"] = np.asarray(out.tokens)
        arrays[f"{name}|lengths"] = np.asarray(out.lengths)
        arrays[f"{name}|logprobs"] = np.asarray(out.logprobs)
        if out.top_logprobs is not None:
            arrays[f"{name}|top_ids"] = np.asarray(out.top_logprobs[0])
            arrays[f"{name}|top_logprobs"] = np.asarray(out.top_logprobs[1])
        for stat, value in out.stats.items():
            if hasattr(value, "shape") or isinstance(value, (int, float)):
                arrays[f"{name}|stats.{stat}"] = np.asarray(value)
        calls = int(np.sum(np.asarray(out.stats["target_calls"])))
        print(f"{name:28s} {time.perf_counter() - start:6.1f} s  target calls {calls}", flush=True)
    np.savez(out_path, **arrays)


def compare(old_path: str, new_path: str) -> int:
    old, new = np.load(old_path), np.load(new_path)
    cases = sorted({k.split("|")[0] for k in list(old.files) + list(new.files)})
    bad = 0
    for case in cases:
        keys = sorted({k for k in list(old.files) + list(new.files) if k.split("|")[0] == case})
        diffs = []
        for k in keys:
            if k not in old.files or k not in new.files:
                diffs.append(f"{k.split('|')[1]} only in {'new' if k in new.files else 'old'}")
            elif not np.array_equal(old[k], new[k], equal_nan=True):
                diffs.append(k.split("|")[1])
        tokens = int(np.sum(new[f"{case}|lengths"])) if f"{case}|lengths" in new.files else 0
        print(f"{case:28s} {'identical' if not diffs else 'DIFFERS: ' + ', '.join(diffs)}"
              f"  ({len(keys)} arrays, {tokens} tokens)")  # fmt: skip
        bad += bool(diffs)
    print(f"{len(cases) - bad} of {len(cases)} cases identical")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write this checkout's outputs to OUT (.npz)")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two dumps")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--case", action="append", default=[], help="only this case (repeat)")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        parser.error("give --out FILE or --compare OLD NEW")
    dump(args.out, args.max_new_tokens, args.case)
    return 0


if __name__ == "__main__":
    sys.exit(main())
