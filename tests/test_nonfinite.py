"""Non-finite laws (issue 15, defects 1 and 2): a row whose target or draft law goes NaN stops at
the token that law was to give, at every temperature and for every method, and
``NonFiniteLogitsError`` names the rows and positions and keeps exactly the tokens before.

The reference is the same checkpoint without the NaN: a target whose embedding of token ``X`` is
NaN has the clean target's logits until ``X`` is in the context, so every row must equal the
clean run's row cut just after its first ``X`` (and fail there), or equal it whole.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from hf_checkpoints import write_tiny_llama

import asps_jax
from asps_jax.sampler import NonFiniteLogitsError
from asps_jax.verify.registry import REGISTRY

VOCAB = 12
MAX_NEW = 6
PROMPT = [2, 4]
ROWS = 24


def _num_drafts(method):
    return 1 if method == "ar" or REGISTRY[method].kind == "chain" else 2


# AR and one method of each registry kind (K = 1 for one chain, else 2); the tree methods run on
# the K-chain tree.
METHODS = [(m, _num_drafts(m)) for m in ("ar", "asps", "specinfer")]
TREE = [(m, _num_drafts(m)) for m in ("tv_wr", "is_bv")]


def _llama(path, seed, **kwargs):
    return write_tiny_llama(path, seed=seed, vocab_size=VOCAB, initializer_range=0.4, **kwargs)


def _greedy_reference(hf_model, steps):
    """transformers' greedy continuation of PROMPT (the independent reference)."""
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT) :]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("nonfinite")
    hf_target = _llama(root / "target", 0)
    _llama(root / "draft", 1, noise_from=hf_target)
    greedy = _greedy_reference(hf_target, MAX_NEW)
    # The NaN token: a greedy token, not the first nor the last, that the context has not seen
    # yet (and not 0, the token the old greedy bug emitted).
    j = next(
        i for i in range(1, MAX_NEW - 1) if greedy[i] not in PROMPT + greedy[:i] and greedy[i] != 0
    )
    nan_token = greedy[j]
    _llama(root / "nan_token", 0, nan_token=nan_token)
    _llama(root / "nan_head", 0, nan=True)
    _llama(root / "nan_draft", 1, nan=True)
    load = {name: asps_jax.load_model(str(root / name)) for name in
            ("target", "draft", "nan_token", "nan_head", "nan_draft")}  # fmt: skip
    return load, nan_token, greedy, j


def _run(target, draft, method, k, temperature):
    return asps_jax.sample(
        target,
        draft if method != "ar" else None,
        [PROMPT] * ROWS,
        key=jax.random.split(jax.random.key(7), ROWS),
        max_new_tokens=MAX_NEW,
        method=method,
        num_draft_tokens=2,
        num_drafts=k,
        temperature=temperature,
        eos_token_id=-1,
    )


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method,k", METHODS + TREE)
def test_nan_after_a_token_stops_each_row_there(models, method, k, temperature):
    m, nan_token, greedy, j = models
    with pytest.raises(NonFiniteLogitsError) as info:
        _run(m["nan_token"], m["draft"], method, k, temperature)
    err = info.value
    out_tokens, out_lengths = np.asarray(err.output.tokens), np.asarray(err.output.lengths)
    # AR draws each token alone and greedy draws nothing: until X both runs make the same draws,
    # so the clean run is the reference. ASpS (and the multi-draft ASpS tail) weighs a whole
    # chain, and a clean chain that went on past X is verified with more laws than the NaN run's
    # chain cut at X: the same bits may decide differently, and the row itself is the reference
    # (it must stop just after its first X, or run to the end without one).
    coupled = method == "ar" or temperature == 0.0
    ref_tokens = out_tokens
    if coupled:
        ref_tokens = np.asarray(_run(m["target"], m["draft"], method, k, temperature).tokens)
    want_rows, want_pos = [], []
    for b in range(ROWS):
        hits = np.flatnonzero(ref_tokens[b] == nan_token)
        if hits.size and hits[0] + 1 < MAX_NEW:  # X emitted with room for one more token
            cut = int(hits[0]) + 1
            want_rows.append(b)
            want_pos.append(cut)
        else:
            cut = MAX_NEW
        assert out_lengths[b] == cut, (b, ref_tokens[b], out_tokens[b])
        np.testing.assert_array_equal(out_tokens[b, :cut], ref_tokens[b, :cut])
        assert np.all(out_tokens[b, cut:] == -1)
    assert err.rows == want_rows and err.positions == want_pos
    assert np.asarray(err.output.stats["failed_at"]).tolist() == [
        want_pos[want_rows.index(b)] if b in want_rows else -1 for b in range(ROWS)
    ]
    assert str(want_rows[:3])[1:-1] in str(err)
    if temperature == 0.0:  # greedy: the clean reference is transformers' own continuation
        assert want_rows == list(range(ROWS)) and want_pos == [j + 1] * ROWS
        np.testing.assert_array_equal(out_tokens[:, : j + 1], [greedy[: j + 1]] * ROWS)
    else:
        assert 0 < len(want_rows) < ROWS  # some rows met X, some never did


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method,k", METHODS + TREE)
def test_nan_target_stops_every_row_before_any_token(models, method, k, temperature):
    m = models[0]
    with pytest.raises(NonFiniteLogitsError) as info:
        _run(m["nan_head"], m["draft"], method, k, temperature)
    err = info.value
    assert err.rows == list(range(ROWS)) and err.positions == [0] * ROWS
    assert np.asarray(err.output.lengths).tolist() == [0] * ROWS
    assert np.all(np.asarray(err.output.tokens) == -1)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method,k", METHODS[1:] + TREE)
def test_nan_draft_stops_every_row_before_any_token(models, method, k, temperature):
    m = models[0]
    with pytest.raises(NonFiniteLogitsError) as info:
        _run(m["target"], m["nan_draft"], method, k, temperature)
    err = info.value
    assert err.rows == list(range(ROWS)) and err.positions == [0] * ROWS
    assert np.all(np.asarray(err.output.tokens) == -1)


@pytest.mark.slow
def test_processors_flag_unusable_laws():
    from asps_jax.controls.processors import logits_ok, process_logits

    nan, inf = float("nan"), float("inf")
    rows = np.array([[0.0, 1.0], [nan, 1.0], [inf, 1.0], [-inf, 1.0], [-inf, -inf]], np.float32)
    assert np.asarray(logits_ok(rows)).tolist() == [True, False, False, True, False]
    # Greedy of a row without a finite logit is no law at all (it used to be a point mass on 0).
    greedy = np.asarray(process_logits(np.full((2, 3), nan, np.float32), temperature=0.0))
    assert np.all(greedy == -np.inf)


@pytest.mark.slow
def test_nan_draft_with_a_confidence_stop_still_raises(models):
    """A NaN draft law is no confident law: the confidence stop cut every chain to nothing and
    drafting went silently off; the shared check (Proposal.finite_BKD) stops the rows (issue 66)."""
    m = models[0]
    with pytest.raises(NonFiniteLogitsError) as info:
        asps_jax.sample(m["target"], m["nan_draft"], [PROMPT] * 2, seed=0, max_new_tokens=3,
                        num_draft_tokens=2, draft_stop="confidence:0.5")  # fmt: skip
    assert info.value.rows == [0, 1] and info.value.positions == [0, 0]
