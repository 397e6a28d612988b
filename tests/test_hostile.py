"""Hostile but fair input to ``asps_jax.sample``: every bad value is a one-line ``ValueError``
raised before anything is compiled or allocated, and out-of-range values that have a meaning keep
it (``top_k`` beyond the vocabulary keeps every token)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hf_checkpoints import write_tiny_llama

import asps_jax
from asps_jax import sampler
from asps_jax.verify import registry

VOCAB = 12
PROMPT = [1, 5, 3]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
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
        # A negative length used to slice the row silently from the end.
        (dict(prompts=np.array([[1, 2, 3]]), prompt_lengths=[-1]), "prompt_lengths must lie"),
        (dict(prompts=np.array([[1, 2, 3]]), prompt_lengths=[4]), "prompt_lengths must lie"),
        # Text used to fail inside int() with "invalid literal".
        (dict(prompts="KING HENRY:"), "token ids, not text"),
        (dict(prompts=["KING HENRY:"]), "token ids, not text"),
        (dict(prompts=[[1.5, 2]]), "non-integer"),
        # 1e308 passed the finite check and overflowed to inf in float32.
        (dict(temperature=1e308), "temperature"),
        (dict(draft_temperature=1e300), "draft_temperature"),
        (dict(top_k=2.5), "top_k"),
        (dict(eos_token_id=VOCAB), "eos_token_id"),
        (dict(eos_token_id=[2, VOCAB + 5]), "eos_token_id"),
        (dict(method="ar", num_drafts=2), "num_drafts must be 1"),
        # Multi-draft options are checked by the registry before anything is traced.
        (dict(method="is", num_drafts=2, levels=0), "levels must be an int >= 1"),
        (dict(method="specinfer", num_drafts=2, tail="block"), "tail must be one of"),
        (dict(method="is_bv", num_drafts=2, beta=1.0), "unknown option"),
        (dict(num_draft_tokens=64), "num_draft_tokens=64 does not fit"),
        # Used to be accepted and fail ~25 s later with a 596 GiB allocation traceback.
        (dict(method="specinfer", num_drafts=2**20, num_draft_tokens=60), "--num-drafts"),
        (dict(prompts=[PROMPT] * 2**21, max_new_tokens=50), "--batch-size"),
        # A branching draft tree: only for the tree methods, and its own sizes.
        (dict(tree=(2, 2)), "method 'asps' verifies chains"),
        (dict(method="tv", tree=(2, 0)), "every width >= 1"),
        (dict(method="tv", tree=()), "every width >= 1"),
        (dict(method="tv", tree="22"), "every width >= 1"),
        (dict(method="tv_wr", tree=(2, 2), num_drafts=2), "num_drafts=2 contradicts"),
        (dict(method="is_bv", tree=(2, 2), num_draft_tokens=3), "num_draft_tokens=3 contradicts"),
        (dict(method="is_bv", tree=(2, 2), rule="lp"), "rule must be one of"),
    ],
)
def test_bad_input_is_a_one_line_error(pair, kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        _prepare(pair, **kwargs)
    assert "\n" not in str(info.value)


def test_single_draft_error_names_only_methods_sample_accepts(pair):
    with pytest.raises(ValueError, match="single draft chain") as info:
        _prepare(pair, method="sps", num_drafts=2)
    message = str(info.value)
    assert "specinfer_wor" not in message  # sample refuses it: never suggest it
    for method in registry.names("drafts", sample=True):
        assert method in message


def test_memory_check_counts_the_caches():
    class Config:
        num_hidden_layers, num_key_value_heads, head_dim = 32, 32, 128  # llama-7b

    # 2 (k, v) * 32 layers * 32 heads * 128 dims * 2 bytes = 512 KiB per slot and row.
    assert sampler._kv_cache_bytes(Config, 1, 2048, np.float16) == 2048 * 512 * 1024


def test_top_k_beyond_int32_keeps_every_token(pair):
    """2**32 + 1 used to wrap to 1 in int32 and sample greedily."""
    target, _ = pair
    common = dict(key=jax.random.key(3), max_new_tokens=8, method="ar", eos_token_id=-1)
    rows = [PROMPT] * 8
    wide = asps_jax.sample(target, None, rows, top_k=2**32 + 1, **common)
    free = asps_jax.sample(target, None, rows, **common)
    np.testing.assert_array_equal(np.asarray(wide.tokens), np.asarray(free.tokens))
    assert len({tuple(r) for r in np.asarray(wide.tokens).tolist()}) > 1  # not greedy
