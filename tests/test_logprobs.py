"""``sample(..., return_logprobs=True)``: the target's log-probability of every emitted token under
the processed law, checked against transformers (PyTorch) on tiny random checkpoints.

The reference feeds the emitted tokens back through the HF model and applies transformers' own
warpers (temperature, top-k, top-p) before its log-softmax. Shapes match test_decode.py (n = 2,
M = 6, vocabulary 12, batch bucket 8), so in one pytest run the compiled loops are shared.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from hf_checkpoints import write_peaked_pair

import asps_jax
from asps_jax.sampler import METHODS
from asps_jax.verify.registry import REGISTRY

VOCAB = 12
N_DRAFT = 2
MAX_NEW = 6
PROMPTS = [[1, 5, 3], [4, 7, 9, 1, 0, 11, 6], [2], [8, 8, 2, 5]]
# One row per setting, all in one call (sampling parameters are per-row arrays): plain sampling,
# all three processors, greedy, and a draft hotter than the target.
TEMPERATURE = [1.0, 0.8, 0.0, 1.3]
TOP_K = [0, 8, 0, 3]
TOP_P = [1.0, 0.9, 1.0, 0.7]
DRAFT_TEMPERATURE = [1.0, 1.3, 0.0, 0.6]
METHOD_OPTIONS = {"optimal": dict(grad_steps=4), "is": dict(fit_steps=5)}  # as test_decode.py


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_peaked_pair(tmp_path_factory.mktemp("ckpt"), VOCAB)


def _sample(target, draft, method, **kw):
    kw.update(METHOD_OPTIONS.get(method, {}))
    kw.setdefault("eos_token_id", -1)
    kw.setdefault("diagnostics", True)  # as test_decode.py: the same compiled loops
    return asps_jax.sample(
        target,
        draft if method != "ar" else None,
        PROMPTS,
        key=kw.pop("key", jax.random.key(5)),
        method=method,
        num_draft_tokens=N_DRAFT,
        num_drafts=1 if method == "ar" or REGISTRY[method].kind == "chain" else 2,
        max_new_tokens=MAX_NEW,
        temperature=TEMPERATURE,
        top_k=TOP_K,
        top_p=TOP_P,
        draft_temperature=DRAFT_TEMPERATURE,
        **kw,
    )


def _hf_logprobs(hf_model, prompt, tokens, temperature, top_k, top_p) -> np.ndarray:
    """transformers' log-softmax of the processed logits at each emitted token (float64)."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tokens])).logits[0].double()
    scores = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    if temperature == 0.0:  # the greedy law: a point mass on the argmax
        greedy = torch.full_like(scores, -torch.inf)
        greedy[torch.arange(len(tokens)), scores.argmax(-1)] = 0.0
        scores = greedy
    else:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1.0:
            scores = TopPLogitsWarper(top_p)(None, scores)
    logprobs = torch.log_softmax(scores, -1)
    return logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].numpy()


@pytest.mark.slow
# specinfer_wor emits through specinfer's code (its roots are only drawn differently): left out
# to save its compile.
@pytest.mark.parametrize("method", [m for m in METHODS if m != "specinfer_wor"])
def test_logprobs_equal_transformers_log_softmax_of_the_processed_logits(pair, method):
    hf_target, target, draft = pair
    out = _sample(target, draft, method, return_logprobs=True)
    logprobs = np.asarray(out.logprobs)
    lengths = np.asarray(out.lengths)
    assert logprobs.shape == (len(PROMPTS), MAX_NEW) and logprobs.dtype == np.float32
    assert np.all(lengths == MAX_NEW)
    assert not np.any(np.isnan(logprobs)) and np.all(np.isfinite(logprobs))
    for b, prompt in enumerate(PROMPTS):
        tokens = np.asarray(out.tokens[b, : lengths[b]]).tolist()
        expected = _hf_logprobs(hf_target, prompt, tokens, TEMPERATURE[b], TOP_K[b], TOP_P[b])
        np.testing.assert_allclose(logprobs[b], expected, atol=1e-4, err_msg=f"row {b}")
    assert np.all(logprobs[2] == 0.0)  # greedy row: the emitted token has probability 1


@pytest.mark.slow
def test_logprobs_pad_with_zero_after_an_eos_and_match_the_stream(pair):
    hf_target, target, draft = pair
    free = _sample(target, draft, "asps", return_logprobs=True)
    eos = int(free.tokens[0, 2])  # row 0 then stops by its third token (EOS only truncates)
    out = _sample(target, draft, "asps", return_logprobs=True, eos_token_id=eos)
    gen = asps_jax.stream(
        target,
        draft,
        PROMPTS,
        key=jax.random.key(5),
        method="asps",
        num_draft_tokens=N_DRAFT,
        max_new_tokens=MAX_NEW,
        temperature=TEMPERATURE,
        top_k=TOP_K,
        top_p=TOP_P,
        draft_temperature=DRAFT_TEMPERATURE,
        eos_token_id=eos,
        return_logprobs=True,
    )
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            streamed = stop.value
            break
    np.testing.assert_array_equal(np.asarray(streamed.tokens), np.asarray(out.tokens))
    np.testing.assert_array_equal(np.asarray(streamed.logprobs), np.asarray(out.logprobs))
    lengths = np.asarray(out.lengths)
    logprobs = np.asarray(out.logprobs)
    assert lengths[0] <= 3
    for b, prompt in enumerate(PROMPTS):
        assert np.all(logprobs[b, lengths[b] :] == 0.0)
        np.testing.assert_array_equal(logprobs[b, : lengths[b]], free.logprobs[b, : lengths[b]])
        tokens = np.asarray(out.tokens[b, : lengths[b]]).tolist()
        expected = _hf_logprobs(hf_target, prompt, tokens, TEMPERATURE[b], TOP_K[b], TOP_P[b])
        np.testing.assert_allclose(logprobs[b, : lengths[b]], expected, atol=1e-4)


@pytest.mark.slow
def test_logprobs_are_none_unless_requested(pair):
    _, target, draft = pair
    assert _sample(target, draft, "sps").logprobs is None


def _hf_raw_logprobs(hf_model, prompt, tokens) -> np.ndarray:
    """transformers' log-softmax of the raw logits (temperature 1, nothing applied)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tokens])).logits[0].double()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)], -1)
    return logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].numpy()


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, extra",
    [("ar", {}), ("asps", dict(batch_size=2)), ("tv", dict(repetition_penalty=1.3))],
)
def test_raw_logprobs_are_the_unprocessed_target_law_of_each_emitted_token(pair, method, extra):
    """``raw_logprobs=True``: the target's log-softmax of its raw logits at each emitted token,
    whatever law the token was drawn from (temperature, top-k / top-p, greedy, a penalty), against
    transformers; through the slots too. The processed log-probs are unchanged by it."""
    hf_target, target, draft = pair
    out = _sample(target, draft, method, return_logprobs=True, raw_logprobs=True, **extra)
    raw, lengths = np.asarray(out.raw_logprobs), np.asarray(out.lengths)
    assert raw.shape == (len(PROMPTS), MAX_NEW) and raw.dtype == np.float32
    for b, prompt in enumerate(PROMPTS):
        tokens = np.asarray(out.tokens[b, : lengths[b]]).tolist()
        expected = _hf_raw_logprobs(hf_target, prompt, tokens)
        np.testing.assert_allclose(raw[b, : lengths[b]], expected, atol=1e-4, err_msg=f"row {b}")
        assert np.all(raw[b, lengths[b] :] == 0.0)
    assert np.all(raw[2] < 0.0)  # the greedy row: its processed log-probs are 0.0, these are not
    if not extra.get("repetition_penalty"):
        for b, prompt in enumerate(PROMPTS):
            tokens = np.asarray(out.tokens[b, : lengths[b]]).tolist()
            expected = _hf_logprobs(hf_target, prompt, tokens, TEMPERATURE[b], TOP_K[b], TOP_P[b])
            np.testing.assert_allclose(out.logprobs[b, : lengths[b]], expected, atol=1e-4)


def test_raw_logprobs_need_return_logprobs_and_are_none_unless_requested(pair):
    _, target, draft = pair
    with pytest.raises(ValueError, match="raw_logprobs needs return_logprobs=True"):
        _sample(target, draft, "sps", raw_logprobs=True)
    with pytest.raises(ValueError, match="raw_logprobs must be True or False"):
        _sample(target, draft, "sps", return_logprobs=True, raw_logprobs="yes")
    assert _sample(target, draft, "sps", return_logprobs=True).raw_logprobs is None
