"""The command's flow (``asps-jax sample``, ``python -m asps_jax``, ``scripts/sample.py``): Ctrl-C
and the notices (set before anything heavy is imported), start-up, the step loops, the exit status
(docs/api.md §4). The rest of the command is in this package: :mod:`asps_jax.cli.args` the parser,
its checks and the flags as library arguments (:mod:`asps_jax.cli.flags` the flags' types),
:mod:`asps_jax.cli.output` what is printed, :mod:`asps_jax.cli.prompts` the ``--prompts`` FILE.

Text streams to stdout as it is produced (row 0 of the batch), never splitting a character; the
statistics block follows. Compiled programs are cached on disk (asps_jax.compile_cache), so a
second run with the same shapes starts in seconds. Errors in the arguments or the environment exit
with a one-line explanation; third-party notices that do not apply here are silenced. With
JAX_PLATFORMS unset on a machine without an accelerator, JAX starts the CPU backend alone (an
installed libtpu, e.g. for benchmarks/bench_tpu.py, is not started where there is no TPU).

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

import contextlib
import io
import logging
import os
import signal
import sys
import time


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


INTERRUPTED = 130


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


def _choose_platforms() -> None:
    """JAX_PLATFORMS unset on a machine without an accelerator: the CPU alone
    (``asps_jax.platforms.default_platforms``), so that an installed libtpu is not started (and
    does not fill stderr with its warnings) where there is no TPU. Before JAX starts a backend."""
    from asps_jax import platforms

    chosen = platforms.default_platforms()
    if chosen is not None:
        import jax

        jax.config.update("jax_platforms", chosen)


def _main(argv) -> int:
    silence_notices()
    _choose_platforms()
    _stop_if_interrupted("starting")
    from asps_jax.cli.args import build_parser, check

    parser = build_parser()
    args = parser.parse_args(argv)
    _stop_if_interrupted("starting")
    check(parser, args)
    try:
        return run(args)
    except KeyboardInterrupt:  # raised as such: main() off the main thread keeps Python's handler
        print("\nsample.py: interrupted; nothing was generated", file=sys.stderr)
        return INTERRUPTED
    except (ValueError, FileNotFoundError, NotImplementedError, FloatingPointError) as err:
        print(f"sample.py: error: {_error_message(err)}", file=sys.stderr)
        return 2 if not isinstance(err, FloatingPointError) else 1


def _error_message(err: Exception) -> str:
    """One line; but missing weights keep their lines (the first a one-line summary with the
    fetch command, then one place searched per line), indented under the error."""
    from asps_jax.models.cards import MissingWeightsError

    if isinstance(err, MissingWeightsError) and "\n" in str(err).strip():
        return "\n  ".join(line.rstrip() for line in str(err).strip().splitlines())
    return " ".join(str(err).split())


def run(args) -> int:
    """The checked flags ``args``: processes joined, the compilation cache, the mesh and the
    models set up, then the prompts sampled; returns the exit status."""
    import jax

    from asps_jax import compile_cache
    from asps_jax.sharding import init_distributed, make_mesh

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
    target, draft = _load_models(args)
    load_s = time.perf_counter() - start
    out_stream = stdout if primary else io.StringIO()
    if args.prompts is not None:
        return _run_prompts(args, target, draft, mesh, load_s, out_stream)
    return _run_batch(args, target, draft, mesh, load_s, out_stream, primary)


def _load_models(args):
    """``(target, draft)``: the draft a model, a drafter's name (lookup, self:L, quant:int8,
    eagle3:PATH) or None (ar)."""
    from asps_jax.cli.args import DTYPES
    from asps_jax.drafters import is_named as named_draft

    dtype = DTYPES[args.dtype]
    target = _load(args.target, dtype, "--quantize", args.quantize)
    _stop_if_interrupted("loading the models")
    draft = None
    if args.method != "ar":  # a checkpoint, or a drafter named by --draft (lookup, self:L)
        draft = args.draft
        if not named_draft(args.draft):
            draft = _load(args.draft, dtype, "--draft-quantize", args.draft_quantize)
        elif args.draft_quantize is not None:
            raise ValueError(
                f"--draft-quantize quantizes a draft checkpoint; --draft {args.draft} is not one "
                "(for the target's own quantized copy give --draft quant:int8)"
            )
    _stop_if_interrupted("loading the models")
    if target.tokenizer is None:
        raise FileNotFoundError(f"{args.target}: no tokenizer files next to the checkpoint")
    return target, draft


def _load(name, dtype, flag: str, quantize):
    """``load_model``, a scheme that does not fit the model named by its flag."""
    import asps_jax
    from asps_jax.models.quant import QuantizeError

    try:
        return asps_jax.load_model(name, dtype=dtype, quantize=quantize)
    except QuantizeError as err:
        raise ValueError(f"{flag} {quantize}: {err.detail}") from None


def _run_batch(args, target, draft, mesh, load_s, out_stream, primary) -> int:
    """The ``--prompt`` texts (default one) as one batch of ``--batch-size`` rows: row 0's text
    streamed, then the statistics block; or one JSON object with ``--json``."""
    import jax

    from asps_jax import compile_cache
    from asps_jax.cli import output
    from asps_jax.cli.args import DEFAULT_PROMPT, check_sizes, sampling_kwargs
    from asps_jax.session import Session
    from asps_jax.textstream import TextStream

    texts = args.prompt or [DEFAULT_PROMPT]
    tokenizer = target.tokenizer
    # verbose=False: the length check below gives the error; no tokenizer warning first.
    encoded = [tokenizer.encode(t, verbose=False) for t in texts]
    if args.batch_size is None:
        args.batch_size = len(texts)
    check_sizes(args, target, draft, encoded, mesh)
    session = Session(
        target,
        draft,
        [encoded[b % len(encoded)] for b in range(args.batch_size)],
        key=jax.random.key(args.seed),
        n=args.n,
        max_new_tokens=args.max_new_tokens,
        top_logprobs=args.top_logprobs or 0,
        mesh=mesh,
        return_logprobs=args.json,
        **sampling_kwargs(args),
    )
    if session.calibration is not None and primary:
        print(f"[{session.calibration.describe()}]", file=sys.stderr, flush=True)
    _stop_if_interrupted("preparing the batch")
    if not args.json and primary:
        cached = "" if compile_cache.disabled_by_env() else ", or loading it from the cache"
        print(
            f"[compiling {args.method} for {args.target} / "
            f"{args.draft if draft is not None else '-'}{cached} ...]",
            file=sys.stderr,
            flush=True,
        )
    before = compile_cache.compiles()
    compile_s = _compile(session)
    if not args.json and primary:
        print(f"[{output.compiled_note(before, compile_s)}]", file=sys.stderr, flush=True)
    if not args.json:
        print(texts[0], end="", file=out_stream, flush=True)
    start = time.perf_counter()
    text = TextStream(tokenizer, skip_special_tokens=True)
    steps, interrupted = _stream(session, text, args, out_stream, primary)
    run_s = time.perf_counter() - start
    if steps == 0:  # interrupted before the first step finished
        return _nothing_generated("\n")
    out, failure = output.result(session)
    summary = output.summary(session, out, args, compile_s, run_s, load_s)
    summary["interrupted"] = interrupted
    if args.json:
        output.write_json(output.batch_json(summary, out, texts, tokenizer), out_stream)
    else:
        print(text.flush(), file=out_stream)
        output.print_summary(summary, out_stream)
    what = f"{summary['new_tokens']} new tokens (statistics above)"
    return _finish(failure, interrupted or _CtrlC.requested, what)


def _stream(session, text, args, out_stream, primary) -> tuple[int, bool]:
    """The batch's steps, row 0's new text (its TextStream ``text``) printed after each (not with
    ``--json``), until the end or a Ctrl-C; returns ``(steps done, interrupted)``."""
    step, interrupted = 0, False
    try:
        for new in session.steps():
            step += 1
            if not args.json:
                print(text.push(new[0]), end="", file=out_stream, flush=True)
                if step % 25 == 0 and args.batch_size > 1 and primary:
                    print(f"\n[step {step}]", file=sys.stderr, flush=True)
            if _CtrlC.requested:  # the boundary between two steps
                interrupted = True
                break
    except KeyboardInterrupt:  # raised by steps() itself when SIGINT is Python's default
        interrupted = True
    return step, interrupted


def _run_prompts(args, target, draft, mesh, load_s, out_stream) -> int:
    """``--prompts FILE``: every prompt through ``--batch-size`` slots (continuous batching), step
    by step so that a Ctrl-C is honoured at the next step boundary; JSON lines in prompt order,
    then one line of pooled statistics (an interrupted run's: docs/api.md §4)."""
    from asps_jax.cli.prompts import PromptRun

    prompts = PromptRun(args, target, draft, mesh)
    _stop_if_interrupted("preparing the batch")
    compile_s = _compile(prompts.session)
    interrupted = False
    prompts.begin()
    try:
        for p, new in prompts.session.steps():
            prompts.record(p, new)
            if _CtrlC.requested and prompts.session.step_end:  # the boundary between two steps
                break
    except KeyboardInterrupt:  # raised by steps() itself when SIGINT is Python's default
        interrupted = True
    run_s = prompts.end()
    interrupted = interrupted or _CtrlC.requested
    if interrupted and prompts.pairs == 0:
        return _nothing_generated("")
    failure, what = prompts.write(out_stream, interrupted, load_s, compile_s, run_s)
    return _finish(failure, interrupted, what)


def _compile(session) -> float:
    """Compile the session's programs; returns the seconds. A Ctrl-C while it runs, or recorded
    by its end, stops the command ("interrupted while compiling")."""
    try:
        compile_s = session.compile()
    except KeyboardInterrupt:
        raise _Interrupted("compiling") from None
    _stop_if_interrupted("compiling")
    return compile_s


def _nothing_generated(lead: str) -> int:
    print(
        f"{lead}sample.py: interrupted before the first step; nothing was generated",
        file=sys.stderr,
    )
    return INTERRUPTED


def _finish(failure, interrupted: bool, what: str) -> int:
    """The exit status of a run that printed its output: 1 where a model produced NaN / inf
    logits, 130 where interrupted (after ``what``), else 0."""
    if failure is not None:
        from asps_jax.cli.output import nonfinite_message

        print(f"sample.py: error: {nonfinite_message(failure)}", file=sys.stderr)
        return 1
    if interrupted:
        print(f"sample.py: interrupted after {what}", file=sys.stderr)
        return INTERRUPTED
    return 0


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


def console(argv=None) -> int:
    """``asps-jax [sample] ARGS`` and ``python -m asps_jax [sample] ARGS``: :func:`main` on
    ``ARGS`` (``sample``, the one command, may be left out); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sample"]:
        argv = argv[1:]
    return main(argv)
