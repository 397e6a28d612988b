"""End-to-end tests of asps_jax.sample on tiny random Llama checkpoints written by transformers.

Expected values come from transformers (PyTorch): the exact law of the first two tokens, and greedy
decoding. Tests share compiled loops: per method one for the 20,000-row law runs (which also carry
the greedy rows where no other test compiles the method's 8-row loop) and one for 8 rows.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch
from hf_checkpoints import write_tiny_llama
from scipy import stats as sps_stats

import asps_jax
from asps_jax import decode
from asps_jax.models import base
from asps_jax.models.base import run_params
from asps_jax.sampler import METHODS, NonFiniteLogitsError
from asps_jax.verify.api import CHAIN_METHODS
from asps_jax.verify.registry import REGISTRY

VOCAB = 12
N_DRAFT = 2
MAX_NEW = 6
PROMPT = [1, 5, 3]
ROWS = 10_000


def _write_llama(path, seed, *, vocab=VOCAB, **kwargs):
    """Large weights (initializer_range 0.4) give peaked laws, so drafts are sometimes rejected."""
    return write_tiny_llama(path, seed=seed, vocab_size=vocab, initializer_range=0.4, **kwargs)


def write_pair(root):
    """The transformers target and our loaded target and draft (the draft a noisy copy)."""
    hf_target = _write_llama(root / "target", 0)
    _write_llama(root / "draft", 1, noise_from=hf_target)
    target = asps_jax.load_model(str(root / "target"))
    draft = asps_jax.load_model(str(root / "draft"))
    return hf_target, target, draft


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("ckpt"))


def _warp(logits, temperature, top_k, top_p):
    """transformers' own warpers, in transformers' order: the independent reference law."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = logits[None].clone()
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores[0].double(), -1).numpy()


def _exact_two_token_law(hf_model, temperature, top_k, top_p):
    with torch.no_grad():
        first = hf_model(torch.tensor([PROMPT])).logits[0, -1]
        p1 = _warp(first, temperature, top_k, top_p)
        seqs = torch.tensor([PROMPT + [x] for x in range(VOCAB)])
        second = hf_model(seqs).logits[:, -1]
        p2 = np.stack([_warp(second[x], temperature, top_k, top_p) for x in range(VOCAB)])
    return p1[:, None] * p2


def _chi_square_pvalue(counts, expected_probs):
    expected = expected_probs.reshape(-1) * counts.sum()
    observed = counts.reshape(-1)
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    assert observed[expected == 0].sum() == 0, "a zero-probability string was emitted"
    return sps_stats.chisquare(obs[keep], exp[keep]).pvalue


# Fewer fit steps keep the CPU run short; exactness never depends on the fit's accuracy. The
# optimal method still runs its Adam ascent (grad_steps > 0), for 4 steps instead of 200.
METHOD_OPTIONS = {"optimal": dict(grad_steps=4), "is": dict(fit_steps=5)}


def _sample(target, draft, prompts, method, **kw):
    kw.update(METHOD_OPTIONS.get(method, {}))
    kw.setdefault("num_draft_tokens", N_DRAFT)
    kw.setdefault("num_drafts", 1 if method == "ar" or REGISTRY[method].kind == "chain" else 2)
    kw.setdefault("max_new_tokens", MAX_NEW)
    kw.setdefault("eos_token_id", -1)
    kw.setdefault("key", jax.random.key(0))
    # The law test reads root_optimal_acceptance; every test here enables it so that they all
    # share one compiled loop per method.
    kw.setdefault("diagnostics", True)
    return asps_jax.sample(target, draft if method != "ar" else None, prompts, method=method, **kw)


SETTINGS = [
    dict(temperature=1.0, top_k=0, top_p=1.0, draft_temperature=1.0),
    dict(temperature=0.8, top_k=8, top_p=0.9, draft_temperature=1.3),
]


# The greedy rows of every law run (temperature 0, each prompt at draft temperature 0 and 1):
# the greedy tests read them from the law run's compiled loop instead of compiling their own.
GREEDY_PROMPTS = [PROMPT, [4, 7, 9, 1, 0, 11, 6], [2]]
GREEDY_DRAFT_TEMPERATURES = (0.0, 1.0)
LAW_ROWS = ROWS * len(SETTINGS)


def _rows(out, stop, start=0):
    """Rows ``start:stop`` of a sample output (tokens, lengths and the per-row statistics)."""
    return dataclasses.replace(
        out,
        tokens=out.tokens[start:stop],
        lengths=out.lengths[start:stop],
        stats={name: value[start:stop] for name, value in out.stats.items()},
    )


def _sample_law(target, draft, method, eos_token_id=-1, seed=100, greedy=False, **kw):
    """ROWS rows per setting in one call: the sampling parameters are per row (no recompile).
    Then the greedy rows (``GREEDY_PROMPTS`` at each of ``GREEDY_DRAFT_TEMPERATURES``), in
    every law run so that all of them share one batch shape: with ``greedy=True`` they get the
    budget MAX_NEW (``max_new_tokens`` is a traced per-row budget), else 1 (they end in the
    first step and never lengthen the loop). Returns the law rows' output and the greedy rows'
    tokens (int [len(GREEDY_DRAFT_TEMPERATURES), len(GREEDY_PROMPTS), MAX_NEW] with
    ``greedy=True``, else None)."""
    budget = kw.pop("max_new_tokens", MAX_NEW)
    per_row = {
        name: np.repeat([setting[name] for setting in SETTINGS], ROWS) for name in SETTINGS[0]
    }
    extra = len(GREEDY_PROMPTS) * len(GREEDY_DRAFT_TEMPERATURES)
    greedy_rows = dict(
        temperature=np.zeros(extra),
        top_k=np.zeros(extra, int),
        top_p=np.ones(extra),
        draft_temperature=np.repeat(GREEDY_DRAFT_TEMPERATURES, len(GREEDY_PROMPTS)),
    )
    per_row = {name: np.concatenate([per_row[name], greedy_rows[name]]) for name in per_row}
    budgets = [budget] * LAW_ROWS + [MAX_NEW if greedy else 1] * extra
    out = _sample(
        target,
        draft,
        [PROMPT] * LAW_ROWS + GREEDY_PROMPTS * len(GREEDY_DRAFT_TEMPERATURES),
        method,
        key=jax.random.key(seed),
        eos_token_id=eos_token_id,
        max_new_tokens=budgets,
        **per_row,
        **kw,
    )
    tokens = None
    if greedy:
        tokens = np.asarray(out.tokens[LAW_ROWS:, :MAX_NEW])
        tokens = tokens.reshape(len(GREEDY_DRAFT_TEMPERATURES), len(GREEDY_PROMPTS), MAX_NEW)
    # The law rows as if run alone: their own width (the budget), their statistics.
    law = _rows(out, LAW_ROWS)
    return dataclasses.replace(law, tokens=law.tokens[:, :budget]), tokens


@pytest.fixture(scope="module")
def law_run(pair):
    """``_sample_law`` run once per distinct call: the one-draft tree tests compare against the
    very ASpS run (seed 100) that test_first_two_tokens_follow_the_target_law[asps] checks, and
    the greedy test reads the greedy rows of the law run where that saves a compile."""
    _, target, draft = pair
    runs = {}

    def run(method, **kw):
        key = (method, tuple(sorted(kw.items())))
        if key not in runs:
            runs[key] = _sample_law(target, draft, method, **kw)
        return runs[key]

    return run


def _assert_two_token_law(hf_target, out, label):
    """Chi-square of each setting's first two tokens against transformers' exact law."""
    for i, setting in enumerate(SETTINGS):
        tokens = np.asarray(out.tokens[i * ROWS : (i + 1) * ROWS])
        counts = np.zeros((VOCAB, VOCAB))
        np.add.at(counts, (tokens[:, 0], tokens[:, 1]), 1)
        law = _exact_two_token_law(
            hf_target, setting["temperature"], setting["top_k"], setting["top_p"]
        )
        pvalue = _chi_square_pvalue(counts, law)
        assert pvalue > 1e-3, f"{label} {setting}: chi-square p-value {pvalue:.2e}"


def _law_new_tokens(method):
    """The law tests read the first two tokens, so their runs stop there: the 20,000-row loop then
    runs two steps at most instead of six. ASpS keeps MAX_NEW: its run is also the reference of
    test_one_draft_tree_method_is_asps_in_law (the law of the number of target calls)."""
    return MAX_NEW if method == "asps" else 2


# The methods whose greedy test would be the only one here to compile their 8-row loop: their
# greedy rows get a budget in the law run instead (a few more steps of it, no second compile).
# ASpS's law run runs MAX_NEW steps anyway.
GREEDY_IN_LAW_RUN = ("asps", "spectr", "optimal", "specinfer_wor", "tv")


def _law(law_run, method, seed=100):
    """The law run of test_first_two_tokens_follow_the_target_law (and its greedy rows)."""
    return law_run(
        method,
        seed=seed,
        max_new_tokens=_law_new_tokens(method),
        greedy=method in GREEDY_IN_LAW_RUN,
    )


@pytest.mark.slow
@pytest.mark.optimized  # the law run outweighs its compile (tests/conftest.py)
@pytest.mark.parametrize("method", METHODS)
def test_first_two_tokens_follow_the_target_law(pair, law_run, method):
    hf_target = pair[0]
    new_tokens = _law_new_tokens(method)
    out, _ = _law(law_run, method)
    assert np.all(np.asarray(out.lengths) == new_tokens)
    tps = np.asarray(out.stats["tokens_per_step"])
    assert np.all(tps >= 1.0) and np.all(tps <= N_DRAFT + 1)
    if method != "ar":
        # Root token-level acceptance never beats the optimum; one chain's SpS/ASpS reach it.
        steps = np.asarray(out.stats["root_steps"]).sum()
        acc = (np.asarray(out.stats["root_acceptance"]) * out.stats["root_steps"]).sum() / steps
        opt = (np.asarray(out.stats["root_optimal_acceptance"]) * out.stats["root_steps"]).sum()
        opt /= steps
        stderr = np.sqrt(acc * (1 - acc) / steps)
        # The optimum is that of K independent drafts; distinct roots (specinfer_wor) may beat it.
        if REGISTRY[method].law == "iid":
            assert acc <= opt + 4 * stderr, (acc, opt)
        if method in CHAIN_METHODS:
            assert abs(acc - opt) <= 4 * stderr, (acc, opt)
    _assert_two_token_law(hf_target, out, method)


def _hf_greedy(hf_model, prompt, max_new):
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),  # token 0 is a real token here, not padding
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_temperature_zero_is_the_target_greedy_decoding(pair, law_run, method):
    """Each greedy prompt at draft temperature 0 and 1 (the draft's own law must not matter)."""
    hf_target, target, draft = pair
    if method in GREEDY_IN_LAW_RUN:
        _, tokens = _law(law_run, method)
    else:
        prompts = GREEDY_PROMPTS * len(GREEDY_DRAFT_TEMPERATURES)
        temps = np.repeat(GREEDY_DRAFT_TEMPERATURES, len(GREEDY_PROMPTS))
        out = _sample(target, draft, prompts, method, temperature=0.0, draft_temperature=temps)
        tokens = np.asarray(out.tokens).reshape(len(temps) // len(GREEDY_PROMPTS), -1, MAX_NEW)
    for b, prompt in enumerate(GREEDY_PROMPTS):
        want = _hf_greedy(hf_target, prompt, MAX_NEW)
        for d, draft_temp in enumerate(GREEDY_DRAFT_TEMPERATURES):
            assert tokens[d, b].tolist() == want, (prompt, draft_temp)


@pytest.mark.slow
@pytest.mark.optimized  # the law run outweighs its compile (tests/conftest.py)
def test_one_row_layout_keeps_the_law_and_the_greedy_output(pair, monkeypatch):
    """The law and greedy runs above put both models on the wide run layout (``[in, out]``: each
    forward multiplies many rows). Here both run on the one-row layout (``[out, in]``), which the
    sampler gives a target only under ``ar`` at batch 1: ASpS keeps transformers' two-token law
    and its greedy output."""
    hf_target, target, draft = pair
    chosen = []

    def one_row(spec, rows):
        chosen.append(rows)
        return {"target_params": False, "draft_params": False}

    monkeypatch.setattr(asps_jax.sampler, "wide_layouts", one_row)
    out, tokens = _sample_law(target, draft, "asps", seed=101, max_new_tokens=2, greedy=True)
    assert len(chosen) == 1 and chosen[0] >= LAW_ROWS  # the call's (padded) batch
    _assert_two_token_law(hf_target, out, "asps, one-row layout")
    for b, prompt in enumerate(GREEDY_PROMPTS):
        want = _hf_greedy(hf_target, prompt, MAX_NEW)
        for d in range(len(GREEDY_DRAFT_TEMPERATURES)):
            assert tokens[d, b].tolist() == want, prompt


@pytest.mark.slow
@pytest.mark.optimized  # the law run outweighs its compile (tests/conftest.py)
def test_scan_layout_keeps_the_law_and_the_greedy_output(pair, monkeypatch):
    """The layout an accelerator runs (``base.scan_layout_for``: the stored stacked layers in one
    ``lax.scan``, a stacked cache), forced on CPU: ASpS keeps transformers' two-token law, and
    its greedy rows are transformers' greedy output, as on the unrolled run layout above."""
    hf_target, target, draft = pair
    placed = []

    def spy(model, params=None, *, wide=False):
        out = run_params(model, params, wide=wide)
        placed.append(out)
        return out

    monkeypatch.setenv(base.LAYOUT_ENV, "scan")
    monkeypatch.setattr(asps_jax.sampler, "run_params", spy)
    out, tokens = _sample_law(target, draft, "asps", seed=102, max_new_tokens=2, greedy=True)
    assert [p["layers"] for p in placed] == [target.params["layers"], draft.params["layers"]]
    _assert_two_token_law(hf_target, out, "asps, scan layout")
    for b, prompt in enumerate(GREEDY_PROMPTS):
        want = _hf_greedy(hf_target, prompt, MAX_NEW)
        for d in range(len(GREEDY_DRAFT_TEMPERATURES)):
            assert tokens[d, b].tolist() == want, prompt


@pytest.mark.slow
@pytest.mark.parametrize("method", ["asps", "specinfer", "tv_wr", "is_bv"])
def test_row_output_does_not_depend_on_the_batch(pair, method):
    _, target, draft = pair
    key = jax.random.key(7)
    alone = _sample(target, draft, [PROMPT], method, key=key)
    batch = _sample(target, draft, [PROMPT, [3, 3, 3, 3, 3, 9, 1, 2], [5]], method, key=key)
    np.testing.assert_array_equal(np.asarray(alone.tokens[0]), np.asarray(batch.tokens[0]))
    # Per-row keys make the row position irrelevant too.
    keys = jax.random.split(key, 3)
    a = _sample(target, draft, [PROMPT, [5], [6, 6]], method, key=keys)
    b = _sample(target, draft, [[6, 6], [5], PROMPT], method, key=keys[::-1])
    np.testing.assert_array_equal(np.asarray(a.tokens[0]), np.asarray(b.tokens[2]))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "sps", "asps", "is"])
def test_eos_inside_an_accepted_block_ends_the_row(pair, method):
    hf_target, target, draft = pair
    greedy = _hf_greedy(hf_target, PROMPT, MAX_NEW)
    eos = greedy[2]  # the third greedy token: inside a block whenever two tokens were accepted
    cut = greedy.index(eos) + 1
    out = _sample(target, draft, [PROMPT, [7]], method, temperature=0.0, eos_token_id=eos)
    assert int(out.lengths[0]) == cut
    assert np.asarray(out.tokens[0]).tolist() == greedy[:cut] + [-1] * (MAX_NEW - cut)


@pytest.mark.slow
@pytest.mark.optimized  # the law run outweighs its compile (tests/conftest.py)
@pytest.mark.parametrize("method", ["asps", "spectr"])
def test_eos_law_is_exact(pair, method):
    """With EOS on, the law of (x1, x2) — x2 absent after an EOS — is still the target's."""
    hf_target, target, draft = pair
    law = _exact_two_token_law(hf_target, 1.0, 0, 1.0)
    eos = int(np.argmax(law.sum(1)))  # the likeliest first token, so rows often stop at once
    new_tokens = _law_new_tokens(method)  # the compiled loop of the law test
    out, _ = _sample_law(target, draft, method, eos_token_id=eos, seed=3, max_new_tokens=new_tokens)
    tokens, lengths = np.asarray(out.tokens[:ROWS]), np.asarray(out.lengths[:ROWS])
    stopped = tokens[:, 0] == eos
    assert np.all(lengths[stopped] == 1) and np.all(tokens[stopped, 1:] == -1)
    for row, length in zip(tokens[~stopped], lengths[~stopped]):
        hits = np.flatnonzero(row[:length] == eos)
        assert length == new_tokens or (hits.size == 1 and hits[0] == length - 1)
        assert np.all(row[length:] == -1)
    counts = np.zeros((VOCAB, VOCAB + 1))
    np.add.at(counts, (tokens[:, 0], np.where(stopped, VOCAB, tokens[:, 1])), 1)
    expected = np.concatenate([law, np.zeros((VOCAB, 1))], axis=1)
    expected[eos] = 0.0
    expected[eos, VOCAB] = law[eos].sum()
    assert _chi_square_pvalue(counts, expected) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("max_new", [1, 5])
def test_max_new_tokens_is_honoured_exactly(pair, max_new):
    hf_target, target, draft = pair
    out = _sample(
        target,
        draft,
        [PROMPT, [7]],
        "asps",
        temperature=0.0,
        # Budget 1 is below one step's N_DRAFT + 1 tokens and 5 is no multiple of it: the last
        # step's drafts are cut to fit (the loop shared with the other 8-row ASpS tests).
        max_new_tokens=max_new,
    )
    assert out.tokens.shape == (2, max_new)
    np.testing.assert_array_equal(np.asarray(out.lengths), [max_new, max_new])
    assert np.asarray(out.tokens[0]).tolist() == _hf_greedy(hf_target, PROMPT, max_new)


@pytest.mark.slow
def test_no_recompile_across_prompts_temperatures_and_keys(pair):
    """Values never recompile: the filters given (top-k, top-p: their code is in the program
    only when a call gives them, tests/test_program_families.py) at their off values first."""
    _, target, draft = pair
    off = dict(top_p=1.0, top_k=0)
    _sample(target, draft, [PROMPT, [4, 4]], "asps", key=jax.random.key(1), **off)
    before = decode.generate._cache_size()
    _sample(target, draft, [[9, 8, 7], [1]], "asps", key=jax.random.key(2), temperature=0.5, **off)
    _sample(
        target,
        draft,
        [[2, 2], [3, 3, 3, 3]],
        "asps",
        key=jax.random.key(3),
        top_p=0.7,
        top_k=3,
        temperature=1.3,
    )
    assert decode.generate._cache_size() == before


@pytest.mark.slow
def test_stream_yields_the_same_tokens_as_sample(pair):
    _, target, draft = pair
    key = jax.random.key(11)
    prompts = [PROMPT, [8, 1]]
    full = _sample(target, draft, prompts, "asps", key=key)
    gen = asps_jax.stream(
        target,
        draft,
        prompts,
        method="asps",
        key=key,
        max_new_tokens=MAX_NEW,
        num_draft_tokens=N_DRAFT,
        eos_token_id=-1,
    )
    rows = [[], []]
    while True:
        try:
            for b, new in enumerate(next(gen)):
                rows[b].extend(new)
        except StopIteration as stop:
            final = stop.value
            break
    for b in range(2):
        assert rows[b] == np.asarray(full.tokens[b]).tolist()
    np.testing.assert_array_equal(np.asarray(final.tokens), np.asarray(full.tokens))


def test_nan_logits_raise_and_keep_the_output(pair, tmp_path):
    _, target, _ = pair
    _write_llama(tmp_path / "nan", 4, nan=True)
    broken = asps_jax.load_model(str(tmp_path / "nan"))
    with pytest.raises(NonFiniteLogitsError) as info:
        _sample(target, broken, [PROMPT, [7]], "asps")
    assert info.value.output.tokens.shape == (2, MAX_NEW)


@pytest.mark.slow
@pytest.mark.optimized  # the law run outweighs its compile (tests/conftest.py)
@pytest.mark.parametrize("method", ["tv", "is_bv"])
def test_one_draft_tree_method_is_asps_in_law(pair, law_run, method):
    """With K = 1 a tree verifier is ASpS draft by draft (tests/test_verify_tree.py), not draw by
    draw (its stop and token draws use other keys): the first two tokens follow the target's law,
    and the number of target calls per row, a function of the step lengths, has the law it has
    with ASpS (two-sample chi-square, independent seeds)."""
    hf_target = pair[0]
    out, _ = law_run(method, seed=101, num_drafts=1, max_new_tokens=MAX_NEW)
    _assert_two_token_law(hf_target, out, method)
    ref, _ = _law(law_run, "asps")
    calls = np.stack(
        [
            np.bincount(np.asarray(o.stats["target_calls"]), minlength=MAX_NEW + 1)
            for o in (out, ref)
        ]
    )
    common = calls.sum(0) >= 20  # rare counts pooled into one column
    table = np.concatenate([calls[:, common], calls[:, ~common].sum(1, keepdims=True)], axis=1)
    table = table[:, table.sum(0) > 0]
    assert sps_stats.chi2_contingency(table).pvalue > 1e-3, table
    for stat in ("tokens_per_step", "acceptance"):
        a, b = np.asarray(out.stats[stat]), np.asarray(ref.stats[stat])
        assert abs(a.mean() - b.mean()) < 5 * np.hypot(a.std(), b.std()) / np.sqrt(a.size), stat
