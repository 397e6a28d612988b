"""Train an EAGLE-3 head for a target on a corpus (CPU, GPU or TPU), resumably.

    python scripts/train_drafter.py --quick                      # a one-minute check of the set-up
    python scripts/train_drafter.py --preset tinyshakespeare-eagle3   # the bundled head's recipe
    python scripts/train_drafter.py --target llama-3.2-1b --data corpus.jsonl --out heads/l1b
    python scripts/train_drafter.py --dataset wikitext:wikitext-2-raw-v1 --target ...  # online

The frozen target runs inside the jitted train step (online features); the head is trained by
training-time test over ``--ttt-steps`` depths (asps_jax/drafters/train.py). The head is written in
the EAGLE-3 layout (``config.json`` + ``model.safetensors``) to ``--out`` (default
``./<target>-eagle3`` in the current directory, never into the checkout's ``models/``) every
``--save-every`` steps with the optimizer state (``train_state.npz``) and the log
(``training.json``), so a run that stops resumes where it was when started again with the same
``--out`` (the same ``--target`` and ``--feature-layers``, else it is refused). Sample with it:
``--draft eagle3:OUT``. ``--preset NAME`` sets the flags of a recorded recipe (``PRESETS``; flags
given as well win); ``--quick`` a short run that only checks the set-up.

Exit status: 0 done; 1 the head diverged (NaN / inf weights or loss: not saved, the last
checkpoint kept); 2 a bad argument, corpus or checkpoint, or a failed write (a full disk: the last
checkpoint kept, no temporary file left); 130 interrupted (Ctrl-C: the step under way finishes, the
head is saved at it, and the run resumes from there). Every error is one line.
"""

from __future__ import annotations

import signal  # first: a Ctrl-C from here on is recorded


class _CtrlC:
    """Whether SIGINT came; the loop acts on it after the step under way (see sample.py)."""

    requested = False


def _record_sigint(signum, frame) -> None:
    _CtrlC.requested = True


def _take_sigint():
    """Install :func:`_record_sigint`; the handler it replaced, or None where it did not."""
    try:
        previous = signal.getsignal(signal.SIGINT)
        if previous is None or previous is signal.SIG_IGN:
            return None
        signal.signal(signal.SIGINT, _record_sigint)
    except ValueError:  # not the main thread: Python's KeyboardInterrupt, caught below
        return None
    return previous


if __name__ == "__main__":
    _take_sigint()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import zipfile  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO_ROOT / "data/tinyshakespeare.txt"
STATE_FILE, LOG_FILE = "train_state.npz", "training.json"
HEAD_FILES = ("config.json", "model.safetensors")
INTERRUPTED, DIVERGED = 130, 1
PROG = "train_drafter.py"

# Recorded recipes: flag -> value (docs/benchmarks.md, "Learned heads"; the bundled head's own
# models/tinyshakespeare-eagle3/training.json records the same command).
PRESETS = {
    "tinyshakespeare-eagle3": dict(
        target="tinyshakespeare-target",
        data=str(DEFAULT_DATA),
        steps=800,
        seq_len=256,
        batch_size=8,
        save_every=100,
        lr=3e-3,
        warmup=20,
        ttt_steps=3,
        val_fraction=0.05,
        seed=0,
    ),  # fmt: skip
}
QUICK = dict(steps=20, batch_size=4, seq_len=64, save_every=10, warmup=2)


class _Interrupted(Exception):
    """Ctrl-C before the first step; ``stage`` says what was under way."""


class _Diverged(Exception):
    """The head's loss or weights went NaN / inf."""


def _stop_if_interrupted(stage: str) -> None:
    if _CtrlC.requested:
        raise _Interrupted(stage)


@contextlib.contextmanager
def _sigint_recorded():
    previous = _take_sigint()
    if previous is not _record_sigint:
        _CtrlC.requested = False
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def read_corpus(args) -> tuple[list[str], dict]:
    """The corpus' documents and where they came from: a text file (one document), JSON lines
    (each line's ``"text"``; a UTF-8 BOM is skipped), or a ``datasets`` name (``NAME[:CONFIG]``,
    its train split). No document with text is an error."""
    if args.dataset:
        try:
            import datasets
        except ImportError:
            raise ValueError(
                '--dataset needs the datasets package: pip install -e ".[data]"'
            ) from None
        name, _, subset = args.dataset.partition(":")
        try:
            rows = datasets.load_dataset(name, subset or None, split="train")
        except Exception as e:  # noqa: BLE001 - the hub's errors are many; one line for all
            raise ValueError(
                f"--dataset {args.dataset}: could not load it ({type(e).__name__}: {e})"
            ) from None
        docs = [r["text"] for r in rows if r.get("text")]
        if not docs:
            raise ValueError(f"--dataset {args.dataset}: no row has text")
        return docs, {"dataset": args.dataset, "documents": len(docs)}
    path = Path(args.data)
    if not path.is_file():
        raise ValueError(f"--data {path}: no such file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"--data {path}: not UTF-8 text ({e})") from None
    info = {"path": _shown(path), "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    if path.suffix not in (".jsonl", ".json"):
        if not text.strip():
            raise ValueError(f"--data {path}: the file is empty")
        return [text], info
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--data {path}: line {n} is not JSON ({e})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise ValueError(f'--data {path}: line {n} has no "text" string')
        if row["text"]:
            docs.append(row["text"])
    if not docs:
        raise ValueError(f'--data {path}: no line has a non-empty "text" (an empty corpus)')
    return docs, dict(info, documents=len(docs))


def _shown(path) -> str:
    """A path as the log records it: relative to the repository when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def tokenize(tokenizer, docs: list[str]):
    """One stream of token ids: each document's, after the tokenizer's BOS when it has one."""
    bos = getattr(tokenizer, "bos_token_id", None)
    out = []
    for doc in docs:
        ids = tokenizer(doc, add_special_tokens=False, verbose=False)["input_ids"]
        out.append(([bos] if bos is not None else []) + list(ids))
    return np.concatenate([np.asarray(ids, np.int32) for ids in out])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Train an EAGLE-3 head for a target, resumably; write it in the EAGLE-3 "
        "checkpoint layout.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--preset", choices=sorted(PRESETS), help="a recorded recipe's flags")
    p.add_argument("--quick", action="store_true", help=f"a short check of the set-up: {QUICK}")
    p.add_argument("--target", default="tinyshakespeare-target", help="the target: alias or path")
    p.add_argument("--data", default=str(DEFAULT_DATA), help="corpus: a text or JSON-lines file")
    p.add_argument("--dataset", help="a datasets name NAME[:CONFIG] instead of --data (online)")
    p.add_argument("--out", help="the head's folder (default: ./<target>-eagle3, or <preset>)")
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
    p.add_argument(
        "--readout",
        choices=("recurrent", "position"),
        default="recurrent",
        help="block: depth i's law from the drawn path too (recurrent) or not",
    )
    p.add_argument(
        "--readout-size",
        type=int,
        default=None,
        help="block: the recurrent readout's width (default: the drafter's width)",
    )
    return p


def parse(argv):
    """The flags, a ``--preset``'s or ``--quick``'s values in place of the defaults (a flag
    given as well wins)."""
    p = build_parser()
    first, _ = build_parser().parse_known_args(argv)
    if first.preset:
        p.set_defaults(**PRESETS[first.preset], out=first.preset)
    if first.quick:
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p, args) -> None:
    """One-line errors naming the flag (argparse exits with status 2)."""
    for flag in ("steps", "batch_size", "seq_len", "ttt_steps", "save_every", "block_size",
                 "block_layers", "anchors"):  # fmt: skip
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.readout_size is not None and args.readout_size < 1:
        p.error(f"--readout-size must be >= 1, got {args.readout_size}")
    if args.seq_len < 4:
        p.error(f"--seq-len must be >= 4 (a window trains seq_len - 2 entries), got {args.seq_len}")
    if not 0 < args.lr < 1:
        p.error(f"--lr must be in (0, 1), got {args.lr}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.draft_vocab is not None and args.draft_vocab < 1:
        p.error(f"--draft-vocab must be >= 1 (the head's vocabulary), got {args.draft_vocab}")
    if not 0 <= args.val_fraction < 0.5:
        p.error(f"--val-fraction must be in [0, 0.5), got {args.val_fraction}")
    if args.feature_layers is not None:
        try:
            args.layers = tuple(int(x) for x in args.feature_layers.split(","))
        except ValueError:
            p.error(f"--feature-layers {args.feature_layers!r}: give layer ids, e.g. 2,16,29")
    else:
        args.layers = None


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (the module docstring)."""
    with _sigint_recorded():
        try:
            return _main(argv)
        except _Interrupted as stop:
            print(f"\n{PROG}: interrupted while {stop}; nothing was saved", file=sys.stderr)
            return INTERRUPTED


def _main(argv) -> int:
    args = parse(argv)
    try:
        return run(args, argv)
    except KeyboardInterrupt:  # Python's own handler (main() off the main thread)
        print(f"\n{PROG}: interrupted; --out keeps its last checkpoint, if any", file=sys.stderr)
        return INTERRUPTED
    except _Diverged as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return DIVERGED
    except (ValueError, OSError, NotImplementedError) as err:  # CheckpointError: a ValueError
        message = " ".join(str(err).split())
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2


def run(args, argv) -> int:
    """Load, prepare or resume, train; returns the exit status."""
    from asps_jax.drafters import train
    from asps_jax.models import load_model

    started = time.perf_counter()
    _stop_if_interrupted("starting")
    target = load_model(args.target)
    if target.tokenizer is None:
        raise ValueError(f"--target {args.target}: it has no tokenizer to read the corpus with")
    vocab = target.config.vocab_size
    if args.draft_vocab is not None and args.draft_vocab > vocab:
        raise ValueError(f"--draft-vocab {args.draft_vocab}: at most the target's {vocab} tokens")
    out = Path(args.out or f"{Path(args.target).name}-{args.kind}")
    check_out(out)
    _stop_if_interrupted("loading the target")
    docs, data_info = read_corpus(args)
    ids = tokenize(target.tokenizer, docs)
    n_val = int(len(ids) * args.val_fraction)
    data = dict(train=ids[: len(ids) - n_val], val=ids[len(ids) - n_val :], info=data_info)
    if args.kind == "block":
        return train_block(args, argv, target, data, out, started)
    config = train.TrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        learning_rate=args.lr, warmup=args.warmup, ttt_steps=args.ttt_steps,
    )  # fmt: skip
    _stop_if_interrupted("reading the corpus")
    if (out / STATE_FILE).exists():
        job = resume(args, out, target, config)
    else:
        job = start(args, out, target, config, data["train"])
    job.update(target=target, config=config, out=out, data=data, started=started)
    job["windows"] = windows(args, data, job["start"])
    _stop_if_interrupted("preparing the head")
    return train_loop(args, argv, job)


def train_block(args, argv, target, data, out, started) -> int:
    """``--kind block``: the block drafter's resumable training (drafters/block_train.py)."""
    import functools

    from asps_jax.drafters import block_model, block_train, train
    from asps_jax.models.base import run_params

    if args.seq_len <= args.block_size:
        raise ValueError(f"--seq-len {args.seq_len} must exceed --block-size {args.block_size}")
    config = block_train.BlockTrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, learning_rate=args.lr,
        warmup=args.warmup, anchors=args.anchors,
    )  # fmt: skip
    train_ids, val_ids = data["train"], data["val"]
    vocab = target.config.vocab_size
    d2t = train.vocab_map(train_ids, vocab, args.draft_vocab or vocab)
    make = functools.partial(
        block_model.BlockConfig.for_target,
        target.config,
        layers=args.layers,
        block_size=args.block_size,
        num_layers=args.block_layers,
        readout=args.readout,
        readout_size=args.readout_size,
    )
    block_model.check_matches(make(draft_vocab_size=len(d2t)), target, "--feature-layers")
    step = block_train.fit(
        target, run_params(target), train_ids, val_ids, out, config,
        make_config=lambda n: make(draft_vocab_size=n), d2t=d2t, seed=args.seed,
        save_every=args.save_every,
        info=dict(target=args.target, data=data["info"], command="python " + shlex.join(
            ["scripts/train_drafter.py", *(argv or sys.argv[1:])]),
            tokens={"train": int(len(train_ids)), "val": int(len(val_ids))},
            config={k: _shown(v) if k in ("data", "out") and v else v
                    for k, v in vars(args).items() if k != "layers"}),
    )  # fmt: skip
    print(f"wrote {out} (step {step}, {time.perf_counter() - started:.0f} s); sample with "
          f"--draft block:{out}")  # fmt: skip
    return 0


def check_out(out: Path) -> None:
    """``--out``: a new folder, or one this script wrote (with its ``train_state.npz``); a file,
    or a head folder without it (a finished or foreign head, the bundled one), is refused
    before any step, so no head is overwritten."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: a file, not a folder")
    if not (out / STATE_FILE).exists() and any((out / f).exists() for f in HEAD_FILES):
        raise ValueError(
            f"--out {out}: holds a head but no {STATE_FILE} to resume it from (not a run of this "
            "script, or its state was removed); give another --out"
        )


def start(args, out, target, config, train_ids) -> dict:
    """A new head: the vocabulary map from the corpus, random weights, a fresh optimizer."""
    import jax

    from asps_jax.drafters import head as head_lib
    from asps_jax.drafters import train

    vocab = target.config.vocab_size
    d2t = train.vocab_map(train_ids, vocab, args.draft_vocab or vocab)
    head_config = head_lib.HeadConfig.for_target(target.config, len(d2t), args.layers)
    head_lib.check_matches(head_config, target, "--feature-layers")
    params = head_lib.init_params(
        head_config, jax.random.key(args.seed), target.params["embed"], d2t
    )
    learned = head_lib.trainable(params)
    fixed = {"embed": params["embed"], "d2t": params["d2t"]}
    opt_state = train.optimizer(config).init(learned)
    return dict(head_config=head_config, learned=learned, fixed=fixed, opt_state=opt_state,
                start=0, log={"evals": []})  # fmt: skip


def resume(args, out, target, config) -> dict:
    """The head, optimizer state and step saved in ``out``, refused where this run's flags do
    not describe the same head (``--target``, ``--feature-layers``, ``--draft-vocab``) or a file
    is unreadable."""
    import jax.numpy as jnp

    from asps_jax.drafters import head as head_lib
    from asps_jax.drafters import train

    log = read_log(out / LOG_FILE)
    was = log.get("target")
    if was is not None and was != args.target:
        raise ValueError(
            f"--target {args.target}: {out} holds a head trained for --target {was} ({LOG_FILE}); "
            "give that target to resume it, or another --out"
        )
    head = head_lib.load_head(out, target, dtype=jnp.float32)
    c = head.config
    for flag, given, saved in (
        ("--feature-layers", args.layers, c.feature_layers),
        ("--draft-vocab", args.draft_vocab, c.draft_vocab_size),
    ):
        if given is not None and given != saved:
            shown = ",".join(map(str, saved)) if isinstance(saved, tuple) else saved
            raise ValueError(
                f"{flag} {','.join(map(str, given)) if isinstance(given, tuple) else given}: "
                f"{out} holds a head with {flag} {shown} (config.json); drop the flag to resume "
                "it, or give another --out"
            )
    learned = head_lib.trainable(head.params)
    fixed = {"embed": head.params["embed"], "d2t": head.params["d2t"]}
    step, flat = read_state(out / STATE_FILE)
    opt_state = train.unflat_state(
        train.optimizer(config).init(learned), flat, str(out / STATE_FILE)
    )
    print(f"resuming {out} at step {step} of {args.steps}")
    return dict(head_config=c, learned=learned, fixed=fixed, opt_state=opt_state, start=step,
                log=log)  # fmt: skip


def read_log(path: Path) -> dict:
    """``training.json`` (absent: a fresh log); one line naming it when it is not a JSON
    object."""
    if not path.exists():
        return {"evals": []}
    try:
        log = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); restore it or delete it") from None
    if not isinstance(log, dict) or not isinstance(log.get("evals", []), list):
        raise ValueError(f'{path}: not a training log (a JSON object with "evals")')
    log.setdefault("evals", [])
    return log


def read_state(path: Path):
    """``(step, arrays)`` of ``train_state.npz``; one line naming it when it is truncated, empty
    or not the optimizer state (the arrays' shapes are checked by ``train.unflat_state``)."""
    try:
        with np.load(path, allow_pickle=False) as f:
            saved = {k: f[k] for k in f.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as e:
        raise ValueError(
            f"{path}: truncated or not a saved optimizer state ({type(e).__name__}: {e}); "
            "restore it, or give another --out to start a new head"
        ) from None
    step = saved.pop("step", None)
    if step is None or step.shape != () or step.dtype.kind not in "iu" or int(step) < 0:
        raise ValueError(f"{path}: no step count in it (an empty or foreign .npz)")
    if sorted(saved) != sorted(str(i) for i in range(len(saved))):
        raise ValueError(f"{path}: its arrays are not an optimizer state ({sorted(saved)[:4]})")
    return int(step), saved


def windows(args, data, start: int):
    """``(validation windows or None, the training batches of steps start .. steps - 1)``."""
    from asps_jax.drafters import train

    try:
        val = None
        if len(data["val"]) >= args.seq_len:
            val = train.sample_windows(np.random.default_rng(1), data["val"], 4 * args.batch_size,
                                       args.seq_len)  # fmt: skip
        # Step i's windows come from a generator seeded by (seed, i): a resumed run draws what
        # the uninterrupted one would have.
        batches = (train.sample_windows(np.random.default_rng([args.seed, i]), data["train"],
                                        args.batch_size, args.seq_len)
                   for i in range(start, args.steps))  # fmt: skip
        first = next(batches, None)
    except ValueError as e:
        raise ValueError(f"--data: {e}") from None
    return val, first, batches


def train_loop(args, argv, job) -> int:
    """The optimizer steps from ``job["start"]``, saving every ``--save-every`` steps; a
    Ctrl-C is acted on after the step under way (saved there, exit status 130)."""
    from tqdm import tqdm

    from asps_jax.models.base import run_params

    target_params = run_params(job["target"])
    progress = tqdm(total=args.steps, initial=job["start"], desc="head", unit="step",
                    dynamic_ncols=True)  # fmt: skip
    try:  # the bar closed before any message: an error is a line of its own
        status = _steps(args, argv, job, target_params, progress)
    finally:
        progress.close()
    print(job["note"], file=sys.stderr if status else sys.stdout)
    return status


def _steps(args, argv, job, target_params, progress) -> int:
    import jax.numpy as jnp

    from asps_jax.drafters import train

    target, config = job["target"], job["config"]
    val, batch, batches = job["windows"]
    step, saved, t0, tokens_seen, pending = job["start"], job["start"], time.perf_counter(), 0, None
    while batch is not None:
        try:
            job["learned"], job["opt_state"], loss, m = train.train_step(
                job["head_config"], config, target.config, job["learned"], job["opt_state"],
                job["fixed"], target_params, jnp.asarray(batch),
            )  # fmt: skip
        except KeyboardInterrupt:  # Python's own handler (off the main thread): step lost
            _CtrlC.requested = True
            batch = None
        if batch is None:
            return _interrupted(args, argv, job, step, saved)
        if pending is not None:  # one step in flight: Ctrl-C waits for at most this one
            pending.block_until_ready()
        pending, step, tokens_seen = loss, step + 1, tokens_seen + batch.size
        progress.update(1)
        if step % 10 == 0 or step == args.steps:
            loss = float(loss)  # waits for the step: the rate counts finished work only
            if not np.isfinite(loss):
                raise _Diverged(f"the loss is {loss} at step {step}; {_kept(job, saved)}")
            rate = tokens_seen / (time.perf_counter() - t0)
            progress.set_postfix(loss=f"{loss:.3f}", acc0=f"{float(m['acc_0']):.3f}",
                                 tok_s=f"{rate:.0f}")  # fmt: skip
        if step % args.save_every == 0 or step == args.steps:
            job["log"]["train_wall_time_s"] = job["log"].get("train_wall_time_s", 0.0) + (
                time.perf_counter() - t0
            )
            t0, tokens_seen = time.perf_counter(), 0
            save(args, argv, job, step, saved, evaluate(job, target_params, val, step))
            saved = step
        if _CtrlC.requested:
            return _interrupted(args, argv, job, step, saved)
        batch = next(batches, None)
    job["log"]["total_wall_time_s"] = round(time.perf_counter() - job["started"], 1)
    save(args, argv, job, step, saved, None)
    job["note"] = f"wrote {job['out']} (step {step}); sample with --draft eagle3:{job['out']}"
    return 0


def _interrupted(args, argv, job, step: int, saved: int) -> int:
    """Ctrl-C: the head saved at ``step`` (the last finished one) unless it already is."""
    if step > saved:
        save(args, argv, job, step, saved, None)
    where = f"{job['out']} holds step {step}" if step else "nothing was saved"
    job["note"] = f"{PROG}: interrupted; {where} (the same command resumes it)"
    return INTERRUPTED


def evaluate(job, target_params, val, step: int):
    from asps_jax.drafters import train

    if val is None:
        return None
    loss, m = train.eval_step(
        job["head_config"], job["config"], job["target"].config, job["learned"], job["fixed"],
        target_params, val,
    )  # fmt: skip
    ev = {"loss": float(loss), **{k: float(v) for k, v in m.items()}}
    from tqdm import tqdm

    tqdm.write(f"step {step}: val loss {ev['loss']:.4f}, first-position accuracy "
               f"{ev['acc_0']:.3f}")  # fmt: skip
    return ev


def _kept(job, saved: int) -> str:
    if saved and (job["out"] / STATE_FILE).exists():
        return f"not saved: {job['out']} keeps its checkpoint of step {saved}; try a lower --lr"
    return "not saved; try a lower --lr"


def save(args, argv, job, step: int, saved: int, ev) -> None:
    """The head, the optimizer state and the log at ``step``, refused for a head with NaN / inf
    weights; every file is written in full before any is replaced, so a failed write (a full
    disk) keeps the checkpoint of step ``saved`` whole."""
    import jax.numpy as jnp

    from asps_jax.drafters import head as head_lib
    from asps_jax.drafters import train

    broken = sorted(k for k, a in job["learned"].items() if not bool(jnp.all(jnp.isfinite(a))))
    if broken:
        raise _Diverged(f"the head diverged: NaN / inf weights in {broken} at step {step}; "
                        f"{_kept(job, saved)}")  # fmt: skip
    log, out = job["log"], job["out"]
    if ev is not None:
        log["evals"].append(dict(step=step, **ev))
    log.update(
        target=args.target, data=job["data"]["info"],
        tokens={"train": int(len(job["data"]["train"])), "val": int(len(job["data"]["val"]))},
        command="python " + shlex.join([f"scripts/{PROG}", *(argv or sys.argv[1:])]),
        config={k: _shown(v) if k in ("data", "out") and v else v for k, v in vars(args).items()
                if k != "layers"},
        step=step,
    )  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    tmp_state, tmp_log = out / (STATE_FILE + ".tmp.npz"), out / (LOG_FILE + ".tmp")
    try:
        np.savez(tmp_state, step=np.asarray(step), **train.flat_state(job["opt_state"]))
        tmp_log.write_text(json.dumps(log, indent=2) + "\n")
        head_lib.save_head(out, job["head_config"], {**job["learned"], **job["fixed"]})
    except OSError as e:
        tmp_state.unlink(missing_ok=True)
        tmp_log.unlink(missing_ok=True)
        kept = f"its checkpoint of step {saved} is kept" if saved else "nothing was saved"
        raise OSError(f"--out {out}: writing the checkpoint of step {step} failed "
                      f"({e.strerror or e}); {kept}") from None  # fmt: skip
    tmp_state.replace(out / STATE_FILE)
    tmp_log.replace(out / LOG_FILE)


if __name__ == "__main__":
    sys.exit(main())
