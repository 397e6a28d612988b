"""``num_draft_tokens="auto"``: the draft length n from a short measured calibration.

Two short runs on the call's own prompts and settings (compiled apart from the timing): the
target alone (``"ar"``: the cost of a target step, t_0) and the method at ``max_n`` (the cost of
a step t_max, and the histogram of tokens emitted per step). Then

* tokens per step at n: ``E(n) = sum_{i=0..n} P(L >= i + 1)``, L the tokens a step emitted at
  ``max_n`` (a chain cut to n emits ``min(L, n + 1)`` tokens when acceptance at depth i does not
  depend on the depths after it, as for SpS; an approximation for ASpS and the multi-draft
  methods, which may accept a little more on the longer chain);
* cost of a step at n: ``t_0 + n (t_max - t_0) / max_n`` (the draft forwards and the extra tree
  nodes the target scores grow linearly with n; ``cost_ratio`` reports the slope over t_0, the
  draft-to-target forward cost ratio for a model draft);

and n maximises ``E(n) / cost(n)`` over 1..max_n. The choice is exact whatever it is (n is fixed
before the real run starts); only its speed depends on the calibration. Calibration costs two
compiles and ``steps`` steps each: worth it for long or repeated calls, not for a single short one.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from asps_jax.controls import Sampling
from asps_jax.verify import registry


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The outcome of :func:`calibrate`.

    Attributes:
      num_draft_tokens: the chosen n.
      tokens_per_step: E(n) for n = 0..max_n (index n).
      step_seconds: the modelled seconds of a step for n = 0..max_n.
      cost_ratio: the per-n slope of the step cost over the target step (t_max - t_0) / max_n / t_0.
    """

    num_draft_tokens: int
    tokens_per_step: tuple[float, ...]
    step_seconds: tuple[float, ...]
    cost_ratio: float

    def describe(self) -> str:
        best = self.num_draft_tokens
        return (
            f"num_draft_tokens=auto chose n={best}: {self.tokens_per_step[best]:.2f} tokens/step, "
            f"cost ratio {self.cost_ratio:.3f} per draft token, expected "
            f"{self.tokens_per_step[best] / self.step_seconds[best]:.1f} tokens/s "
            f"(n=1: {self.tokens_per_step[1] / self.step_seconds[1]:.1f}, "
            f"n={len(self.step_seconds) - 1}: "
            f"{self.tokens_per_step[-1] / self.step_seconds[-1]:.1f})"
        )


def choose(hist, t_ar: float, t_max: float) -> Calibration:
    """The choice from the emitted-length histogram at ``max_n`` (``hist[l]``: steps that emitted
    l tokens, l = 0..max_n + 1) and the two measured step costs."""
    hist = np.asarray(hist, np.float64)
    max_n = hist.shape[0] - 2
    steps = max(hist[1:].sum(), 1.0)
    at_least = np.array([hist[i + 1 :].sum() / steps for i in range(max_n + 1)])  # P(L >= i + 1)
    tokens = np.cumsum(at_least)  # E(n), n = 0..max_n
    slope = max(t_max - t_ar, 0.0) / max(max_n, 1)
    cost = t_ar + slope * np.arange(max_n + 1)
    rate = tokens / np.maximum(cost, 1e-12)
    best = 1 + int(np.argmax(rate[1:]))
    return Calibration(
        num_draft_tokens=best,
        tokens_per_step=tuple(float(x) for x in tokens),
        step_seconds=tuple(float(x) for x in cost),
        cost_ratio=float(slope / max(t_ar, 1e-12)),
    )


def _timed_steps(
    session_type, target, draft, prompts, steps: int, **kwargs
) -> tuple[float, np.ndarray]:
    """Seconds per step of ``steps`` compiled steps, and the emitted-length histogram."""
    session = session_type(target, draft, prompts, **kwargs)
    session.compile()
    it = session.steps()
    next(it)  # the first step also moves the state onto the device layout: not timed
    start = time.perf_counter()
    done = 1
    for _ in it:
        done += 1
        if done > steps:
            break
    seconds = (time.perf_counter() - start) / max(done - 1, 1)
    state = session._state
    hist = np.asarray(state.stats.emitted_hist).sum(0) if state is not None else None
    return seconds, hist


def calibrate(
    session_type, target, draft, prompts, *, key, max_n: int = 8, steps: int = 6, **kwargs
):
    """Measure and choose n (module docstring); ``kwargs`` are the call's other arguments of
    :func:`asps_jax.sample` (its ``max_new_tokens`` is replaced by what the runs need).
    ``session_type``: :class:`asps_jax.session.Session`, passed in by the session module (this
    module sits below it: no import back)."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("num_draft_tokens", "max_new_tokens")}
    method = kwargs.pop("method", registry.DEFAULT_METHOD)
    ar_kwargs = {k: v for k, v in kwargs.items() if k in _SAMPLE_ARGS}  # what "ar" takes
    budget = (steps + 1) * (max_n + 1)
    t_ar, _ = _timed_steps(
        session_type,
        target,
        None,
        prompts,
        steps,
        key=key,
        max_new_tokens=steps + 1,
        method="ar",
        **ar_kwargs,
    )
    t_max, hist = _timed_steps(
        session_type,
        target,
        draft,
        prompts,
        steps,
        key=key,
        max_new_tokens=budget,
        method=method,
        num_draft_tokens=max_n,
        **kwargs,
    )
    return choose(hist, t_ar, t_max)


# What the "ar" baseline takes of the call: the target's sampling arguments and the call's own.
_SAMPLE_ARGS = ("stop", "mesh", "prompt_lengths", "sampling") + tuple(
    name for name in Sampling.names() if name != "draft_temperature"
)
