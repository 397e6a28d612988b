"""``n`` samples per prompt and per-prompt ``seed`` (``sample`` / ``Session`` / ``stream``).

The contract: row ``p * n + i`` is prompt p's sample i; it draws with ``fold_in(k_p, i)``, where
``k_p`` is ``jax.random.key(seed_p)`` (or ``fold_in(key, p)`` of one call key), so a prompt's
samples depend only on its seed and their index, not on the other prompts or on ``batch_size``.
The law tests compare with transformers' exact law of a tiny random Llama (a speculative method
with a separate draft): the first two tokens of each sample, and the joint law of two samples of
one prompt (independent draws: the product of the marginals).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch
from hf_checkpoints import write_tiny_llama
from scipy import stats

import asps_jax
from asps_jax import decode, sampler

VOCAB = 12
PROMPT = [1, 5, 3, 7, 2, 1, 5]
OTHER = [4, 4, 9]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("samples")
    hf = write_tiny_llama(root / "target", seed=0, vocab_size=VOCAB, initializer_range=0.4)
    noisy = dict(noise_from=hf, vocab_size=VOCAB, initializer_range=0.4)
    write_tiny_llama(root / "draft", seed=1, **noisy)
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([PROMPT])).logits[0, -1].double(), -1).numpy()
        second = hf(torch.tensor([PROMPT + [x] for x in range(VOCAB)])).logits[:, -1]
        p2 = torch.softmax(second.double(), -1).numpy()
    target = asps_jax.load_model(str(root / "target"))
    draft = asps_jax.load_model(str(root / "draft"))
    return target, draft, p1, p1[:, None] * p2


def _pvalue(pairs, law):
    counts = np.zeros((VOCAB, VOCAB))
    np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
    expected, observed = law.reshape(-1) * counts.sum(), counts.reshape(-1)
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def _sample(tiny, prompts, **kwargs):
    target, draft, *_ = tiny
    kwargs = {"max_new_tokens": 4, "eos_token_id": -1, "num_draft_tokens": 2, **kwargs}
    out = asps_jax.sample(target, draft, prompts, **kwargs)
    return np.asarray(out.tokens)


@pytest.mark.slow
def test_n_samples_keep_the_law_and_are_independent(tiny):
    """3,000 samples of one prompt (n = 3000): the first two tokens have the target's law; 1,500
    prompts with n = 2: the first tokens of a prompt's two samples are independent (their joint
    law is the product of the marginals)."""
    _, _, p1, law = tiny
    tokens = _sample(tiny, [PROMPT], n=3000, seed=11, method="asps")
    assert tokens.shape == (3000, 4)
    pvalue = _pvalue(tokens[:, :2], law)
    assert pvalue > 1e-3, f"first two tokens: chi-square p-value {pvalue:.2e}"
    tokens = _sample(tiny, [PROMPT] * 1500, n=2, seed=12, method="is", num_drafts=2)
    firsts = tokens[:, 0].reshape(1500, 2)  # row p * 2 + i: prompt p's sample i
    pvalue = _pvalue(firsts, p1[:, None] * p1[None, :])
    assert pvalue > 1e-3, f"two samples of a prompt: chi-square p-value {pvalue:.2e}"


@pytest.mark.slow
def test_a_prompts_samples_depend_only_on_its_seed_and_index(tiny):
    both = _sample(tiny, [OTHER, PROMPT], n=4, seed=[5, 7], temperature=[0.7, 1.3])
    alone = _sample(tiny, [PROMPT], n=4, seed=[7], temperature=[1.3])
    np.testing.assert_array_equal(both[4:], alone)
    more = _sample(tiny, [PROMPT], n=6, seed=[7], temperature=1.3)
    np.testing.assert_array_equal(more[:4], alone)  # more samples leave the first ones as they were
    assert len({tuple(row) for row in more}) > 1  # the samples differ from each other
    # One int seed is jax.random.key(seed); n = 1 is the call without n.
    np.testing.assert_array_equal(
        _sample(tiny, [PROMPT, OTHER], seed=3),
        _sample(tiny, [PROMPT, OTHER], key=jax.random.key(3)),
    )
    # One key for the call: prompt p's key is fold_in(key, p), as without n.
    key = jax.random.key(9)
    got = _sample(tiny, [OTHER, PROMPT], n=3, key=key)
    own = _sample(tiny, [PROMPT], n=3, key=jax.random.fold_in(key, 1)[None])
    np.testing.assert_array_equal(got[3:], own)


@pytest.mark.slow
def test_n_with_continuous_batching_and_stream(tiny):
    """Through the slots, and step by step: the same rows, prompt-major."""
    target, draft, *_ = tiny
    kwargs = dict(max_new_tokens=4, eos_token_id=-1, num_draft_tokens=2, n=3, seed=[2, 8])
    slots = _sample(tiny, [PROMPT, OTHER], batch_size=4, **kwargs)
    assert slots.shape == (6, 4)
    again = _sample(tiny, [PROMPT, OTHER], batch_size=2, **kwargs)
    np.testing.assert_array_equal(slots, again)
    it = asps_jax.stream(target, draft, [PROMPT, OTHER], **kwargs)
    rows = [[] for _ in range(6)]
    try:
        while True:
            for b, new in enumerate(next(it)):
                rows[b] += new
    except StopIteration as done:
        out = done.value
    assert np.asarray(out.tokens).shape == (6, 4) and [len(r) for r in rows] == [4] * 6


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(key=jax.random.key(0), seed=1), "key= .* or seed= .*: both were given"),
        (dict(), "key= .* or seed= .*: neither was given"),
        (dict(seed=1, n=0), "n must be an integer >= 1"),
        (dict(seed=1, n=True), "n must be an integer >= 1"),
        (dict(seed=[1, 2, 3], n=2), r"seed: give one seed for the call or one per prompt \(2\)"),
        (dict(seed=-1), "seed must be an integer >= 0"),
        (dict(seed=2**64), r"seed must be an integer in \[0, 2\*\*63\)"),
        (dict(seed=1, n=2, temperature=[1.0]), r"temperature: .* one per prompt \(2\), got 1"),
        (dict(seed=1, n=2, max_new_tokens=[4, 4, 4]), r"max_new_tokens: .* \(2\), got 3"),
    ],
)
def test_bad_n_and_seed_are_one_line_errors(tiny, kwargs, message):
    target, draft, *_ = tiny
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message) as err:
        asps_jax.sample(target, draft, [PROMPT, OTHER], **kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_one_target_prefill_per_prompt(tiny):
    """With n samples per prompt the target's prefill forward runs once per prompt: its FLOPs
    are about 1/n of a prefill of every row (XLA's cost analysis of the compiled prefill), and
    the rows are exactly those of a call that prefills every row (the n rows given as prompts
    with their keys, ``fold_in(key(seed_p), i)``)."""
    target, draft, *_ = tiny
    n, seeds = 4, [5, 7]
    call = dict(method="ar", max_new_tokens=4, eos_token_id=-1)
    prepared = sampler.prepare(target, None, [PROMPT, OTHER], n=n, seed=seeds, **call)
    assert prepared.decoder.samples == n
    flops = []
    for dec in (prepared.decoder, dataclasses.replace(prepared.decoder, samples=1)):
        lowered = decode.prefill.lower(dec, **prepared.inputs.prefill_kwargs())
        flops.append(lowered.compile().cost_analysis()["flops"])
    assert flops[0] <= flops[1] / (n - 1), flops
    got = _sample(tiny, [PROMPT, OTHER], n=n, seed=seeds)
    keys = [jax.random.fold_in(jax.random.key(s), i) for s in seeds for i in range(n)]
    rows = [PROMPT] * n + [OTHER] * n
    np.testing.assert_array_equal(got, _sample(tiny, rows, key=jax.numpy.stack(keys)))
