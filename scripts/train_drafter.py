"""Train an EAGLE-3 head for a target on a corpus (CPU, GPU or TPU), resumably.

    python scripts/train_drafter.py                              # the bundled head
    python scripts/train_drafter.py --target llama-3.2-1b --data corpus.jsonl --out heads/l1b
    python scripts/train_drafter.py --dataset wikitext:wikitext-2-raw-v1 --target ...  # online

The frozen target runs inside the jitted train step (online features); the head is trained by
training-time test over ``--ttt-steps`` depths (asps_jax/drafters/train.py). The head is written in
the EAGLE-3 layout (``config.json`` + ``model.safetensors``) to ``--out`` every ``--save-every``
steps with the optimizer state (``train_state.npz``), so a run that stops resumes where it was
when started again with the same ``--out``. Sample with it: ``--draft eagle3:OUT``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import shlex
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from asps_jax.drafters import head as head_lib
from asps_jax.drafters import train
from asps_jax.models import load_model
from asps_jax.models.base import run_params

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO_ROOT / "data/tinyshakespeare.txt"
STATE_FILE, LOG_FILE = "train_state.npz", "training.json"


def read_corpus(args) -> tuple[list[str], dict]:
    """The corpus' documents and where they came from: a text file (one document), JSON lines
    (each line's ``"text"``), or a ``datasets`` name (``NAME[:CONFIG]``, its train split)."""
    if args.dataset:
        try:
            import datasets
        except ImportError:
            sys.exit('--dataset needs the datasets package: pip install -e ".[data]"')
        name, _, subset = args.dataset.partition(":")
        try:
            rows = datasets.load_dataset(name, subset or None, split="train")
        except Exception as e:  # noqa: BLE001 - the hub's errors are many; one line for all
            sys.exit(f"--dataset {args.dataset}: could not load it ({type(e).__name__}: {e})")
        docs = [r["text"] for r in rows if r.get("text")]
        return docs, {"dataset": args.dataset, "documents": len(docs)}
    path = Path(args.data)
    if not path.is_file():
        sys.exit(f"--data {path}: no such file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        sys.exit(f"--data {path}: not UTF-8 text ({e})")
    info = {"path": _shown(path), "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    if path.suffix in (".jsonl", ".json"):
        docs = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"--data {path}: line {n} is not JSON ({e})")
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                sys.exit(f'--data {path}: line {n} has no "text" string')
            docs.append(row["text"])
        return docs, dict(info, documents=len(docs))
    return [text], info


def _shown(path) -> str:
    """A path as the log records it: relative to the repository when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def tokenize(tokenizer, docs: list[str]) -> np.ndarray:
    """One stream of token ids: each document's, after the tokenizer's BOS when it has one."""
    bos = getattr(tokenizer, "bos_token_id", None)
    out = []
    for doc in docs:
        ids = tokenizer(doc, add_special_tokens=False, verbose=False)["input_ids"]
        out.append(([bos] if bos is not None else []) + list(ids))
    return np.concatenate([np.asarray(ids, np.int32) for ids in out])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train an EAGLE-3 head for a target, resumably; write it in the EAGLE-3 "
        "checkpoint layout.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--target", default="tinyshakespeare-target", help="the target: alias or path")
    p.add_argument("--data", default=str(DEFAULT_DATA), help="corpus: a text or JSON-lines file")
    p.add_argument("--dataset", help="a datasets name NAME[:CONFIG] instead of --data (online)")
    p.add_argument("--out", help="the head's folder (default: models/<target>-eagle3)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps in all")
    p.add_argument("--batch-size", type=int, default=8, help="windows per optimizer step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per window")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps, then cosine")
    p.add_argument("--ttt-steps", type=int, default=3, help="depths trained (training-time test)")
    p.add_argument("--draft-vocab", type=int, help="V_d, the head's vocabulary (default: V)")
    p.add_argument(
        "--feature-layers", help="the target layers read, e.g. 2,16,29 (default: EAGLE-3's)"
    )
    p.add_argument("--val-fraction", type=float, default=0.05, help="held-out tail of the corpus")
    p.add_argument("--save-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--seed", type=int, default=0, help="seeds the initial weights and batches")
    p.add_argument(
        "--kind",
        choices=("eagle3", "block"),
        default="eagle3",
        help="an EAGLE-3 head, or a parallel block drafter (--draft block:OUT)",
    )
    p.add_argument("--block-size", type=int, default=8, help="block: positions per forward")
    p.add_argument("--block-layers", type=int, default=1, help="block: its decoder layers")
    p.add_argument("--anchors", type=int, default=64, help="block: blocks trained per window")
    return p


def check_args(p, args) -> None:
    """One-line errors naming the flag (argparse exits with status 2)."""
    for flag in ("steps", "batch_size", "seq_len", "ttt_steps", "save_every", "block_size",
                 "block_layers", "anchors"):  # fmt: skip
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.seq_len < 4:
        p.error(f"--seq-len must be >= 4 (a window trains seq_len - 2 entries), got {args.seq_len}")
    if not 0 < args.lr < 1:
        p.error(f"--lr must be in (0, 1), got {args.lr}")
    if not 0 <= args.val_fraction < 0.5:
        p.error(f"--val-fraction must be in [0, 0.5), got {args.val_fraction}")


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    started = time.perf_counter()
    target = load_model(args.target)
    if target.tokenizer is None:
        sys.exit(f"--target {args.target}: it has no tokenizer to read the corpus with")
    layers = None
    if args.feature_layers:
        try:
            layers = tuple(int(x) for x in args.feature_layers.split(","))
        except ValueError:
            sys.exit(f"--feature-layers {args.feature_layers!r}: give layer ids, e.g. 2,16,29")
    out = Path(args.out or REPO_ROOT / "models" / f"{Path(args.target).name}-{args.kind}")
    docs, data_info = read_corpus(args)
    ids = tokenize(target.tokenizer, docs)
    n_val = int(len(ids) * args.val_fraction)
    train_ids, val_ids = ids[: len(ids) - n_val], ids[len(ids) - n_val :]
    if args.kind == "block":
        return train_block(args, argv, target, train_ids, val_ids, data_info, layers, out, started)
    vocab = target.config.vocab_size
    config = train.TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        learning_rate=args.lr,
        warmup=args.warmup,
        ttt_steps=args.ttt_steps,
    )
    target_params = run_params(target)
    opt = train.optimizer(config)
    start, log = 0, {"evals": []}
    if (out / STATE_FILE).is_file():  # resume: the head, the optimizer and the step
        head = head_lib.load_head(out, target, dtype=jnp.float32)
        head_config, params = head.config, head.params
        saved = dict(np.load(out / STATE_FILE))
        start = int(saved.pop("step"))
        learned = head_lib.trainable(params)
        opt_state = train.unflat_state(opt.init(learned), saved, f"{out / STATE_FILE}")
        if (out / LOG_FILE).is_file():
            log = json.loads((out / LOG_FILE).read_text())
        print(f"resuming {out} at step {start} of {args.steps}")
    else:
        try:
            d2t = train.vocab_map(train_ids, vocab, args.draft_vocab or vocab)
            head_config = head_lib.HeadConfig.for_target(target.config, len(d2t), layers)
            head_lib.check_matches(head_config, target, "--feature-layers")
        except ValueError as e:
            sys.exit(str(e))
        params = head_lib.init_params(
            head_config, jax.random.key(args.seed), target.params["embed"], d2t
        )
        learned = head_lib.trainable(params)
        opt_state = opt.init(learned)
    fixed = {"embed": params["embed"], "d2t": params["d2t"]}
    try:
        val = train.sample_windows(np.random.default_rng(1), val_ids, 4 * args.batch_size,
                                   args.seq_len) if n_val >= args.seq_len else None  # fmt: skip
        # Step i's windows come from a generator seeded by (seed, i): a resumed run draws what
        # the uninterrupted one would have.
        batches = (train.sample_windows(np.random.default_rng([args.seed, i]), train_ids,
                                        args.batch_size, args.seq_len)
                   for i in range(start, args.steps))  # fmt: skip
        first = next(batches, None)
    except ValueError as e:
        sys.exit(f"--data: {e}")

    def evaluate():
        if val is None:
            return None
        loss, m = train.eval_step(
            head_config, config, target.config, learned, fixed, target_params, val
        )
        return {"loss": float(loss), **{k: float(v) for k, v in m.items()}}

    def save(step):
        save_head_state(out, head_config, {**learned, **fixed}, opt_state, step)
        log.update(
            target=args.target,
            data=data_info,
            tokens={"train": int(len(train_ids)), "val": int(len(val_ids))},
            command="python " + shlex.join(["scripts/train_drafter.py", *(argv or sys.argv[1:])]),
            config={
                k: _shown(v) if k in ("data", "out") and v else v for k, v in vars(args).items()
            },  # fmt: skip
            step=step,
        )
        (out / LOG_FILE).write_text(json.dumps(log, indent=2) + "\n")

    progress = tqdm(total=args.steps, initial=start, desc="head", unit="step", dynamic_ncols=True)
    tokens_seen, t0 = 0, time.perf_counter()
    step = start
    batch = first
    while batch is not None:
        learned, opt_state, loss, m = train.train_step(
            head_config, config, target.config, learned, opt_state, fixed, target_params,
            jnp.asarray(batch),
        )  # fmt: skip
        step += 1
        tokens_seen += batch.size
        progress.update(1)
        if step % 10 == 0 or step == args.steps:
            loss = float(loss)  # waits for the step: the rate counts finished work only
            rate = tokens_seen / (time.perf_counter() - t0)
            progress.set_postfix(loss=f"{loss:.3f}", acc0=f"{float(m['acc_0']):.3f}",
                                 tok_s=f"{rate:.0f}")  # fmt: skip
        if step % args.save_every == 0 or step == args.steps:
            ev = evaluate()
            if ev is not None:
                log["evals"].append(dict(step=step, **ev))
                tqdm.write(f"step {step}: val loss {ev['loss']:.4f}, first-position accuracy "
                           f"{ev['acc_0']:.3f}")  # fmt: skip
            log["train_wall_time_s"] = log.get("train_wall_time_s", 0.0) + (
                time.perf_counter() - t0
            )
            t0, tokens_seen = time.perf_counter(), 0
            save(step)
        batch = next(batches, None)
    progress.close()
    log["total_wall_time_s"] = round(time.perf_counter() - started, 1)
    save(step)
    print(f"wrote {out} (step {step}); sample with --draft eagle3:{out}")
    return 0


def train_block(args, argv, target, train_ids, val_ids, data_info, layers, out, started) -> int:
    """``--kind block``: the block drafter's resumable training (drafters/block_train.py)."""
    from asps_jax.drafters import block_model, block_train

    config = block_train.BlockTrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, learning_rate=args.lr,
        warmup=args.warmup, anchors=args.anchors,
    )  # fmt: skip
    if args.seq_len <= args.block_size:
        sys.exit(f"--seq-len {args.seq_len} must exceed --block-size {args.block_size}")
    try:
        vocab = target.config.vocab_size
        d2t = train.vocab_map(train_ids, vocab, args.draft_vocab or vocab)
        make = functools.partial(
            block_model.BlockConfig.for_target,
            target.config,
            layers=layers,
            block_size=args.block_size,
            num_layers=args.block_layers,
        )
        block_model.check_matches(make(draft_vocab_size=len(d2t)), target, "--feature-layers")
        step = block_train.fit(
            target, run_params(target), train_ids, val_ids, out, config,
            make_config=lambda n: make(draft_vocab_size=n), d2t=d2t, seed=args.seed,
            save_every=args.save_every,
            info=dict(target=args.target, data=data_info, command="python " + shlex.join(
                ["scripts/train_drafter.py", *(argv or sys.argv[1:])]),
                tokens={"train": int(len(train_ids)), "val": int(len(val_ids))},
                config={k: _shown(v) if k in ("data", "out") and v else v
                        for k, v in vars(args).items()}),
        )  # fmt: skip
    except ValueError as e:
        sys.exit(str(e))
    print(f"wrote {out} (step {step}, {time.perf_counter() - started:.0f} s); sample with "
          f"--draft block:{out}")  # fmt: skip
    return 0


def save_head_state(out: Path, head_config, params, opt_state, step: int) -> None:
    """The head (EAGLE-3 layout) and the optimizer state, each file replaced atomically."""
    head_lib.save_head(out, head_config, params)
    tmp = out / (STATE_FILE + ".tmp.npz")
    np.savez(tmp, step=np.asarray(step), **train.flat_state(opt_state))
    tmp.replace(out / STATE_FILE)


if __name__ == "__main__":
    sys.exit(main())
