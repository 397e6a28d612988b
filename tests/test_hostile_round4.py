"""Hostile input, round 4 (issue 66), on the sampling API: per-prompt seeds made in one call and
equal to ``jax.random.key`` of each, a huge ``n`` refused before anything is repeated, unknown
keywords refused as unknown (naming the closest valid name) at every public entry point, and the
smaller one-line errors (logprob flags, deleted arrays, ``min_tokens``, ``bad_words``)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_checkpoints import load_tiny_pair

import asps_jax
from asps_jax import arguments, sampler

VOCAB = 12
PROMPTS = [[1, 5, 3], [2, 4]]
# Every range the key of a seed goes through: 32-bit, past it, and the largest seed taken.
SEEDS = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 7, 12345678901, 2**62 + 3, 2**63 - 1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_tiny_pair(tmp_path_factory.mktemp("round4"), VOCAB)


def _prepare(pair, prompts=PROMPTS, **kwargs):
    target, draft = pair
    args = dict(max_new_tokens=2, method="asps")
    args.update(kwargs)
    if "key" not in args and "seed" not in args:
        args["seed"] = 0
    return sampler.prepare(target, draft, prompts, **args)


# --- Per-prompt seeds: one vectorised call, the same keys as before ---------------------------


@pytest.mark.parametrize(
    "as_array, config",
    [
        (False, {}),
        (True, {}),
        (False, {"jax_enable_x64": True}),  # seeds past 32 bits keep their high half
        (False, {"jax_default_prng_impl": "rbg"}),
        (False, {"jax_random_seed_offset": 5}),
    ],
)
def test_seed_keys_are_jax_random_key_of_each_seed(as_array, config):
    """The keys of one call equal ``jax.random.key(s)`` made seed by seed (today's keys)."""
    before = {name: getattr(jax.config, name) for name in config}
    try:
        for name, value in config.items():
            jax.config.update(name, value)
        seeds = np.asarray(SEEDS, np.uint64) if as_array else SEEDS
        want = np.stack([jax.random.key_data(jax.random.key(s)) for s in SEEDS])
        got = arguments.seed_keys(None, seeds, len(SEEDS))
        assert np.array_equal(jax.random.key_data(got), want)
    finally:
        for name, value in before.items():
            jax.config.update(name, value)


def test_per_prompt_seeds_are_the_keys_of_the_rows(pair):
    """``seed=[s_p]`` gives the rows the keys ``key=[jax.random.key(s_p)]`` gives, n = 1 and 2."""
    seeds = [SEEDS[-1], SEEDS[5]]
    keys = jnp.stack([jax.random.key(s) for s in seeds])
    for n in (1, 2):
        by_seed = _prepare(pair, seed=seeds, n=n).inputs.row_keys_B
        by_key = _prepare(pair, key=keys, n=n).inputs.row_keys_B
        assert np.array_equal(jax.random.key_data(by_seed), jax.random.key_data(by_key))


def test_per_prompt_seeds_are_made_in_one_call(pair, monkeypatch):
    """1 000 seeds used to be 1 000 dispatches of ``jax.random.key`` (13 ms each), then a stack."""
    calls = []
    real = jax.random.key
    monkeypatch.setattr(jax.random, "key", lambda *a, **k: calls.append(1) or real(*a, **k))
    num = 1000
    call = _prepare(pair, prompts=[[1, 2]] * num, seed=list(range(num)))
    assert len(calls) <= 2
    want = jax.random.key_data(jnp.stack([real(s) for s in (0, 1, num - 1)]))
    got = np.asarray(jax.random.key_data(call.inputs.row_keys_B))[[0, 1, num - 1]]
    assert np.array_equal(got, want)


# --- A huge n is refused before anything is repeated ------------------------------------------


def test_a_huge_n_is_refused_before_anything_is_allocated(pair):
    """``n=10**9`` grew past 7 GB (``Sampler``) or met the OOM killer (``sample``) first."""
    target, draft = pair
    match = r"^n=1000000000 samples per prompt x 1 prompt\(s\) = 1000000000 rows, past the bound"
    with pytest.raises(ValueError, match=match):
        asps_jax.sample(target, draft, [[0]], max_new_tokens=8, seed=0, n=10**9)
    with pytest.raises(ValueError, match=r"^n=1000000000 .* lower n or split the prompts"):
        asps_jax.Sampler(target, draft, num_draft_tokens=4)(
            [[0]], max_new_tokens=8, seed=0, n=10**9
        )
    with pytest.raises(ValueError, match=r"^n=2097153 samples per prompt x 2 prompt\(s\)"):
        _prepare(pair, n=arguments.MAX_ROWS // 2 + 1)


# --- Unknown keywords: refused as unknown, naming the closest valid name ----------------------


def _entry_points(pair):
    target, draft = pair
    key = jax.random.key(0)
    chain = (key, jnp.zeros(2, jnp.int32), jnp.zeros((2, VOCAB)), jnp.zeros((3, VOCAB)))
    drafts = (key, jnp.zeros((2, 2), jnp.int32), jnp.zeros((2, 2, VOCAB)), jnp.zeros((2, 3, VOCAB)))
    call = dict(max_new_tokens=2, seed=0)
    return {
        "sample": lambda **kw: asps_jax.sample(target, draft, PROMPTS, **call, **kw),
        "stream": lambda **kw: next(asps_jax.stream(target, draft, PROMPTS, **call, **kw)),
        "Session": lambda **kw: asps_jax.Session(target, draft, PROMPTS, **call, **kw),
        "Sampler": lambda **kw: asps_jax.Sampler(target, draft, **kw),
        "Sampler call": lambda **kw: asps_jax.Sampler(target, draft)(PROMPTS, **call, **kw),
        "prepare": lambda **kw: sampler.prepare(target, draft, PROMPTS, **call, **kw),
        "verify_chain": lambda **kw: asps_jax.verify_chain(*chain, **kw),
        "verify_drafts": lambda **kw: asps_jax.verify_drafts(*drafts, **kw),
        "process_logits": lambda **kw: asps_jax.process_logits(jnp.zeros(VOCAB), **kw),
        "make_mesh": lambda **kw: asps_jax.make_mesh("data=1", **kw),
        "load_model": lambda **kw: asps_jax.load_model("no-such-model", **kw),
    }


@pytest.mark.parametrize(
    "entry, keyword, closest",
    [
        ("sample", "temprature", "temperature"),
        ("sample", "include_stop_str_in_output", None),
        ("stream", "max_tokens", "max_new_tokens"),
        ("Session", "top_kk", "top_k"),
        ("Sampler", "temprature", "temperature"),
        ("Sampler call", "seeds", "seed"),
        ("prepare", "num_draft_token", "num_draft_tokens"),
        ("verify_chain", "draft_lenght", "draft_length"),
        ("verify_drafts", "rul", "rule"),
        ("process_logits", "topk", "top_k"),
        ("make_mesh", "device", "devices"),
        ("load_model", "dtyp", "dtype"),
    ],
)
def test_an_unknown_keyword_is_named_with_the_closest_valid_one(pair, entry, keyword, closest):
    """``Sampler(T, D, temprature=0.5)`` read "verify_drafts: method 'asps' takes no options"."""
    with pytest.raises(ValueError, match=f"^{entry}: unknown option '{keyword}'") as err:
        _entry_points(pair)[entry](**{keyword: 0.5})
    message = str(err.value)
    assert "\n" not in message and isinstance(err.value, TypeError)  # Python's type for it too
    if closest is not None:
        assert message.endswith(f"(did you mean '{closest}'?)")


def test_a_method_option_for_another_method_still_names_the_method(pair):
    with pytest.raises(ValueError, match="method 'asps' takes no options"):
        _prepare(pair, rule="fixed_order")


# --- The smaller ones ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(raw_logprobs=True), "raw_logprobs needs return_logprobs=True"),
        (dict(return_logprobs="yes"), "return_logprobs must be True or False, got 'yes'"),
        (dict(top_logprobs=2), "top_logprobs needs return_logprobs=True"),
    ],
)
def test_the_sampler_checks_its_logprob_flags_at_construction(pair, options, match):
    with pytest.raises(ValueError, match=match):
        asps_jax.Sampler(*pair, **options)


def test_update_params_refuses_a_deleted_array(pair):
    target, draft = pair
    s = asps_jax.Sampler(target, draft)
    new = jax.tree.map(jnp.copy, target.params)
    path, leaf = jax.tree.flatten_with_path(new)[0][0]
    leaf.delete()  # as a jitted call that donated it leaves it
    name = re.escape(jax.tree_util.keystr(path))
    with pytest.raises(ValueError, match=rf"^update_params: target_params{name} is a deleted"):
        s.update_params(new)
    assert s.target is target  # nothing swapped


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(min_tokens=10**12),
            r"^min_tokens must be an integer >= 0 and at most 2\*\*31 - 1 ",
        ),
        (dict(bad_words=[[]]), r"; bad_words\[0\] is an empty list \(one per prompt: 2"),
        (dict(bad_words=[[1.5]]), r"; bad_words\[0\]\[0\] is 1.5 \(a token id is an int\)$"),
        (dict(bad_words=[[True]]), r"; bad_words\[0\]\[0\] is True \(a token id is an int\)$"),
        (dict(bad_words=[[1, "a"]]), r"; bad_words\[0\]\[1\] is 'a' \(a token id is an int\)$"),
        (dict(bad_words=[None]), r"a list of them\); bad_words\[0\] is None$"),
        (
            dict(bad_words=[[3], None]),
            r"^bad_words: each must .*; bad_words\[1\] is None$",
        ),
        (dict(bad_words=[[[3], [0.5]], []]), r"; bad_words\[0\]\[1\] is \[0.5\] \(a token id"),
        # EOS banned by min_tokens, every other token by logit_bias: min_tokens is to blame.
        (
            dict(
                min_tokens=2,
                eos_token_id=2,
                logit_bias={t: -np.inf for t in range(VOCAB) if t != 2},
            ),
            r"^min_tokens bans the EOS id\(s\) \[2\] before a row has min_tokens tokens, and "
            r"logit_bias bans every other token for prompts \[0, 1\]",
        ),
    ],
)
def test_a_bad_sampling_entry_is_named(pair, kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        _prepare(pair, **kwargs)
    assert "\n" not in str(err.value)


def test_per_prompt_bad_words_lists_keep_their_meaning(pair):
    """An empty list for one prompt of a list per prompt is no bad word for that prompt."""
    rows = _prepare(pair, bad_words=[[[3]], []]).inputs.sampling.bad_words
    assert rows is not None and rows.shape[0] >= 2
