"""``asps_jax.sample``, ``asps_jax.stream`` and :class:`Session`: running a prepared call
(:func:`asps_jax.sampler.prepare`) at once, or one compiled step at a time.

A :class:`Session` is one of two implementations of one protocol (``compile``, ``steps``,
``result``): :class:`BatchSession` runs every row at once (prefill, then the step until every row
is done); :class:`SlotSession` (``batch_size=B``, continuous batching) runs the prompts through B
slots (:mod:`asps_jax.slots`). ``Session(...)`` builds the one the arguments ask for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import threading
import time
from collections.abc import Iterator

import jax
import numpy as np

from asps_jax import (
    arguments,
    autotune,
    compile_cache,
    decode,
    drafters,
    platforms,
    sharding,
    slots,
)
from asps_jax.models import Model
from asps_jax.sampler import SampleOutput, check_logprob_options, finish, prepare
from asps_jax.verify import registry


def sample(
    target, draft, prompts, *, key=None, max_new_tokens, return_logprobs=False, **kwargs
) -> SampleOutput:
    """Sample ``max_new_tokens`` tokens per prompt with exactly the target's law (docs/api.md §3).

    ``target`` / ``draft`` are :class:`asps_jax.models.Model` (``draft`` may be None for
    ``method="ar"``). See :func:`~asps_jax.sampler.prepare` for the keyword arguments (the
    sampling arguments: :class:`asps_jax.controls.sampling.Sampling`); extra keyword arguments are
    method options (e.g. ``rule="fixed_order"`` for ``method="is"``). ``return_logprobs=True``
    fills :attr:`SampleOutput.logprobs` (measured in the loop either way: no extra forward, no
    recompile). ``max_new_tokens`` may be one budget per prompt; ``batch_size=B`` runs the
    prompts through B slots with continuous batching (:mod:`asps_jax.slots`), each prompt's
    tokens independent of B (docs/api.md §3). ``key=`` a PRNG key (or one per prompt), or
    ``seed=`` an int (or one per prompt); ``n=k``: k samples per prompt, rows ``p * k + i``, each
    prompt's depending only on its key or seed and the sample's index.
    """
    arguments.check_keywords("sample", kwargs, _KEYWORDS)
    check_logprob_options(
        kwargs.get("top_logprobs"),
        return_logprobs,
        target.vocab_size,
        kwargs.get("raw_logprobs", False),
    )
    compile_cache.enable_default()  # before the calibration of num_draft_tokens="auto" compiles
    calibration = _resolve_auto(target, draft, prompts, key, kwargs)
    call = prepare(target, draft, prompts, key=key, max_new_tokens=max_new_tokens, **kwargs)
    mesh = call.decoder.mesh
    width = call.output_width()
    out = finish(
        call.run(), call.decoder.spec, call.batch, return_logprobs, mesh, width, call.constraint
    )
    if calibration is not None:
        out.stats["calibration"] = calibration
    return out


def stream(
    target, draft, prompts, *, key=None, max_new_tokens, **kwargs
) -> Iterator[list[list[int]]]:
    """Like :func:`sample`, one compiled step at a time: yields each row's new tokens per step
    (with ``batch_size``: ``(prompt_index, new_tokens)`` pairs as they come).

    The generator's return value (``StopIteration.value``) is the :class:`SampleOutput`.
    """
    arguments.check_keywords("stream", kwargs, _KEYWORDS)
    session = Session(target, draft, prompts, key=key, max_new_tokens=max_new_tokens, **kwargs)
    yield from session.steps()
    return session.result()


_KEYWORDS = arguments.call_keywords(prepare)  # every keyword a sampling call takes


def _resolve_auto(target, draft, prompts, key, kwargs):
    """``num_draft_tokens="auto"``: calibrate (:mod:`asps_jax.autotune`) and put the chosen n into
    ``kwargs``; returns the :class:`~asps_jax.autotune.Calibration` (None without "auto")."""
    if not (isinstance(kwargs.get("num_draft_tokens"), str)):
        return None
    if kwargs["num_draft_tokens"] != "auto":
        raise ValueError(
            "num_draft_tokens must be an integer >= 1 or 'auto', got "
            f"{kwargs['num_draft_tokens']!r}"
        )
    if kwargs.get("method", registry.DEFAULT_METHOD) == "ar" or kwargs.get("tree") is not None:
        raise ValueError(
            "num_draft_tokens='auto' chooses the length of draft chains: not for method 'ar' or "
            "a tree="
        )
    max_n = drafters.longest_draft(kwargs)
    probe = {k: v for k, v in kwargs.items() if k != "num_draft_tokens"}
    # One-line errors for the call's own arguments before anything is measured.
    prepare(target, draft, prompts, key=key, max_new_tokens=1, num_draft_tokens=max_n, **probe)
    calibration = autotune.calibrate(Session, target, draft, prompts, key=key, max_n=max_n, **probe)
    kwargs["num_draft_tokens"] = calibration.num_draft_tokens
    return calibration


@contextlib.contextmanager
def _sigint_recorded() -> Iterator[threading.Event]:
    """Record SIGINT (Ctrl-C) during the block in the yielded event instead of raising
    KeyboardInterrupt wherever it lands: one that lands while a finaliser or weakref callback runs
    (a JAX buffer's, say) is printed as "Exception ignored" and lost. The caller acts on the event
    at its next boundary. Installed only on the main thread while SIGINT has Python's default
    handler (a program with its own handler keeps it, and acts on it itself); the previous handler
    is restored on leaving (``signal.signal`` runs a pending handler first, so nothing slips
    between)."""
    received = threading.Event()
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield received
        return
    previous = signal.signal(signal.SIGINT, lambda *_: received.set())
    try:
        yield received
    finally:
        signal.signal(signal.SIGINT, previous)


class Session:
    """Step-wise decoding for streaming, with compilation timed apart from running.

    ``Session(target, draft, prompts, key=..., max_new_tokens=..., **kwargs)`` takes the arguments
    of :func:`sample` and is a :class:`BatchSession`, or with ``batch_size`` a
    :class:`SlotSession`. ``compile()`` compiles the first and the next steps ahead of time and
    returns the seconds it took; ``steps()`` yields the new tokens after every compiled step;
    ``result()`` gives the :class:`SampleOutput`. ``constraint``: the call's
    :class:`~asps_jax.controls.sampling.HostConstraint` under a ``regex`` / ``json_schema`` (None
    without), which tells whether a row's tokens so far complete its text
    (:meth:`~asps_jax.controls.sampling.HostConstraint.incomplete_rows`). ``calibration``: with
    ``num_draft_tokens="auto"``, the :class:`~asps_jax.autotune.Calibration` that chose n.
    """

    def __new__(cls, *args, **kwargs):
        if cls is Session:
            cls = SlotSession if kwargs.get("batch_size") is not None else BatchSession
        return super().__new__(cls)

    def __init__(
        self, target, draft, prompts, *, key=None, max_new_tokens, return_logprobs=False, **kwargs
    ):
        arguments.check_keywords("Session", kwargs, _KEYWORDS)
        self.return_logprobs = bool(return_logprobs)
        check_logprob_options(
            kwargs.get("top_logprobs"),
            return_logprobs,
            target.vocab_size,
            kwargs.get("raw_logprobs", False),
        )
        compile_cache.enable_default()  # before the calibration of num_draft_tokens="auto"
        self.calibration = _resolve_auto(target, draft, prompts, key, kwargs)
        call = prepare(target, draft, prompts, key=key, max_new_tokens=max_new_tokens, **kwargs)
        self.batch_size = call.batch
        self._width = call.output_width()
        self.constraint = call.constraint
        self.decoder: decode.Decoder = call.decoder
        self.spec: decode.SpecConfig = self.decoder.spec
        inputs = call.inputs
        self._params = dict(target_params=inputs.target_params, draft_params=inputs.draft_params)
        self._state = None  # the last step's state (steps())
        self._mesh = None
        self._start(call)

    def _start(self, call) -> None:
        """What the implementation keeps of the prepared call."""
        raise NotImplementedError

    def compile(self) -> float:
        """Compile the first and the next steps now (on XLA:CPU, running each once:
        ``_lazy_kernels``); returns the wall seconds spent compiling."""
        start = time.perf_counter()
        self._compile()
        return time.perf_counter() - start

    def steps(self) -> Iterator:
        """Yield the new tokens after every compiled step, until every row is done (what each
        implementation yields: its class docstring)."""
        yield from self._steps()

    def _compile(self) -> None:
        raise NotImplementedError

    def _lazy_kernels(self) -> bool:
        """Whether the call runs on XLA:CPU, which finishes compiling a program at its first call
        (its kernels are made then: ~12 ms for a small program, 50-90 ms for a step of the bundled
        pair). ``compile()`` then runs each compiled program once on the real inputs and drops
        the result, so that it holds all the compile work and the run's first step costs what the
        others do (an accelerator's programs are complete when compiled: no such call)."""
        return platforms.of(self._mesh, self._params["target_params"]) == "cpu"

    def _steps(self) -> Iterator:
        raise NotImplementedError

    def _results(self):
        """The state :func:`~asps_jax.sampler.finish` reads."""
        return self._state

    def result(self) -> SampleOutput:
        if self._state is None:
            raise RuntimeError("Session.result(): run steps() to completion first")
        return finish(
            self._results(),
            self.spec,
            self.batch_size,
            self.return_logprobs,
            self._mesh,
            self._width,
            self.constraint,
        )


class BatchSession(Session):
    """Every row at once: prefill, then the step until every row is done.

    ``steps()`` yields each row's new tokens after every step. Ctrl-C while a step runs (or
    prefill) is held until the step's state is kept, then raised as KeyboardInterrupt from
    ``next()`` instead of yielding: ``result()`` has every step that finished, that one included.
    Between ``next()`` calls SIGINT is the caller's.
    """

    def _start(self, call) -> None:
        inputs = call.inputs
        self._prefill_args = inputs.prefill_kwargs()
        self._sampling = inputs.sampling
        self._prefill = functools.partial(decode.prefill, self.decoder)
        self._step = functools.partial(decode.spec_step, self.decoder)
        self._mesh = self.decoder.mesh  # checked by prepare

    def _place(self, state):
        """On a mesh, give the state the one layout the compiled step expects."""
        return state if self._mesh is None else sharding.shard_state(state, self._mesh)

    def _compile(self) -> None:
        prefill = decode.prefill.lower(self.decoder, **self._prefill_args).compile()
        state_shape = jax.eval_shape(lambda: self._prefill(**self._prefill_args))
        if self._mesh is not None:
            state_shape = sharding.sharded_shapes(state_shape, self._mesh)
        step = decode.spec_step.lower(
            self.decoder, **self._params, sampling=self._sampling, state=state_shape
        ).compile()
        if self._lazy_kernels():
            state = self._place(prefill(**self._prefill_args))
            jax.block_until_ready(step(**self._params, sampling=self._sampling, state=state))
        self._prefill = prefill  # compiled: called with the arrays only
        self._step = step

    def _steps(self) -> Iterator[list[list[int]]]:
        with _sigint_recorded() as interrupt:
            state = self._place(self._prefill(**self._prefill_args))
        if interrupt.is_set():
            raise KeyboardInterrupt
        seen = np.zeros(self.batch_size, np.int64)
        while True:
            # The step donates the old state: the new one is kept before anything else can happen.
            with _sigint_recorded() as interrupt:
                state = self._place(
                    self._step(**self._params, sampling=self._sampling, state=state)
                )
                self._state = state
                view = sharding.to_local(
                    (state.num_generated, state.tokens, state.done), self._mesh
                )
                generated = np.asarray(view[0])[: self.batch_size]
                tokens = np.asarray(view[1])
                done = bool(np.all(np.asarray(view[2])))
            if interrupt.is_set():
                raise KeyboardInterrupt
            yield [tokens[b, seen[b] : generated[b]].tolist() for b in range(self.batch_size)]
            seen = generated
            if done:
                return


class SlotSession(Session):
    """The prompts through ``batch_size`` slots (continuous batching, :mod:`asps_jax.slots`).

    ``steps()`` yields ``(prompt_index, new_tokens)`` for every prompt that got tokens in the
    step (in slot order) and, as each pair is yielded: ``prompts_done`` counts the prompts
    finished so far; ``finished`` (bool[N], one per prompt) is True for a prompt once the pair
    carrying its last tokens is yielded (or, for one that gets no tokens in its last step, as that
    step's pairs are), so the pairs yielded up to then are all of its tokens; ``prompts_started``
    counts the prompts that have taken a slot (prompts ``0 .. prompts_started - 1``: the started
    ones not ``finished`` are in flight, their tokens so far the pairs yielded for them);
    ``step_end`` is True when the pair is the last of its compiled step (a caller that stops there
    stops at a step boundary, every pair of the steps run received). A KeyboardInterrupt from
    ``next()`` (Ctrl-C, held until the step's state is kept) leaves ``finished``,
    ``prompts_done`` and ``prompts_started`` as they were at the last pair yielded.
    """

    def _start(self, call) -> None:
        self._slots = call.slot_kwargs()  # the keyword arguments of slots.start
        self._slot_fns = (None, None)
        self.prompts_done = 0
        self._mesh = self.decoder.mesh  # checked by prepare

    def _place(self, s):
        """On a mesh, give the slots' state the one layout the compiled step expects."""
        return s if self._mesh is None else sharding.shard_state(s, self._mesh)

    def _compile(self) -> None:
        a = self._slots
        first = slots.start.lower(self.decoder, **a).compile()
        shape = jax.eval_shape(lambda: slots.start(self.decoder, **a))
        if self._mesh is not None:
            shape = sharding.sharded_shapes(shape, self._mesh)
        step = slots.advance.lower(self.decoder, **self._params, prompts=a["prompts"], s=shape)
        step = step.compile()
        if self._lazy_kernels():  # Session._lazy_kernels: each program run once, the result dropped
            s = self._place(first(**{k: v for k, v in a.items() if k != "batch"}))
            jax.block_until_ready(step(**self._params, prompts=a["prompts"], s=s))
        self._slot_fns = (first, step)

    def _results(self):
        return self._state.results

    def _steps(self) -> Iterator[tuple[int, list[int]]]:
        a = self._slots
        first, step = self._slot_fns
        if first is None:  # not compiled ahead: jit on the first call
            first = functools.partial(slots.start, self.decoder, batch=a["batch"])
            step = functools.partial(slots.advance, self.decoder)
        first_args = {k: v for k, v in a.items() if k != "batch"}
        # Updated as the pairs are yielded (the class docstring): a fresh array per run.
        finished = self.finished = np.zeros(self.batch_size, bool)
        self.prompts_done = self.prompts_started = 0
        self.step_end = False
        with _sigint_recorded() as interrupt:
            s = self._place(first(**first_args))
        if interrupt.is_set():
            raise KeyboardInterrupt
        seen = np.zeros(self.batch_size, np.int64)
        while True:
            with _sigint_recorded() as interrupt:
                s = self._place(step(**self._params, prompts=a["prompts"], s=s))
                self._state = s
                view = _SlotView.read(s, self.batch_size, self._mesh)
            if interrupt.is_set():
                raise KeyboardInterrupt
            pairs = view.pairs(finished, seen)
            self.prompts_started = view.started
            self.prompts_done = int(finished.sum())
            for i, (p, new, last) in enumerate(pairs):
                if last:
                    finished[p] = True
                    self.prompts_done = int(finished.sum())
                self.step_end = i == len(pairs) - 1
                yield p, new
            self.step_end = False
            if finished.all():
                return


@dataclasses.dataclass(frozen=True)
class _SlotView:
    """One slot step's state on the host (NumPy): which prompt each slot runs (``prompt``, -1
    for none), how many prompts have started, the tokens so far of the running slots and of the
    finished prompts (``res_*``), for the first ``batch`` prompts."""

    prompt: np.ndarray
    started: int
    generated: np.ndarray
    tokens: np.ndarray
    res_len: np.ndarray
    res_tokens: np.ndarray
    batch: int

    @classmethod
    def read(cls, s, batch: int, mesh=None) -> _SlotView:
        """The view of slot state ``s`` (on a multi-process mesh, gathered whole first)."""
        st, res = s.state, s.results
        host = sharding.to_local(
            (s.prompt, s.next, st.num_generated, st.tokens, res.num_generated, res.tokens), mesh
        )
        prompt, started, generated, tokens, res_len, res_tokens = map(np.asarray, host)
        return cls(
            prompt=prompt,
            started=int(started),
            generated=generated,
            tokens=tokens,
            res_len=res_len[:batch],
            res_tokens=res_tokens,
            batch=batch,
        )

    def pairs(self, finished, seen) -> list[tuple[int, list[int], bool]]:
        """``(prompt, its new tokens, whether they are its last)`` in the order they are yielded;
        ``seen`` (tokens yielded per prompt) is advanced, and a prompt that finished with nothing
        new is marked ``finished`` at once."""
        running = np.zeros(self.batch, bool)
        running[self.prompt[self.prompt >= 0]] = True
        # Prompts that finished in this step (possibly started in it too): from the results.
        new_done = ~running & ~finished & (np.arange(self.batch) < self.started)
        pairs = []
        for p in np.flatnonzero(new_done).tolist():
            if self.res_len[p] > seen[p]:
                pairs.append((p, self.res_tokens[p, seen[p] : self.res_len[p]].tolist(), True))
                seen[p] = self.res_len[p]
            else:  # nothing new in its last step: finished as the step's pairs come
                finished[p] = True
        for slot, p in enumerate(self.prompt.tolist()):
            if p >= 0 and self.generated[slot] > seen[p]:
                pairs.append((p, self.tokens[slot, seen[p] : self.generated[slot]].tolist(), False))
                seen[p] = self.generated[slot]
        return pairs


# Arguments of a :class:`Sampler` call rather than of the sampler itself.
_PER_CALL = ("prompts", "max_new_tokens", "key", "seed", "n", "prompt_lengths")


class Sampler:
    """A long-lived sampler, e.g. for the rollouts of an RL loop: the models and the fixed options
    once, then calls with prompts and per-call sampling values, and the weights swapped in place.

    ``Sampler(target, draft, **options)``: ``draft`` as for :func:`sample` (a
    :class:`~asps_jax.models.Model`, ``"self:L"``, ``"lookup"``, or None for ``method="ar"``);
    ``options``: any keyword argument of :func:`sample` but the prompts, budgets, keys and ``n``
    (the method, its sizes and options, the drafter's options, ``batch_size``, ``mesh``, sampling
    arguments to use by default...), checked here with one-line errors. A call's own keyword
    arguments override them for that call.

    ``sampler(prompts, max_new_tokens=..., seed=... or key=..., n=k, **per_call)`` is
    ``sample(target, draft, prompts, ...)`` with the current weights: the same outputs, bit for
    bit. Calls with the same static shape (method, sizes, prompt-width and budget buckets, the
    feature families used) share one compiled program; values (temperatures, seeds, budgets
    inside one bucket, the weights) never recompile. :attr:`compiles` counts the XLA programs
    built during this sampler's calls.

    :meth:`update_params` swaps the weights: no recompile, no host copy; a drafter derived from
    the target (``"self:L"``, whose layers are views of the target's; ``"quant:int8"``, made from
    them) follows it, ``"lookup"``
    has no weights, and a separate draft model keeps its own unless new ones are given.
    """

    def __init__(self, target, draft=None, **options):
        bad = sorted(set(options) & set(_PER_CALL))
        if bad:
            raise ValueError(
                f"Sampler: {', '.join(bad)} belong to each call (sampler(prompts, "
                "max_new_tokens=..., seed=...)), not to the sampler"
            )
        arguments.check_keywords("Sampler", options, _KEYWORDS)
        check_logprob_options(
            options.get("top_logprobs"),
            options.get("return_logprobs", False),
            target.vocab_size,
            options.get("raw_logprobs", False),
        )
        self.target = target
        self.draft = draft
        self.options = dict(options)
        self._compiles = 0
        # One-line errors for the fixed options now, before any call (nothing is compiled).
        prepare(target, draft, [[0]], seed=0, max_new_tokens=1, **self._checked(self.options))

    @staticmethod
    def _checked(options: dict) -> dict:
        """``options`` without the output flags :func:`prepare` does not take."""
        return {k: v for k, v in options.items() if k != "return_logprobs"}

    @property
    def compiles(self) -> int:
        """XLA programs built (compiled, or loaded from the persistent cache) during this
        sampler's calls: a jit cache miss each."""
        return self._compiles

    def update_params(self, target_params, draft_params=None) -> None:
        """Swap in new weights, in the stored layout of the current ones (the same pytree, shapes
        and dtypes: a one-line error names the first leaf that differs). Device arrays are used
        as they are; the next call runs on them without recompiling."""
        self.target = _with_params(self.target, target_params, "target_params")
        if draft_params is not None:
            if not isinstance(self.draft, Model):
                raise ValueError(
                    f"update_params: draft={self.draft!r} has no weights of its own to replace "
                    "(a 'self:L' or 'quant:int8' draft follows the target's); omit draft_params"
                )
            self.draft = _with_params(self.draft, draft_params, "draft_params")

    def __call__(self, prompts, *, max_new_tokens, **kwargs) -> SampleOutput:
        """``sample(target, draft, prompts, max_new_tokens=..., **options, **kwargs)``."""
        arguments.check_keywords("Sampler call", kwargs, _KEYWORDS)
        compile_cache.count_compiles()
        before = compile_cache.compiles()["programs"]
        try:
            return sample(
                self.target,
                self.draft,
                prompts,
                max_new_tokens=max_new_tokens,
                **arguments.call_options(self.options, kwargs),
            )
        finally:
            self._compiles += compile_cache.compiles()["programs"] - before


def _with_params(model: Model, params, name: str) -> Model:
    """``model`` with ``params`` in place of its own, which they must match leaf for leaf."""
    old, old_tree = jax.tree.flatten_with_path(model.params)
    new, new_tree = jax.tree.flatten_with_path(params)
    if old_tree != new_tree:
        raise ValueError(
            f"update_params: {name} is not laid out like the model's parameters "
            f"({len(new)} leaves against {len(old)}, or other names); pass the same pytree"
        )
    for (path, a), (_, b) in zip(old, new):
        if isinstance(b, jax.Array) and b.is_deleted():
            raise ValueError(
                f"update_params: {name}{jax.tree_util.keystr(path)} is a deleted array (donated "
                "to a jitted call or .delete()d): pass arrays that are still alive"
            )
        if np.shape(a) != np.shape(b) or _dtype(a) != _dtype(b):
            raise ValueError(
                f"update_params: {name}{jax.tree_util.keystr(path)} is "
                f"{_dtype(b).name}{list(np.shape(b))}, the model's is "
                f"{_dtype(a).name}{list(np.shape(a))}"
            )
    return dataclasses.replace(model, params=params)


def _dtype(x) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.result_type(x)
