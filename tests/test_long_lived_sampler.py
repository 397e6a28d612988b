"""``asps_jax.Sampler``: the fixed options once, calls equal to ``sample``, weights swapped by
``update_params`` without a recompile (counted through ``jax.monitoring``, not timed), and the
drafters derived from the target following its new weights.

The shapes are test_logprobs.py's (vocabulary 12, n = 2, M = 6, batch bucket 8), so the compiled
loops are shared with it in one pytest run.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_checkpoints import write_peaked_pair

import asps_jax

VOCAB = 12
PROMPTS = [[1, 5, 3], [4, 7, 9, 1, 0, 11, 6], [2], [8, 8, 2, 5]]
OPTIONS = dict(method="asps", num_draft_tokens=2, eos_token_id=-1, diagnostics=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_peaked_pair(tmp_path_factory.mktemp("ckpt"), VOCAB)[1:]


def _perturbed(params, seed: int):
    """New weights of the same layout: each leaf plus 0.3 times Gaussian noise of its scale."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [
        (x + 0.3 * jnp.std(x) * jax.random.normal(k, x.shape)).astype(x.dtype)
        for x, k in zip(leaves, keys)
    ]
    return jax.tree.unflatten(tree, new)


def _same(a, b):
    for field in ("tokens", "lengths", "logprobs", "raw_logprobs"):
        np.testing.assert_array_equal(np.asarray(getattr(a, field)), np.asarray(getattr(b, field)))


@pytest.mark.slow
@pytest.mark.parametrize("draft_kind", ["model", "self:1"])
def test_calls_equal_sample_and_new_weights_never_recompile(pair, draft_kind):
    """Three weight versions through one sampler: each call equals ``sample`` on a model holding
    those weights (a ``self:1`` draft's layers follow the target's), the outputs change with the
    weights, and after the first call no XLA program is built."""
    target, draft_model = pair
    draft = draft_model if draft_kind == "model" else "self:1"
    sampler = asps_jax.Sampler(target, draft, return_logprobs=True, raw_logprobs=True, **OPTIONS)
    call = dict(max_new_tokens=6, temperature=[1.0, 0.7, 0.0, 1.0], seed=[3, 4, 5, 6], n=2)
    outputs = [sampler(PROMPTS, **call)]
    first = sampler.compiles
    assert first > 0
    for version in (1, 2):
        new_target = _perturbed(target.params, version)
        new_draft = _perturbed(draft_model.params, 10 + version) if draft_kind == "model" else None
        sampler.update_params(new_target, new_draft)
        out = sampler(PROMPTS, **call)
        reference = asps_jax.sample(
            dataclasses.replace(target, params=new_target),
            dataclasses.replace(draft_model, params=new_draft) if new_draft else draft,
            PROMPTS,
            return_logprobs=True,
            raw_logprobs=True,
            **OPTIONS,
            **call,
        )
        _same(out, reference)
        assert not np.array_equal(np.asarray(out.raw_logprobs), outputs[-1].raw_logprobs)
        outputs.append(out)
    assert sampler.compiles == first  # two weight swaps and two calls: nothing built
    # Another temperature, other seeds and a budget in the same bucket: values, no recompile.
    sampler(PROMPTS, **{**call, "temperature": 0.9, "seed": [7, 8, 9, 1], "max_new_tokens": 5})
    assert sampler.compiles == first


@pytest.mark.slow
def test_a_call_overrides_a_fixed_option_and_n_keeps_each_prompts_samples(pair):
    target, draft = pair
    sampler = asps_jax.Sampler(target, draft, temperature=0.0, **OPTIONS)
    greedy = sampler(PROMPTS, max_new_tokens=6, seed=0)
    hot = sampler(PROMPTS[:2], max_new_tokens=6, seed=[11, 12], n=3, temperature=1.0)
    assert np.asarray(hot.tokens).shape == (6, 6)
    # Prompt 1's three samples depend only on its seed: the same alone as beside prompt 0.
    alone = sampler(PROMPTS[1:2], max_new_tokens=6, seed=[12], n=3, temperature=1.0)
    np.testing.assert_array_equal(np.asarray(hot.tokens)[3:], np.asarray(alone.tokens))
    expected = asps_jax.sample(target, draft, PROMPTS, max_new_tokens=6, key=jax.random.key(0),
                               temperature=0.0, **OPTIONS)  # fmt: skip
    _same(greedy, expected)


def test_bad_input_is_a_one_line_error_and_keeps_the_weights(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="seed belong to each call"):
        asps_jax.Sampler(target, draft, seed=0, **OPTIONS)
    with pytest.raises(ValueError, match="method"):
        asps_jax.Sampler(target, draft, method="nope")
    sampler = asps_jax.Sampler(target, "self:1", **OPTIONS)
    params = target.params
    wrong = jax.tree.map(lambda x: x[..., :1] if x.ndim == 2 else x, params)
    with pytest.raises(ValueError, match=r"update_params: target_params\S* is float32\[") as err:
        sampler.update_params(wrong)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="not laid out like the model's parameters"):
        sampler.update_params({"embed": params[next(iter(params))]})
    with pytest.raises(ValueError, match="has no weights of its own"):
        sampler.update_params(params, params)
    assert sampler.target.params is params  # nothing replaced by a refused update
