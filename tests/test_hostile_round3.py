"""Round 3 of hostile input to the Python API: numbers the device cannot hold (float32), bools
and strings given for numbers, static sizes past what can matter (n-grams longer than the
context, draft trees past the node bound), drafter options where no drafter runs. Each is a
one-line ``ValueError`` before anything is compiled, or (an n-gram that can never repeat) the
behaviour of the setting it equals."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hf_checkpoints import write_tiny_llama

import asps_jax
from asps_jax import penalties, sampler
from asps_jax.processors import SamplingParams

VOCAB = 12
PROMPT = [1, 5, 3]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("round3")
    write_tiny_llama(root / "target", seed=0, vocab_size=VOCAB)
    write_tiny_llama(root / "draft", seed=1, vocab_size=VOCAB)
    return asps_jax.load_model(str(root / "target")), asps_jax.load_model(str(root / "draft"))


def _prepare(pair, **kwargs):
    target, draft = pair
    args = dict(prompts=[PROMPT], key=jax.random.key(0), max_new_tokens=4, method="asps")
    args.update(kwargs)
    return sampler.prepare(target, args.pop("draft", draft), args.pop("prompts"), **args)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        # Finite in float64, inf in float32: 0 * inf = NaN turned every law into NaN, and the
        # error blamed the checkpoint.
        (dict(frequency_penalty=1e39), "frequency_penalty must be a finite number that float32"),
        (dict(presence_penalty=-1e39), "presence_penalty must be a finite number that float32"),
        (dict(presence_penalty=[0.0, 1e39], prompts=[PROMPT] * 2), "presence_penalty"),
        (
            dict(repetition_penalty=1e39),
            "repetition_penalty must be a finite number > 0 that float32",
        ),
        (
            dict(repetition_penalty=1e-50),
            "repetition_penalty must be a finite number > 0 that float32",
        ),
        (dict(top_p=1e-50), "top_p must be in"),
        (dict(logit_bias={2: 1e39}), "the bias of token 2 must be a finite number that float32"),
        (dict(logit_bias={2: -1e39}), "the bias of token 2 must be a finite number that float32"),
        # Bools and strings were turned into numbers by NumPy before the checks.
        (dict(repetition_penalty=True), "repetition_penalty must be a number"),
        (dict(min_p=True), "min_p must be a number"),
        (dict(no_repeat_ngram_size="3"), "no_repeat_ngram_size must be a number"),
        (dict(temperature="0.7"), "temperature must be a number"),
        (dict(top_k=[True]), "top_k must be a number"),
        (dict(logit_bias={2: True}), "the bias of token 2"),
        (dict(logit_bias={2: "1.5"}), "the bias of token 2"),
        # int(nan) raised "cannot convert float NaN to integer", naming nothing.
        (dict(no_repeat_ngram_size=float("nan")), "no_repeat_ngram_size must be an integer"),
        (dict(top_k=float("nan")), "top_k must be an integer"),
        # Banning the whole vocabulary gave "the model produced NaN" after compiling.
        (dict(logit_bias={i: -np.inf for i in range(VOCAB)}), "bans every token"),
        # A lookup n-gram longer than the context can never match: it traced a loop of 10^9.
        (dict(draft="lookup", method="sps", lookup_ngram=10**9), "longer than the model context"),
        # Drafter options where no drafter runs were ignored, or blamed "a draft model".
        (dict(method="ar", draft=None, lookup_ngram=2), "method 'ar' uses no draft"),
        (dict(method="ar", draft=None, draft_stop="confidence:0.5"), "method 'ar' uses no draft"),
        (dict(method="ar", draft="lookup", lookup_max=2), "method 'ar' uses no draft"),
        # Fits the memory of a tiny model, then compiled for minutes.
        (dict(method="tv", tree=(5000,)), "the draft tree has 5000 nodes"),
        (dict(method="tv", tree=(32, 32)), "the draft tree has 1056 nodes"),
        (dict(method="is", num_drafts=300, num_draft_tokens=4), "lower num_drafts"),
    ],
)
def test_round3_bad_input_is_a_one_line_error(pair, kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        _prepare(pair, **kwargs)
    assert "\n" not in str(info.value)


def test_the_largest_float32_values_are_accepted(pair):
    """The bounds are float32's, not tighter."""
    big = 3.4e38
    _prepare(pair, frequency_penalty=big, presence_penalty=-big, logit_bias={2: big, 3: -np.inf})
    _prepare(pair, method="tv", tree=(32, 31))  # 1024 nodes: the bound itself


def test_an_ngram_longer_than_the_context_bans_nothing(pair):
    """``no_repeat_ngram_size`` past the context can never repeat: it is the setting 0 (no
    n-gram code in the program), where 10^9 used to trace a loop to 2^30."""
    target, _ = pair
    context = target.config.max_position_embeddings
    huge = _prepare(pair, no_repeat_ngram_size=[10**9])
    assert huge.inputs.sampling.ngram_window == 0
    assert np.asarray(huge.inputs.sampling.no_repeat_ngram_size).tolist() == [0]
    within = _prepare(pair, no_repeat_ngram_size=context)
    assert within.inputs.sampling.ngram_window >= context


def test_penalties_past_float32_stay_a_law():
    """A bias near the float32 maximum plus a reward times a count used to reach +inf (no law:
    the row failed as if the model gave NaN); it is clamped to the largest float32, and a banned
    token stays banned whatever the reward (-inf + inf was NaN)."""
    sampling = SamplingParams.make(
        1,
        frequency_penalty=-3e38,
        logit_bias=np.array([[3e38, 3e38, -np.inf, 0.0]], np.float32),
    )
    history = penalties.History.init(
        np.array([[0]], np.int32), np.array([0], np.int32), vocab=4, extra=4
    )
    history = history.append(np.array([[1, 2, 2, 3]], np.int32), np.array([4], np.int32))
    logits = np.array([[[1.0, 2.0, 3.0, 0.5]]], np.float32)
    no_path = np.zeros((1, 1, 0), np.int32)
    out = np.asarray(penalties.apply_controls(sampling, history, logits, no_path, [0]))[0, 0]
    f32_max = np.finfo(np.float32).max
    assert out[1] == f32_max  # 3e38 + 2 + 3e38: clamped, not inf
    assert out[2] == -np.inf  # banned; its count times the reward overflows to -inf
    assert np.isfinite(out[0]) and np.isfinite(out[3])
    law, ok = penalties.process(sampling, history, logits, no_path, [0])
    probs = np.exp(np.asarray(law, np.float64))[0, 0]
    assert bool(np.asarray(ok)[0, 0]) and np.allclose(probs, [0.0, 1.0, 0.0, 0.0])


def test_self_draft_of_a_one_layer_target_says_it_cannot(tmp_path):
    write_tiny_llama(tmp_path / "one", seed=0, vocab_size=VOCAB, num_hidden_layers=1)
    target = asps_jax.load_model(str(tmp_path / "one"))
    with pytest.raises(ValueError, match="the target has 1; give a draft model") as info:
        sampler.prepare(target, "self:1", [PROMPT], key=jax.random.key(0), max_new_tokens=2)
    assert "e.g. 'self:1'" not in str(info.value)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(vocab_size=True), "vocab_size must be an integer >= 1, got True"),
        (dict(vocab_size=0), "vocab_size must be an integer >= 1"),
        (dict(head_dim=4.0), "head_dim must be an integer >= 1"),
        (dict(max_position_embeddings="64"), "max_position_embeddings must be an integer"),
        (dict(vocab_size=VOCAB + 4, tokenizer=["t"] * VOCAB), "exceeds the tokenizer's 12"),
    ],
)
def test_own_model_sizes_are_checked(kwargs, match):
    from asps_jax.models.own import own_model

    args = dict(
        vocab_size=VOCAB,
        num_hidden_layers=1,
        num_key_value_heads=1,
        head_dim=4,
        max_position_embeddings=64,
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match) as info:
        own_model(lambda *a: None, {"w": np.zeros(2, np.float32)}, **args)
    assert "\n" not in str(info.value)
