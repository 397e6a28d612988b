"""``sampling=Sampling(...)`` beside the flat keywords of ``sample`` / ``stream`` / ``Session`` /
``Sampler``: the same call as the flat keywords (the same decoder and inputs, so the same draws),
a flat keyword replaces that field, a ``Sampler`` call's ``sampling=`` replaces the sampler's
sampling arguments, and anything but a ``Sampling`` is a one-line error. Also: each numeric
control is declared once (``processors.CONTROLS``), a field of ``Sampling`` and of
``SamplingParams`` alike.

The checks compare :func:`asps_jax.sampler.prepare`'s lowering: the same static decoder and the
same input arrays are the same compiled program on the same values, so the same draws (nothing is
compiled here).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from hf_checkpoints import write_peaked_pair

import asps_jax
from asps_jax import arguments, session
from asps_jax.controls import processors
from asps_jax.controls.processors import CONTROLS, SamplingParams
from asps_jax.controls.sampling import Sampling
from asps_jax.sampler import prepare

VOCAB = 12
PROMPTS = [[1, 5, 3], [4, 7, 9, 1, 0, 11, 6], [2], [8, 8, 2, 5]]
OPTIONS = dict(method="asps", num_draft_tokens=2, diagnostics=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_peaked_pair(tmp_path_factory.mktemp("ckpt"), VOCAB)[1:]


def _lowered(pair, **kwargs):
    """The decoder and the inputs' leaves (keys as their data) of one call."""
    call = prepare(*pair, PROMPTS, seed=[1, 2, 3, 4], max_new_tokens=6, **OPTIONS, **kwargs)
    leaves = [
        np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
                   else x)
        for x in jax.tree.leaves(call.inputs)
    ]  # fmt: skip
    return call.decoder, jax.tree.structure(call.inputs), leaves


def _assert_same_call(a, b):
    assert a[0] == b[0] and a[1] == b[1]
    assert len(a[2]) == len(b[2])
    for x, y in zip(a[2], b[2]):
        np.testing.assert_array_equal(x, y)


FLAT = dict(
    temperature=[1.0, 0.7, 0.0, 1.0],
    top_p=0.9,
    min_p=0.05,
    repetition_penalty=1.2,
    no_repeat_ngram_size=3,
    logit_bias={3: -1.5},
    eos_token_id=-1,
    min_tokens=2,
)


def test_sampling_value_is_the_flat_keywords(pair):
    """``sampling=Sampling(**flat)`` lowers to the very call the flat keywords give; a flat
    keyword beside it replaces that field (and only that one)."""
    flat = _lowered(pair, **FLAT)
    _assert_same_call(_lowered(pair, sampling=Sampling(**FLAT)), flat)
    hotter = {**FLAT, "temperature": 0.5}
    _assert_same_call(
        _lowered(pair, sampling=Sampling(**FLAT), temperature=0.5), _lowered(pair, **hotter)
    )
    _assert_same_call(_lowered(pair, sampling=Sampling()), _lowered(pair))


def test_sampler_call_rule():
    """A Sampler call's keyword replaces the sampler's; its ``sampling=`` replaces every sampling
    argument of the sampler's (flat or ``sampling=``), not its other options."""
    mine = Sampling(top_p=0.5)
    options = dict(sampling=Sampling(top_k=3), temperature=0.2, method="asps")
    assert arguments.call_options(options, dict(min_p=0.1)) == {**options, "min_p": 0.1}
    assert arguments.call_options(options, dict(sampling=mine)) == dict(
        method="asps", sampling=mine
    )
    assert arguments.call_options(options, dict(sampling=mine, temperature=0.9)) == dict(
        method="asps", sampling=mine, temperature=0.9
    )


@pytest.mark.parametrize("bad", ["top_p=0.9", dict(top_p=0.9), 0.9])
def test_sampling_must_be_a_sampling(pair, bad):
    with pytest.raises(ValueError, match="sampling must be an asps_jax.Sampling") as err:
        asps_jax.sample(*pair, PROMPTS, seed=0, max_new_tokens=6, sampling=bad)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="top_p must be in \\(0, 1\\], got 2"):
        asps_jax.sample(*pair, PROMPTS, seed=0, max_new_tokens=6, sampling=Sampling(), top_p=2)


def test_every_control_is_declared_once():
    """Each declaration names a field of Sampling (whose metadata it is) and of SamplingParams;
    SamplingParams.make's rows are its dtype, and its neutral value when not given."""
    sampling_fields = {f.name: f for f in dataclasses.fields(Sampling)}
    params_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert [c.name for c in Sampling.controls()] == [c.name for c in CONTROLS]
    made = SamplingParams.make(2, temperature=0.5)
    for c in CONTROLS:
        assert sampling_fields[c.name].metadata["control"] is c
        assert c.name in params_fields
        assert getattr(made, c.name).dtype == c.dtype and getattr(made, c.name).shape == (2,)
        # (temperature given 0.5; draft_temperature's neutral value is the temperature's)
        expected = 0.5 if "temperature" in (c.name, c.neutral) else c.neutral
        np.testing.assert_array_equal(getattr(made, c.name), expected)
    assert made.filters == () and not made.penalized and not made.limited
    with pytest.raises(TypeError, match="typo_p"):
        SamplingParams.make(2, typo_p=0.5)
    assert processors.CONTROL["top_p"].role == "filter"


def test_sampler_session_and_stream_take_a_sampling_value(pair):
    """A ``Sampler`` made with ``sampling=`` lowers a call that replaces one of its fields to the
    flat keywords' call (its options merged as its ``__call__`` merges them; nothing compiled); a
    ``Session`` takes ``sampling=``, and so does ``stream``, which checks its keywords as
    ``Session`` does."""
    sampler = asps_jax.Sampler(*pair, sampling=Sampling(**{**FLAT, "temperature": 0.3}), **OPTIONS)
    merged = arguments.call_options(sampler.options, dict(temperature=FLAT["temperature"]))
    merged = {k: v for k, v in merged.items() if k not in OPTIONS}
    _assert_same_call(_lowered(pair, **merged), _lowered(pair, **FLAT))
    asps_jax.Session(*pair, PROMPTS, seed=0, max_new_tokens=6, sampling=Sampling(**FLAT))
    assert "sampling" in session._KEYWORDS  # stream's and Session's keywords
