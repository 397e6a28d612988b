"""Sample text with exact speculative decoding (docs/api.md §4).

    python scripts/sample.py                                   # bundled tiny Shakespeare pair
    python scripts/sample.py --method sps --num-draft-tokens 4
    python scripts/sample.py --target llama7b --draft llama68m --prompt "Translate ..."

Text streams to stdout as it is produced (row 0 of the batch), never splitting a character; the
statistics block follows. Compiled programs are cached on disk (asps_jax.compile_cache), so a
second run with the same shapes starts in seconds. Errors in the arguments or the environment exit
with a one-line explanation; third-party notices that do not apply here are silenced.

Several processes (multi-host: one process per host of a TPU pod slice, or several CPU
processes) run the same command with the same prompts and seed, each with ``--distributed`` (JAX
detects the rest on a TPU pod slice, Slurm or Open MPI) or ``--coordinator HOST:PORT
--num-processes N --process-id I``; the mesh spans every process's devices (default
``data=<all devices>``) and only process 0 prints.

Exit status: 0 done; 1 a model produced NaN / inf logits (the text generated before is printed);
2 a bad argument or environment; 130 interrupted (Ctrl-C, honoured from start-up to the end at
the next boundary: the text so far and its statistics are printed).
"""

from __future__ import annotations

import signal  # first: a Ctrl-C from here on is recorded (see _record_sigint)


class _CtrlC:
    """Whether SIGINT (Ctrl-C) came during :func:`main`.

    The handler only records it; the command acts on it at its next boundary (between start-up
    stages, before and after compiling, between decode steps): printing the text so far and its
    statistics, exit status 130. Python's own handler raises KeyboardInterrupt wherever the signal
    lands instead, and one that lands while a finaliser or weakref callback runs (JAX runs many) is
    printed as "Exception ignored" and lost.
    """

    requested = False


def _record_sigint(signum, frame) -> None:
    _CtrlC.requested = True


def _take_sigint():
    """Install :func:`_record_sigint`; returns the handler it replaced, or None where it did not
    (SIGINT ignored, as for a background job, or a handler not set from Python, or not the main
    thread)."""
    try:
        previous = signal.getsignal(signal.SIGINT)
        if previous is None or previous is signal.SIG_IGN:
            return None
        signal.signal(signal.SIGINT, _record_sigint)
    except ValueError:  # signal handlers are set from the main thread only
        return None
    return previous


if __name__ == "__main__":  # as early as possible: the imports below take a while
    _take_sigint()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

DEFAULT_TARGET = "tinyshakespeare-target"
DEFAULT_DRAFT = "tinyshakespeare-draft"
DEFAULT_PROMPT = "ROMEO:\nBut soft, what light"
DTYPES = {"f32": "float32", "bf16": "bfloat16"}


def _checked(convert, valid, expected: str):
    """An argparse ``type``: ``convert`` the text, then require ``valid(value)``."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not valid(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive_int = _checked(int, lambda v: v >= 1, "a positive integer")
_num_draft_tokens = _checked(
    lambda t: t if t == "auto" else int(t),
    lambda v: v == "auto" or v >= 1,
    "a positive integer or 'auto'",
)


def _draft_stop(text: str) -> str:
    """``confidence:τ``, τ in [0, 1] (checked by the library's own parser)."""
    from asps_jax.sampler import _parse_draft_stop

    try:
        _parse_draft_stop(text)
    except ValueError as err:
        message = str(err).replace("draft_stop must be", "expected")
        raise argparse.ArgumentTypeError(message) from None
    return text


# The loop runs in float32: a number beyond its range (1e39 is finite here, inf there) would
# overflow there.
_F32_MAX = 3.4028234663852886e38
_non_negative_float = _checked(
    float, lambda v: 0.0 <= v <= _F32_MAX, "a finite number >= 0 (at most 3.4e38)"
)
_top_p = _checked(float, lambda v: 0.0 < v <= 1.0, "a top-p in (0, 1]")
_seed = _checked(int, lambda v: 0 <= v < 2**63, "an integer in [0, 2**63)")
_non_negative_int = _checked(int, lambda v: v >= 0, "an integer >= 0")
_finite_float = _checked(
    float, lambda v: abs(v) <= _F32_MAX, "a finite number (|value| at most 3.4e38, float32)"
)
_positive_float = _checked(
    float,
    lambda v: 0.0 < v <= _F32_MAX and v >= 1.4e-45,
    "a finite number > 0 that float32 holds (1.4e-45 to 3.4e38)",
)
_unit_float = _checked(float, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")


def _bias(text: str) -> tuple[int, float]:
    """``ID=BIAS`` for --logit-bias (``-inf`` bans the token)."""
    token, sep, bias = text.partition("=")
    try:
        pair = (int(token), float(bias))
    except ValueError:
        pair = None
    if (
        not sep
        or pair is None
        or pair[0] < 0
        or not (abs(pair[1]) <= _F32_MAX or pair[1] == -math.inf)
    ):
        raise argparse.ArgumentTypeError(
            "expected ID=BIAS (a token id >= 0, a finite bias that float32 holds, |bias| at most "
            f"3.4e38, or -inf), got {text!r}"
        )
    return pair


INTERRUPTED = 130


def _text(text: str) -> str:
    """``--prompt``: text that is valid Unicode (a byte that is not UTF-8 reaches ``argv`` as a
    lone surrogate, which no tokenizer takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = text[err.start]
        what = f"byte 0x{ord(bad) - 0xDC00:02x}" if "\udc80" <= bad <= "\udcff" else repr(bad)
        raise argparse.ArgumentTypeError(
            f"expected UTF-8 text, got {what} at character {err.start}"
        ) from None
    return text


class _Interrupted(Exception):
    """Ctrl-C came before anything was generated; ``stage`` says what was under way."""

    def __init__(self, stage: str):
        super().__init__(stage)
        self.stage = stage


def _stop_if_interrupted(stage: str) -> None:
    """A boundary: act on a Ctrl-C recorded since the last one."""
    if _CtrlC.requested:
        raise _Interrupted(stage)


@contextlib.contextmanager
def _sigint_recorded():
    """:func:`_record_sigint` for the block (the flag cleared unless it is already the handler,
    as when run as a script), the previous handler restored after."""
    previous = _take_sigint()
    if previous is not _record_sigint:
        _CtrlC.requested = False
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _widths(text: str) -> tuple[int, ...]:
    """``--tree 4,2,1,1``: children per node at each depth."""
    from asps_jax.trees import parse_widths

    try:
        return parse_widths(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


# Notices that are expected and harmless for this command, by logger: transformers is used for
# tokenizers and configs only, and a CPU-only jaxlib on a machine with a GPU runs on the CPU.
_NOTICES = {
    "transformers": ("PyTorch was not found",),
    "jax._src.xla_bridge": ("An NVIDIA GPU may be present",),
}


class _DropNotices(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def silence_notices() -> None:
    """Filter the messages of ``_NOTICES`` (only those; errors and other warnings still show).

    Called before jax and transformers are imported: transformers logs its notice at import.
    """
    for name, prefixes in _NOTICES.items():
        logger = logging.getLogger(name)
        # By name, not isinstance: the script may be loaded more than once in one process.
        if not any(type(f).__name__ == "_DropNotices" for f in logger.filters):
            logger.addFilter(_DropNotices(prefixes))


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from asps_jax.sampler import METHODS
    from asps_jax.verify.registry import describe

    p = _Parser(
        prog="sample.py",
        description="Exact speculative sampling with a draft and a target model. With no "
        "arguments it runs the bundled tiny Shakespeare pair on a default prompt.",
    )
    p.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help="target model: an alias from models/ (e.g. llama7b), a checkpoint "
        f"directory, or a Hugging Face repo id in the local cache (default {DEFAULT_TARGET})",
    )
    p.add_argument(
        "--draft",
        default=DEFAULT_DRAFT,
        help=f"draft model, same forms as --target (default {DEFAULT_DRAFT}); or 'lookup': "
        "prompt lookup, the continuation of the last --lookup-ngram tokens' most recent earlier "
        "occurrence in the prompt + generated text (no draft model); or self:L, the target's "
        "first L layers with its final norm and head (self-drafting); ignored by --method ar",
    )
    p.add_argument(
        "--lookup-ngram",
        type=_positive_int,
        default=None,
        metavar="m",
        help="--draft lookup: the suffix length searched for (default 3)",
    )
    p.add_argument(
        "--lookup-max",
        type=_positive_int,
        default=None,
        metavar="N",
        help="--draft lookup: the longest chain copied (default: --num-draft-tokens)",
    )
    p.add_argument(
        "--draft-stop",
        type=_draft_stop,
        default=None,
        metavar="confidence:TAU",
        help="a draft chain stops growing at the first draft law whose top probability is below "
        "TAU (the draft loop exits once every chain stopped; exact, docs/algorithms.md §10)",
    )
    p.add_argument(
        "--prompt",
        action="append",
        type=_text,
        default=None,
        metavar="TEXT",
        help="prompt text; repeat the flag for several prompts (default: a line of "
        "Romeo and Juliet)",
    )
    # "optimal" is a reference construction, available from Python (asps_jax.sample, verify_drafts):
    # its per-node gradient fit costs several decode steps' worth (docs/benchmarks.md).
    methods = tuple(m for m in METHODS if m != "optimal")
    p.add_argument(
        "--method",
        default="asps",
        choices=methods,
        help=f"verification method: ar = target alone; {describe(methods[1:])} (default asps)",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=_num_draft_tokens,
        default=None,
        metavar="n",
        help="draft tokens proposed per target call (default 8), or 'auto': chosen by a short "
        "measured calibration (acceptance by depth, draft / target cost), printed",
    )
    p.add_argument(
        "--num-drafts",
        type=_positive_int,
        default=None,
        metavar="K",
        help="independent draft chains per step, for multi-draft methods (default 1)",
    )
    p.add_argument(
        "--tree",
        type=_widths,
        default=None,
        metavar="W1,W2,...",
        help="tv / tv_wr / is_bv: draft a branching tree instead of K chains, W_d children per "
        "node at depth d (e.g. 4,2,1,1; siblings without replacement for tv); sets n and K",
    )
    p.add_argument(
        "--temperature",
        type=_non_negative_float,
        default=1.0,
        metavar="T",
        help="target sampling temperature; 0 = greedy (default 1.0)",
    )
    p.add_argument(
        "--draft-temperature",
        type=_non_negative_float,
        default=None,
        metavar="T",
        help="temperature the draft samples at (default: --temperature); output law "
        "stays the target's either way",
    )
    p.add_argument(
        "--top-k",
        type=_positive_int,
        default=None,
        metavar="k",
        help="keep only the k most likely tokens (default: off)",
    )
    p.add_argument(
        "--top-p",
        type=_top_p,
        default=None,
        metavar="p",
        help="nucleus sampling mass in (0, 1] (default: off)",
    )
    p.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="STR",
        help="stop a row after the first occurrence of STR in its generated text (kept); "
        "repeatable, at most 16 strings of 1 to 64 UTF-8 bytes (default: none)",
    )
    p.add_argument(
        "--min-p",
        type=_unit_float,
        default=None,
        metavar="p",
        help="drop tokens less likely than p times the most likely one, after top-k / top-p "
        "(default: off)",
    )
    p.add_argument(
        "--repetition-penalty",
        type=_positive_float,
        default=None,
        metavar="θ",
        help="transformers' repetition penalty over the prompt and the generated tokens: a "
        "logit l of a token already there becomes l/θ if l > 0 else l*θ (default: off, 1)",
    )
    p.add_argument(
        "--presence-penalty",
        type=_finite_float,
        default=None,
        metavar="a",
        help="OpenAI's presence penalty: logit -= a for every token generated before "
        "(default: off, 0)",
    )
    p.add_argument(
        "--frequency-penalty",
        type=_finite_float,
        default=None,
        metavar="b",
        help="OpenAI's frequency penalty: logit -= b * (times the token was generated) "
        "(default: off, 0)",
    )
    p.add_argument(
        "--no-repeat-ngram-size",
        type=_non_negative_int,
        default=None,
        metavar="n",
        help="never complete an n-gram already in the prompt and generated text (default: off)",
    )
    p.add_argument(
        "--logit-bias",
        type=_bias,
        action="append",
        default=None,
        metavar="ID=BIAS",
        help="add BIAS to token ID's logit before anything else; -inf bans it; repeatable",
    )
    p.add_argument(
        "--top-logprobs",
        type=_non_negative_int,
        default=None,
        metavar="k",
        help="with --json: the k most likely tokens and their log-probabilities at each "
        "generated position (default: off)",
    )
    p.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help='a prompt set: one prompt per line, or JSON lines with "prompt" and an optional '
        '"max_new_tokens"; sampled through --batch-size slots (default 8) with continuous '
        "batching, printed as JSON lines in prompt order (per prompt, then the pooled statistics)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=200,
        metavar="M",
        help="tokens to generate per prompt (default 200)",
    )
    p.add_argument(
        "--batch-size",
        type=_positive_int,
        default=None,
        metavar="B",
        help="rows sampled together, at least the number of prompts; the prompts are repeated "
        "to fill it (default: one row per prompt)",
    )
    p.add_argument(
        "--seed", type=_seed, default=0, help="random seed, an integer in [0, 2**63) (default 0)"
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="f32",
        help="parameter dtype: f32 or bf16 (default f32)",
    )
    p.add_argument(
        "--mesh",
        default=None,
        metavar="data=D,model=M",
        help="shard over a device mesh: batch rows along data, attention heads / MLP / "
        "vocabulary along model; D*M devices must exist (default: one device)",
    )
    p.add_argument(
        "--distributed",
        action="store_true",
        help="one of several processes (multi-host): join them with jax.distributed.initialize, "
        "which finds the coordinator, process count and id itself on a TPU pod slice, Slurm or "
        "Open MPI; elsewhere give --coordinator, --num-processes and --process-id",
    )
    p.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="address of process 0 for a multi-process run (default: $JAX_COORDINATOR_ADDRESS "
        "or detected); implies --distributed",
    )
    p.add_argument(
        "--num-processes",
        type=_positive_int,
        default=None,
        metavar="N",
        help="number of processes of a multi-process run; implies --distributed",
    )
    p.add_argument(
        "--process-id",
        type=_non_negative_int,
        default=None,
        metavar="I",
        help="this process's id in [0, N) in a multi-process run; implies --distributed",
    )
    p.add_argument(
        "--regex",
        default=None,
        metavar="PATTERN",
        help="constrain the generated text to match PATTERN in full (every method, exact: the "
        "law of constrained sampling from the target; needs the target's tokenizer)",
    )
    p.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE",
        help="constrain the generated text to JSON valid under the schema in FILE (supported "
        "keywords: docs/api.md)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (text, tokens, the target's log-probability of each token, "
        "statistics) instead of streaming",
    )
    p.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="do not use the on-disk compilation cache (default: on, in $ASPS_JAX_CACHE_DIR or "
        "~/.cache/asps_jax/jax; ASPS_JAX_NO_CACHE=1 also turns it off)",
    )
    return p


def _summary(session, out, args, compile_s, run_s, load_s) -> dict:
    import numpy as np

    from asps_jax.statistics import histogram_mean_stderr

    stats = {k: np.asarray(v) for k, v in out.stats.items()}
    lengths = np.asarray(out.lengths)
    calls = stats["target_calls"]
    per_step = lengths / np.maximum(calls, 1)
    mean_l, stderr_l, _ = histogram_mean_stderr(stats["emitted_hist"])
    summary = {
        "method": args.method,
        "num_draft_tokens": session.spec.num_draft_tokens if args.method != "ar" else 0,
        "num_drafts": session.spec.num_drafts if args.method != "ar" else 0,
        "batch_size": int(lengths.size),
        "new_tokens": int(lengths.sum()),
        "target_calls": int(calls.sum()),
        "tokens_per_step": mean_l,
        "tokens_per_step_stderr": stderr_l,
        "tokens_per_step_by_row": per_step.round(4).tolist(),
        "acceptance": float(stats["accepted"].sum() / max(stats["decisions"].sum(), 1)),
        "lp_fallbacks": int(stats["fallbacks"].sum()),
        "load_seconds": round(load_s, 3),
        "compile_seconds": round(compile_s, 3),
        "run_seconds": round(run_s, 3),
        "tokens_per_second": float(lengths.sum() / run_s) if run_s > 0 else float("nan"),
    }
    if getattr(session, "calibration", None) is not None:  # --num-draft-tokens auto
        summary["calibration"] = dataclasses.asdict(session.calibration)
    if out.incomplete is not None:  # --regex / --json-schema: rows cut before the text matched
        summary["incomplete"] = np.asarray(out.incomplete).tolist()
    return summary


def _print_summary(s: dict, stream) -> None:
    rows = [
        ("method", s["method"]),
        ("draft tokens n / drafts K", f"{s['num_draft_tokens']} / {s['num_drafts']}"),
        ("new tokens (batch)", f"{s['new_tokens']} ({s['batch_size']} rows)"),
        ("target calls", s["target_calls"]),
        ("tokens per step", f"{s['tokens_per_step']:.3f} ± {s['tokens_per_step_stderr']:.3f}"),
        ("draft acceptance", f"{s['acceptance']:.3f}"),
        ("tokens/s (run)", f"{s['tokens_per_second']:.1f}"),
        (
            "load / compile / run s",
            f"{s['load_seconds']} / {s['compile_seconds']} / {s['run_seconds']}",
        ),
    ]
    if "incomplete" in s:
        cut = [b for b, flag in enumerate(s["incomplete"]) if flag]
        value = "none: every row's text matches" if not cut else f"rows {cut} (cut before the end)"
        rows.insert(3, ("constraint incomplete", value))
    print("\n--- statistics ---", file=stream)
    for name, value in rows:
        print(f"{name:>26}: {value}", file=stream)


def _sampling_kwargs(args) -> dict:
    """The arguments of ``sample`` / ``Session`` that come straight from the flags: the method, the
    draft shape, the sampling controls, the constraint and the drafter's options (one list for the
    single batch and for ``--prompts``)."""
    return dict(
        method=args.method,
        num_draft_tokens=args.num_draft_tokens,
        num_drafts=args.num_drafts,
        tree=args.tree,
        temperature=args.temperature,
        draft_temperature=args.draft_temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        stop=args.stop,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        no_repeat_ngram_size=args.no_repeat_ngram_size,
        logit_bias=dict(args.logit_bias) if args.logit_bias else None,
        regex=args.regex,
        json_schema=_read_schema(args.json_schema),
        **_drafter_options(args),
    )


def _drafter_options(args) -> dict:
    """The drafter's options given on the command line (the library checks them)."""
    names = ("lookup_ngram", "lookup_max", "draft_stop")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def _check_sizes(args, target, draft, encoded, mesh) -> None:
    """Refuse, before the batch is built or anything compiled, sizes the models or the device
    cannot take (one-line errors naming the flag to lower)."""
    from asps_jax.sampler import check_memory

    if args.method == "ar":
        if args.num_drafts != 1:
            raise ValueError(
                f"--num-drafts {args.num_drafts} is for multi-draft methods; --method ar uses no "
                "draft (drop --num-drafts)"
            )
        n = k = 1
    else:
        n, k = args.num_draft_tokens, args.num_drafts
        if n == "auto":
            n = args.lookup_max or 8  # the longest the calibration tries
        context = target.config.max_position_embeddings
        if not isinstance(draft, str):
            context = min(context, draft.config.max_position_embeddings)
        if n >= context:
            raise ValueError(
                f"--num-draft-tokens {n} does not fit the model context of {context} positions; "
                "lower --num-draft-tokens"
            )
    check_memory(
        target,
        draft,  # a model, None, or a drafter's name ("lookup", "self:L")
        batch=args.batch_size,
        prompt_len=max(len(e) for e in encoded),
        max_new_tokens=args.max_new_tokens,
        num_draft_tokens=n,
        num_drafts=k,
        mesh=mesh,
        method=args.method,
        widths=args.tree if args.method != "ar" and args.tree else (),
    )


def _nonfinite_message(err) -> str:
    where = ", ".join(f"row {r} at new token {p}" for r, p in zip(err.rows, err.positions))
    return (
        f"the model produced NaN or inf logits ({where}); the text printed is what was generated "
        "before (check the checkpoint and --dtype)"
    )


def _claim_stdout():
    """Several processes: gloo (JAX's CPU collectives) prints connection notices on file
    descriptor 1. Point fd 1 at stderr and return a stream on the original stdout for this
    command's output; ``sys.stdout`` itself when it is not fd 1 (captured, e.g. in a test)."""
    try:
        if sys.stdout.fileno() != 1:
            return sys.stdout
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return sys.stdout
    sys.stdout.flush()
    original = os.dup(1)
    os.dup2(2, 1)
    return os.fdopen(original, "w", buffering=1)


def _strict_json(value):
    """``value`` with every non-finite float replaced by None: strict JSON has no NaN or Infinity
    (a figure undefined by the run, such as a standard error over one step, is ``null``)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict_json(v) for v in value]
    return value


def run(args) -> int:
    import jax
    import numpy as np

    import asps_jax
    from asps_jax import compile_cache
    from asps_jax.sampler import Session, named_draft
    from asps_jax.sharding import init_distributed, make_mesh
    from asps_jax.textstream import TextStream

    _stop_if_interrupted("starting")
    distributed = args.distributed or any(
        v is not None for v in (args.coordinator, args.num_processes, args.process_id)
    )
    stdout = sys.stdout
    if distributed:  # before anything else touches JAX's devices
        init_distributed(args.coordinator, args.num_processes, args.process_id)
        stdout = _claim_stdout()
        if args.mesh is None:
            args.mesh = f"data={jax.device_count()}"
    if not args.no_compile_cache:
        compile_cache.enable(notify=lambda m: print(f"sample.py: note: {m}", file=sys.stderr))
    compile_cache.decline_default()  # decided here: the library's default does not try again
    compile_cache.count_compiles()

    # Built before loading the models: a mesh that does not fit the devices fails fast.
    mesh = None if args.mesh is None else make_mesh(args.mesh)
    # Several processes compute the same rows: process 0 prints them.
    primary = jax.process_index() == 0
    _stop_if_interrupted("starting")
    start = time.perf_counter()
    dtype = DTYPES[args.dtype]
    target = asps_jax.load_model(args.target, dtype=dtype)
    _stop_if_interrupted("loading the models")
    draft = None
    if args.method != "ar":  # a checkpoint, or a drafter named by --draft (lookup, self:L)
        draft = args.draft
        if not named_draft(args.draft):
            draft = asps_jax.load_model(args.draft, dtype=dtype)
    _stop_if_interrupted("loading the models")
    tokenizer = target.tokenizer
    if tokenizer is None:
        raise FileNotFoundError(f"{args.target}: no tokenizer files next to the checkpoint")
    load_s = time.perf_counter() - start

    if args.prompts is not None:
        return _run_prompts(args, target, draft, mesh, load_s, stdout if primary else io.StringIO())
    texts = args.prompt or [DEFAULT_PROMPT]
    # verbose=False: the length check below gives the error; no tokenizer warning first.
    encoded = [tokenizer.encode(t, verbose=False) for t in texts]
    if args.batch_size is None:
        args.batch_size = len(texts)
    _check_sizes(args, target, draft, encoded, mesh)
    prompts = [encoded[b % len(encoded)] for b in range(args.batch_size)]
    session = Session(
        target,
        draft,
        prompts,
        key=jax.random.key(args.seed),
        max_new_tokens=args.max_new_tokens,
        top_logprobs=args.top_logprobs or 0,
        mesh=mesh,
        return_logprobs=args.json,
        **_sampling_kwargs(args),
    )
    if session.calibration is not None and primary:
        print(f"[{session.calibration.describe()}]", file=sys.stderr, flush=True)
    _stop_if_interrupted("preparing the batch")
    out_stream = stdout if primary else io.StringIO()
    if not args.json and primary:
        print(
            f"[compiling {args.method} for {args.target} / "
            f"{args.draft if draft is not None else '-'} ...]",
            file=sys.stderr,
            flush=True,
        )
    try:
        compile_s = session.compile()
    except KeyboardInterrupt:
        raise _Interrupted("compiling") from None
    _stop_if_interrupted("compiling")
    if not args.json:
        print(texts[0], end="", file=out_stream, flush=True)
    start = time.perf_counter()
    text_stream = TextStream(tokenizer, skip_special_tokens=True)
    step, interrupted = 0, False
    try:
        for new in session.steps():
            step += 1
            if not args.json:
                print(text_stream.push(new[0]), end="", file=out_stream, flush=True)
                if step % 25 == 0 and args.batch_size > 1 and primary:
                    print(f"\n[step {step}]", file=sys.stderr, flush=True)
            if _CtrlC.requested:  # the boundary between two steps
                interrupted = True
                break
    except KeyboardInterrupt:  # raised by steps() itself when SIGINT is Python's default
        interrupted = True
    run_s = time.perf_counter() - start
    if step == 0:  # interrupted before the first step finished
        print(
            "\nsample.py: interrupted before the first step; nothing was generated", file=sys.stderr
        )
        return INTERRUPTED
    out, failure = _result(session)
    summary = _summary(session, out, args, compile_s, run_s, load_s)
    summary["interrupted"] = interrupted
    if args.json:
        tokens = np.asarray(out.tokens)
        lengths = np.asarray(out.lengths)
        rows = [tokens[b, : lengths[b]].tolist() for b in range(lengths.size)]
        summary["prompts"] = [texts[b % len(texts)] for b in range(lengths.size)]
        summary["tokens"] = rows
        logprobs = np.asarray(out.logprobs)
        summary["logprobs"] = [logprobs[b, : lengths[b]].tolist() for b in range(lengths.size)]
        if out.top_logprobs is not None:
            ids, lps = (np.asarray(a) for a in out.top_logprobs)
            # Per position, [token id, log-probability] pairs, most likely first (null for a
            # token outside the law's support, when k exceeds it).
            summary["top_logprobs"] = [
                [
                    [
                        [i, lp if math.isfinite(lp) else None]
                        for i, lp in zip(ids[b, t].tolist(), lps[b, t].tolist())
                    ]
                    for t in range(lengths[b])
                ]
                for b in range(lengths.size)
            ]
        summary["texts"] = [tokenizer.decode(r, skip_special_tokens=True) for r in rows]
        summary.update(_compile_counts(compile_cache))
        print(json.dumps(_strict_json(summary), allow_nan=False), file=out_stream)
    else:
        print(text_stream.flush(), file=out_stream)
        _print_summary(summary, out_stream)
    if failure is not None:
        print(f"sample.py: error: {_nonfinite_message(failure)}", file=sys.stderr)
        return 1
    if interrupted or _CtrlC.requested:
        print(
            f"sample.py: interrupted after {summary['new_tokens']} new tokens (statistics above)",
            file=sys.stderr,
        )
        return INTERRUPTED
    return 0


def _result(session):
    """``(SampleOutput, failure)``: the session's output, and the NonFiniteLogitsError of a model
    that produced an unusable law (its ``.output`` keeps the tokens before), else None."""
    from asps_jax.sampler import NonFiniteLogitsError

    try:
        return session.result(), None
    except NonFiniteLogitsError as err:
        return err.output, err


def _compile_counts(compile_cache) -> dict:
    """``compiles``: XLA programs this process compiled; ``compile_cache_hits``: programs it
    loaded from the persistent cache instead (both are jit cache misses: a new shape)."""
    counts = compile_cache.compiles()
    return {
        "compiles": counts["programs"] - counts["cache_hits"],
        "compile_cache_hits": counts["cache_hits"],
    }


def _read_prompts(path) -> list[tuple[int, str, int | None]]:
    """``--prompts FILE``: ``(line number, text, max_new_tokens or None)`` per non-empty line; a
    line that starts with ``{`` is a JSON object with ``prompt`` and an optional
    ``max_new_tokens``. A UTF-8 byte-order mark opening the file is not part of its first line."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        raise ValueError(f"--prompts: cannot read {path} ({why})") from None
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            out.append((number, line, None))
            continue
        where = f"--prompts: {path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not a JSON object ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f'{where}: a JSON line needs a "prompt" string')
        budget = record.get("max_new_tokens")
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int) or budget < 1
        ):
            raise ValueError(f'{where}: "max_new_tokens" must be an integer >= 1, got {budget!r}')
        unknown = sorted(set(record) - {"prompt", "max_new_tokens"})
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown} (prompt, max_new_tokens)")
        out.append((number, record["prompt"], budget))
    if not out:
        raise ValueError(f"--prompts: {path} holds no prompts")
    return out


def _check_prompt_sizes(path, records, encoded, budgets, target, draft) -> None:
    """Each prompt of ``--prompts`` against the models' context, before anything is built: a
    one-line error naming the file's line (the library's own check names no line)."""
    context = target.config.max_position_embeddings
    if draft is not None and not isinstance(draft, str):  # a drafter's name: the target's context
        context = min(context, draft.config.max_position_embeddings)
    for (number, _, own_budget), tokens, budget in zip(records, encoded, budgets):
        where = f"--prompts: {path}:{number}"
        if not tokens:
            raise ValueError(f"{where}: the prompt encodes to no tokens")
        if len(tokens) + budget > context:
            lower = '"max_new_tokens"' if own_budget is not None else "--max-new-tokens"
            raise ValueError(
                f"{where}: prompt of {len(tokens)} tokens plus max_new_tokens={budget} exceeds "
                f"the model context of {context} positions; shorten the prompt or lower {lower}"
            )


def _prompt_error(err: ValueError, path, records) -> ValueError:
    """A library error naming ``prompts[i]``, with the line of ``--prompts`` FILE named instead."""
    import re

    match = re.match(r"prompts\[(\d+)\] (.*)", str(err), re.S)
    if match is None or int(match[1]) >= len(records):
        return err
    return ValueError(f"--prompts: {path}:{records[int(match[1])][0]}: the prompt {match[2]}")


def _run_prompts(args, target, draft, mesh, load_s, out_stream) -> int:
    """``--prompts FILE``: every prompt through ``--batch-size`` slots (continuous batching), step
    by step so that a Ctrl-C is honoured at the next step boundary; JSON lines in prompt order,
    then one line of pooled statistics.

    Interrupted (exit status 130): the lines of the prompts that finished, as a normal run writes
    them; one per prompt in flight with its tokens so far, ``"interrupted": true`` and null
    statistics (a prompt's statistics are handed over when it finishes); nothing for the prompts
    not started; the pooled line with ``"interrupted": true`` (docs/api.md §4)."""
    import types

    import jax
    import numpy as np

    from asps_jax import compile_cache
    from asps_jax.sampler import Session

    records = _read_prompts(args.prompts)
    tokenizer = target.tokenizer
    texts = [t for _, t, _ in records]
    encoded = [tokenizer.encode(t, verbose=False) for t in texts]
    budgets = [args.max_new_tokens if b is None else b for _, _, b in records]
    _check_prompt_sizes(args.prompts, records, encoded, budgets, target, draft)
    slots = args.batch_size or 8
    kwargs = dict(
        key=jax.random.key(args.seed),
        max_new_tokens=budgets,
        batch_size=slots,
        **_sampling_kwargs(args),
    )
    if mesh is not None:
        raise ValueError("--prompts: continuous batching runs on one device; drop --mesh")
    try:
        session = Session(target, draft, encoded, **kwargs)
    except ValueError as err:
        raise _prompt_error(err, args.prompts, records) from None
    _stop_if_interrupted("preparing the batch")
    try:
        compile_s = session.compile()
    except KeyboardInterrupt:
        raise _Interrupted("compiling") from None
    _stop_if_interrupted("compiling")
    progress = sys.stderr.isatty()
    so_far = [[] for _ in records]  # each prompt's tokens as steps() yields them
    pairs = tokens = 0
    interrupted = False
    start = time.perf_counter()
    try:
        for p, new in session.steps():
            so_far[p] += new
            pairs += 1
            tokens += len(new)
            if progress:  # a progress line where stderr is a terminal
                rate = tokens / max(time.perf_counter() - start, 1e-9)
                print(
                    f"\r[{session.prompts_done}/{len(records)} prompts, {tokens} tokens, "
                    f"{rate:.1f} tokens/s]",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
            if _CtrlC.requested and session.step_end:  # the boundary between two steps
                break
    except KeyboardInterrupt:  # raised by steps() itself when SIGINT is Python's default
        interrupted = True
    run_s = time.perf_counter() - start
    if progress:
        print(file=sys.stderr)
    interrupted = interrupted or _CtrlC.requested
    if interrupted and pairs == 0:
        print(
            "sample.py: interrupted before the first step; nothing was generated", file=sys.stderr
        )
        return INTERRUPTED
    out, failure = _result(session)
    n = len(records)
    finished = session.finished.copy()  # all of them unless interrupted
    in_flight = (np.arange(n) < session.prompts_started) & ~finished
    stats = {k: np.asarray(v) for k, v in out.stats.items()}
    lengths = np.asarray(out.lengths)
    result_tokens = np.asarray(out.tokens)
    written = []  # the number of tokens of each line written
    for i in range(n):
        if finished[i]:
            row = result_tokens[i, : lengths[i]].tolist()
            line = {
                "index": i,
                "prompt": texts[i],
                "text": tokenizer.decode(row, skip_special_tokens=True),
                "tokens": row,
                "new_tokens": int(lengths[i]),
                "max_new_tokens": budgets[i],
                "target_calls": int(stats["target_calls"][i]),
                "tokens_per_step": float(stats["tokens_per_step"][i]),
                "acceptance": float(stats["acceptance"][i]),
                "failed_at": int(stats["failed_at"][i]),
            }
            if out.incomplete is not None:  # cut before its --regex / --json-schema matched
                line["incomplete"] = bool(out.incomplete[i])
        elif in_flight[i]:
            row = so_far[i]
            line = {
                "index": i,
                "prompt": texts[i],
                "text": tokenizer.decode(row, skip_special_tokens=True),
                "tokens": row,
                "new_tokens": len(row),
                "max_new_tokens": budgets[i],
                "target_calls": None,
                "tokens_per_step": None,
                "acceptance": None,
                "failed_at": None,
                "interrupted": True,
            }
            if session.constraint is not None:
                cut = session.constraint.incomplete_rows([row or [-1]], [len(row)], rows=[i])
                line["incomplete"] = bool(cut[0])
        else:  # not started
            continue
        written.append(len(row))
        print(json.dumps(_strict_json(line), allow_nan=False), file=out_stream)
    # The statistics of the finished prompts (every prompt unless interrupted).
    calls = int(stats["target_calls"][finished].sum())
    done_tokens = int(lengths[finished].sum())
    new_tokens = sum(written)
    pooled = {
        "pooled": True,
        "method": args.method,
        "prompts": len(written),
        "batch_size": slots,
        "new_tokens": new_tokens,
        "target_calls": calls,
        "tokens_per_step": float(done_tokens / max(calls, 1)),
        "acceptance": float(
            stats["accepted"][finished].sum() / max(stats["decisions"][finished].sum(), 1)
        ),
        "load_seconds": round(load_s, 3),
        "compile_seconds": round(compile_s, 3),
        "run_seconds": round(run_s, 3),
        "tokens_per_second": float(new_tokens / run_s) if run_s > 0 else float("nan"),
        **_compile_counts(compile_cache),
    }
    if interrupted:
        if not finished.any():  # no finished prompt to pool
            pooled["tokens_per_step"] = pooled["acceptance"] = None
        pooled["interrupted"] = True
        pooled["finished"] = int(finished.sum())
        pooled["in_flight"] = int(in_flight.sum())
        if failure is not None:  # only the rows written count
            kept = [(r, q) for r, q in zip(failure.rows, failure.positions) if finished[r]]
            failure = None
            if kept:
                rows, positions = zip(*kept)
                failure = types.SimpleNamespace(rows=list(rows), positions=list(positions))
    print(json.dumps(_strict_json(pooled), allow_nan=False), file=out_stream)
    if failure is not None:
        print(f"sample.py: error: {_nonfinite_message(failure)}", file=sys.stderr)
        return 1
    if interrupted:
        print(
            f"sample.py: interrupted after {int(finished.sum())} of {n} prompts "
            f"({int(in_flight.sum())} in flight written with their tokens so far, "
            f"{n - len(written)} not started)",
            file=sys.stderr,
        )
        return INTERRUPTED
    return 0


def _read_schema(path):
    """The text of the --json-schema file (None without the flag)."""
    if path is None:
        return None
    try:  # a UTF-8 byte-order mark opening the file is not part of the schema
        with open(path, encoding="utf-8-sig") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        raise ValueError(f"--json-schema: cannot read {path} ({why})") from None


def main(argv=None) -> int:
    """Run the command; returns the exit status. Ctrl-C is recorded from the first instruction to
    the last and acted on at the next boundary (exit status 130)."""
    with _sigint_recorded():
        try:
            return _main(argv)
        except _Interrupted as stop:
            print(
                f"\nsample.py: interrupted while {stop.stage}; nothing was generated",
                file=sys.stderr,
            )
            return INTERRUPTED


def _main(argv) -> int:
    silence_notices()
    _stop_if_interrupted("starting")
    from asps_jax.verify.api import TREE_METHODS

    parser = build_parser()
    args = parser.parse_args(argv)
    _stop_if_interrupted("starting")
    if args.tree is not None:
        if args.method not in TREE_METHODS:  # before --tree sets --num-drafts, which ar refuses
            does = "uses no draft" if args.method == "ar" else "verifies draft chains"
            parser.error(
                f"--tree drafts a branching tree, which the tree methods "
                f"({', '.join(TREE_METHODS)}) verify; --method {args.method} {does} (drop --tree)"
            )
        implied = {"num_drafts": math.prod(args.tree), "num_draft_tokens": len(args.tree)}
        for name, value in implied.items():
            given = getattr(args, name)
            if given is not None and given != value:
                flag = "--" + name.replace("_", "-")
                parser.error(f"--tree {args.tree} implies {flag} {value}; drop {flag} {given}")
            setattr(args, name, value)
    if args.num_draft_tokens is None:  # a lookup's chains are at most --lookup-max long
        args.num_draft_tokens = args.lookup_max if args.draft == "lookup" and args.lookup_max else 8
    args.num_drafts = 1 if args.num_drafts is None else args.num_drafts
    if args.regex is not None and args.json_schema is not None:
        parser.error("--regex and --json-schema: give at most one constraint")
    if args.top_logprobs and not args.json:
        parser.error("--top-logprobs needs --json (the log-probabilities are in its output)")
    if args.prompts is not None and args.prompt:
        parser.error("--prompts and --prompt: give the prompts one way")
    if args.prompts is not None and args.top_logprobs:
        parser.error("--top-logprobs: not with --prompts (per-prompt lines carry no log-probs)")
    prompts = len(args.prompt or [DEFAULT_PROMPT])
    if args.prompts is None and args.batch_size is not None and args.batch_size < prompts:
        parser.error(
            f"--batch-size {args.batch_size} is smaller than the {prompts} prompts given; raise "
            "it or drop it (default: one row per prompt)"
        )
    if args.stop:
        from asps_jax.stopping import validate_stop

        try:
            validate_stop(args.stop, name="--stop")
        except ValueError as err:
            parser.error(str(err))
    try:
        return run(args)
    except KeyboardInterrupt:  # raised as such: main() off the main thread keeps Python's handler
        print("\nsample.py: interrupted; nothing was generated", file=sys.stderr)
        return INTERRUPTED
    except (ValueError, FileNotFoundError, NotImplementedError, FloatingPointError) as err:
        message = " ".join(str(err).split())
        print(f"sample.py: error: {message}", file=sys.stderr)
        return 2 if not isinstance(err, FloatingPointError) else 1


if __name__ == "__main__":
    sys.exit(main())
