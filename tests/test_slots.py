"""Continuous batching (``sample(batch_size=B)``, :mod:`asps_jax.slots`): the reproducibility
contract, per-prompt budgets, order, streaming, and no recompile when only budgets change.

The expected tokens of every prompt come from the one-batch call (``Decoder.generate``, a
different program and code path: every prompt in its own row from the start); the contract is
that continuous batching gives exactly those tokens, whatever the number of slots. The one-batch
call's own law is tested against transformers in test_decode.py. Tiny shapes: 12-token vocabulary,
n = 2, budgets of at most 12 (one output bucket: every call of a method shares its programs).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from test_decode import write_pair

import asps_jax
from asps_jax import compile_cache, decode, sampler, slots

# Seven prompts (the prompt set pads to 8 rows), ragged; budgets from 1 to 12.
PROMPTS = [[1, 5, 3], [2], [4, 4, 7, 1, 9], [3, 8], [6, 2, 2, 10], [11], [5, 9, 1]]
BUDGETS = [12, 3, 1, 12, 7, 12, 5]
TEMPERATURES = [1.0, 0.7, 1.0, 1.3, 1.0, 0.0, 1.0]
EOS = [0, 1]  # two of the twelve tokens end a row: EOS and budgets both end rows
# (method, options): the single-draft chain method, a multi-draft method, a branching tree.
METHODS = [
    ("asps", dict(num_draft_tokens=2)),
    ("specinfer", dict(num_draft_tokens=2, num_drafts=3)),
    ("tv", dict(tree=(2, 2))),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    _, target, draft = write_pair(tmp_path_factory.mktemp("ckpt"))
    return target, draft


def _sample(pair, method, options, prompts=PROMPTS, budgets=BUDGETS, **kwargs):
    target, draft = pair
    kwargs.setdefault("temperature", TEMPERATURES[: len(prompts)])
    return asps_jax.sample(
        target,
        draft,
        prompts,
        key=jax.random.key(7),
        max_new_tokens=budgets,
        method=method,
        eos_token_id=EOS,
        return_logprobs=True,
        **options,
        **kwargs,
    )


def _rows(out):
    lengths = np.asarray(out.lengths)
    tokens, logprobs = np.asarray(out.tokens), np.asarray(out.logprobs)
    return [
        (tokens[b, : lengths[b]].tolist(), logprobs[b, : lengths[b]]) for b in range(len(lengths))
    ]


def _frozen(value):
    return tuple(map(_frozen, value)) if isinstance(value, (list, tuple)) else value


@pytest.fixture(scope="module")
def rows(pair):
    """``rows(method_index, batch_size=None, budgets=BUDGETS, prompts=PROMPTS)``: the rows of
    that call, each call run once for the whole module (several tests read the same call, and
    every call of a method and slot count reuses one compiled program: CI time)."""
    cache = {}

    def run(method_index, batch_size=None, budgets=BUDGETS, prompts=PROMPTS):
        key = (method_index, batch_size, _frozen(budgets), _frozen(prompts))
        if key not in cache:
            method, options = METHODS[method_index]
            cache[key] = _rows(
                _sample(pair, method, options, prompts, budgets, batch_size=batch_size)
            )
        return cache[key]

    return run


def _same(got, expected):
    assert len(got) == len(expected)
    for b, ((tokens, lps), (want, want_lps)) in enumerate(zip(got, expected)):
        assert tokens == want, b
        # XLA:CPU's batched attention dot may round the last bit differently for another
        # batch size (measured: 7e-7 on a [B, 4, 3, 64] einsum), so the laws agree to float32
        # rounding, not bit for bit; tokens drawn from them agree exactly here.
        np.testing.assert_allclose(lps, want_lps, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(METHODS)), ids=[m for m, _ in METHODS])
def test_tokens_do_not_depend_on_the_number_of_slots(rows, index):
    """Each prompt's tokens (and their log-probabilities, to float32 rounding) are those of the
    one-batch call, with 2 or 3 slots; budgets are per prompt and each row ends by its EOS or
    budget."""
    expected = rows(index)
    for b, (tokens, _) in enumerate(expected):
        assert 1 <= len(tokens) <= BUDGETS[b]
        assert len(tokens) == BUDGETS[b] or tokens[-1] in EOS, (b, tokens)
    # The mix has both endings (else the test would not exercise refills at different times).
    assert any(t and t[-1] in EOS and len(t) < BUDGETS[b] for b, (t, _) in enumerate(expected))
    assert any(len(t) == BUDGETS[b] and not set(t) & set(EOS) for b, (t, _) in enumerate(expected))
    for batch_size in (2, 3) if index == 0 else (2,):
        _same(rows(index, batch_size), expected)


@pytest.mark.slow
def test_prompt_order_kept_and_other_prompts_do_not_matter(rows):
    """Prompt i's key is fold_in(key, i): a prompt at the same index among other prompts (other
    texts, other lengths) gets the same tokens."""
    base = rows(0, 2)
    # Other prompts at the other indices (same count, so the same program): prompt 3 unchanged.
    others = [[9, 9], [1], [2, 3], PROMPTS[3], [7], [8, 8, 8], [10]]
    got = rows(0, 2, prompts=others)
    assert got[3][0] == base[3][0]
    np.testing.assert_allclose(got[3][1], base[3][1], rtol=1e-5, atol=1e-6)
    assert [t for t, _ in got] != [t for t, _ in base]  # the other prompts did change


@pytest.mark.slow
def test_fewer_prompts_than_slots(rows):
    """Two prompts with batch_size=3: the tokens are those of the same two prompts in the
    seven-prompt one-batch call (a prompt's tokens depend on its index, not on the others)."""
    got = rows(0, 3, budgets=BUDGETS[:2], prompts=PROMPTS[:2])
    assert [t for t, _ in got] == [t for t, _ in rows(0)[:2]]


@pytest.mark.parametrize(
    "budgets, ended_by",
    [([12] * 7, "eos"), ([2, 1, 3, 2, 1, 2, 3], "budget")],
    ids=["eos-heavy", "budget-heavy"],
)
def test_eos_heavy_and_budget_heavy_mixes(rows, budgets, ended_by):
    """Most rows end at an EOS (budgets 12), or most at their budget (budgets 1 to 3): every
    prompt comes back in order with the one-batch call's tokens (the same programs as above)."""
    expected = rows(0, budgets=budgets)
    assert [t for t, _ in rows(0, 2, budgets=budgets)] == [t for t, _ in expected]
    by_eos = [len(t) < budgets[b] for b, (t, _) in enumerate(expected)]
    share = np.mean(by_eos) if ended_by == "eos" else 1 - np.mean(by_eos)
    assert share > 0.5, (ended_by, [t for t, _ in expected])


@pytest.mark.slow
def test_stream_yields_every_prompt_with_its_index(pair, rows):
    target, draft = pair
    method, options = METHODS[0]
    expected = rows(0)
    pieces: dict[int, list[int]] = {}
    gen = asps_jax.stream(
        target,
        draft,
        PROMPTS,
        key=jax.random.key(7),
        max_new_tokens=BUDGETS,
        method=method,
        eos_token_id=EOS,
        temperature=TEMPERATURES,
        batch_size=3,
        **options,
    )
    while True:
        try:
            index, tokens = next(gen)
        except StopIteration as stop:
            result = stop.value
            break
        assert 0 <= index < len(PROMPTS) and tokens
        pieces.setdefault(index, []).extend(tokens)
    assert sorted(pieces) == list(range(len(PROMPTS)))
    for b, (want, _) in enumerate(expected):
        assert pieces[b] == want, b
    np.testing.assert_array_equal(np.asarray(result.lengths), [len(t) for t, _ in expected])


def test_changing_max_new_tokens_within_a_bucket_compiles_nothing(pair, rows):
    """Budgets 5 then 9 then per-prompt ones (one output bucket, 16): the loop programs
    (``Decoder.generate``, ``slots.run``) are not compiled again (their jit caches do not grow),
    and no XLA program at all is built for the new widths (the outputs are cut to their width on
    the host; counted through jax.monitoring, not timed)."""
    method, options = METHODS[0]
    compile_cache.count_compiles()
    loops = (decode.Decoder.generate, slots.run)
    for batch_size in (None, 2):
        rows(0, batch_size)  # the programs, compiled (once for the module)
        _sample(pair, method, options, budgets=5, batch_size=batch_size)
        before = [f._cache_size() for f in loops]
        programs = compile_cache.compiles()["programs"]
        _sample(pair, method, options, budgets=9, batch_size=batch_size)
        _sample(pair, method, options, budgets=[2, 9, 4, 1, 16, 3, 7], batch_size=batch_size)
        assert [f._cache_size() for f in loops] == before, batch_size
        # Widths 9 and 16: not even a slicing program (a device-side cut compiled one a width).
        assert compile_cache.compiles()["programs"] == programs, batch_size


def test_empty_prompt_list_is_a_one_line_error(pair):
    target, draft = pair
    with pytest.raises(ValueError, match=r"^prompts: the list is empty") as info:
        asps_jax.sample(target, draft, [], key=jax.random.key(0), max_new_tokens=4, batch_size=2)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(batch_size=0), r"^batch_size must be an integer >= 1"),
        (dict(max_new_tokens=[3, 4]), r"^max_new_tokens: give one budget for all prompts"),
        (dict(max_new_tokens=[3, 0, 2, 1, 1, 1, 1]), r"^max_new_tokens must be an integer"),
    ],
)
def test_bad_arguments_are_one_line_errors(pair, kwargs, match):
    target, draft = pair
    kwargs = {"max_new_tokens": 4, "batch_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match) as info:
        asps_jax.sample(target, draft, PROMPTS, key=jax.random.key(0), **kwargs)
    assert "\n" not in str(info.value)


def test_size_check_counts_slots_and_the_prompt_set(pair):
    """The caches are B slots' (not one row per prompt); the prompt set and its outputs are
    there too: 64 prompts through 8 slots need more than 8 prompts in one batch and much less
    than 64 (literal byte counts of the two extra buffers)."""
    from asps_jax import footprint
    from asps_jax.drafters import ModelDraft

    target, draft = pair
    shape = dict(method="asps", prompt_len=5, max_new_tokens=16, num_draft_tokens=2, num_drafts=1)
    eight = footprint.estimate(target.config, ModelDraft(draft.config), batch=8, **shape)
    slots = footprint.estimate(
        target.config, ModelDraft(draft.config), batch=8, num_prompts=64, **shape
    )
    all_rows = footprint.estimate(target.config, ModelDraft(draft.config), batch=64, **shape)
    # Per prompt: tokens + log-probs, 4 bytes each, over M + n + 1 = 19 columns, and the prompt's
    # 16-token bucket at 4 bytes.
    assert sum(slots.values()) - sum(eight.values()) == 64 * (2 * 4 * 19 + 4 * 16)
    assert sum(slots.values()) < sum(all_rows.values()) / 4


@pytest.mark.slow
def test_the_public_slot_seam_matches_prefill(pair):
    """``Decoder.empty`` then ``Decoder.insert`` of some rows gives those rows the state
    ``Decoder.prefill`` gives (the per-row fields exactly, the caches to float rounding: one
    forward per row against one over the batch); a row not taken stays empty. (The loop over
    the seam, ``slots.run``, is checked against ``Decoder.generate`` above.)"""
    target, draft = pair
    call = sampler.prepare(
        target, draft, PROMPTS[:4], key=jax.random.key(7), max_new_tokens=6, method="asps",
        num_draft_tokens=2, eos_token_id=EOS,
    )  # fmt: skip
    dec, inputs = call.decoder, call.inputs
    tp, dp = inputs.target_params, inputs.draft_params
    want = dec.prefill(**inputs.prefill_kwargs())
    keys, prompts = inputs.row_keys_B, inputs.prompts_BP
    empty = dec.empty(tp, dp, keys, prompts.shape[1], inputs.stop)
    assert bool(np.all(np.asarray(empty.done)))
    take = np.arange(len(keys)) != 1  # row 1 stays empty
    got = dec.insert(tp, dp, empty, take, prompts, inputs.prompt_lengths_B, keys, want.budget)
    for name in ("root", "tokens", "num_generated", "budget"):
        np.testing.assert_array_equal(getattr(got, name)[take], getattr(want, name)[take])
    assert bool(got.done[1]) and not bool(np.any(np.asarray(got.done)[take][:3]))
    np.testing.assert_array_equal(got.target_cache.lengths[take], want.target_cache.lengths[take])
    for a, b in zip(got.target_cache.stacked(), want.target_cache.stacked(), strict=True):
        np.testing.assert_allclose(np.asarray(a)[:, take], np.asarray(b)[:, take], atol=1e-5)
