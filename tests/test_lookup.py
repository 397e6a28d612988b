"""Prompt-lookup drafting (asps_jax/drafters/lookup.py, ``draft="lookup"``).

The search is checked on literal texts; exactness by enumerating the verifiers' output law with
point-mass drafts on tabular targets (NumPy float64, every string), and by a chi-square test of
``sample``'s first two tokens against transformers' exact law on a tiny random Llama.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_checkpoints import write_tiny_llama
from multidraft_laws import node_law
from multidraft_reference import continuation_error, random_laws, tree_law
from tabular import code, continue_with_target, joint, rows_along

import asps_jax
from asps_jax.controls import penalties
from asps_jax.drafters import lookup
from asps_jax.verify import chain

# --------------------------------------------------------------------------------------------
# The search


def _search(text, ngram, *, num_chains=1, draft_len=4, cap=None, width=24):
    text_h = np.full(width, -1, np.int32)
    text_h[: len(text)] = text
    tokens, lengths = jax.jit(
        lookup.row_candidates, static_argnames=("ngram", "num_chains", "draft_len")
    )(
        jnp.asarray(text_h),
        jnp.int32(len(text)),
        ngram=ngram,
        cap=draft_len if cap is None else cap,
        num_chains=num_chains,
        draft_len=draft_len,
    )
    tokens, lengths = np.asarray(tokens), np.asarray(lengths)
    return [tokens[k, : lengths[k]].tolist() for k in range(num_chains)]


def test_most_recent_occurrence_wins():
    # [1, 2] ends the text; it occurred at 1..2 (then 3 9 9 1) and at 6..7 (then 3 7 8 1).
    assert _search([5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2], 2) == [[3, 7, 8, 1]]


def test_k_most_recent_distinct_continuations():
    text = [1, 2, 3, 4, 1, 2, 8, 8, 1, 2, 8, 8, 1, 2]
    # Occurrences end at 9 (then 8 8 1 2), 5 (8 8 1 2: the same window, skipped), 1 (3 4 1 2).
    assert _search(text, 2, num_chains=3) == [[8, 8, 1, 2], [3, 4, 1, 2], []]


def test_overlapping_occurrences_and_the_window_stops_at_the_root():
    # Every [1, 1] is an occurrence of the suffix; the continuation never passes the last token.
    assert _search([1, 1, 1, 1, 1], 2, num_chains=3) == [[1], [1, 1], [1, 1, 1]]
    assert _search([7, 1, 7, 1, 7], 2) == [[1, 7]]  # occurrence 2..3 overlaps the suffix 3..4


@pytest.mark.parametrize(
    "text, ngram",
    [([1, 2, 3, 4], 2), ([3, 3], 3), ([4], 1), ([1, 2, 1, 3], 2)],
    ids=["absent", "shorter than m", "one token", "only a partial match"],
)
def test_no_match_drafts_nothing(text, ngram):
    assert _search(text, ngram, num_chains=2) == [[], []]


def test_lookup_max_caps_the_chain():
    assert _search([1, 2, 3, 4, 5, 6, 1, 2], 2, cap=2) == [[3, 4]]
    assert _search([1, 2, 3, 4, 5, 6, 1, 2], 1, draft_len=3) == [[3, 4, 5]]


@pytest.mark.slow
def test_match_across_the_prompt_generated_boundary():
    """The searched suffix spans the last prompt token and the generated ones, and the copied
    continuation runs from the prompt into the generated text."""
    prompts = jnp.asarray([[4, 5, 6, 7, 9, 4, 0, 0]], jnp.int32)
    history = penalties.History.init(prompts, jnp.asarray([6]), 12, 8)
    # Generated: 5 6 -> the text is 4 5 6 7 9 4 5 6; the suffix 4 5 6 matched at 0..2.
    history = history.append(jnp.asarray([[5, 6, 0]], jnp.int32), jnp.asarray([2]))
    tokens, laws, lengths = lookup.lookup_drafts(
        history, ngram=3, cap=4, num_chains=1, draft_len=4, vocab=12
    )
    assert np.asarray(lengths).tolist() == [[4]]
    assert np.asarray(tokens)[0, 0].tolist() == [7, 9, 4, 5]  # 4 5: the generated text's start
    point = np.asarray(laws)[0, 0]
    assert np.all(point[np.arange(4), [7, 9, 4, 5]] == 0.0)
    assert np.sum(np.isfinite(point)) == 4


# --------------------------------------------------------------------------------------------
# Exact enumeration: point-mass drafts keep the target's law


def _point_mass_model(chain_tokens, vocab):
    """A tabular draft whose law at depth i is a point mass on ``chain_tokens[i]`` after every
    prefix (only the chain's own prefix is ever read)."""
    return [
        np.broadcast_to(np.eye(vocab)[t], (vocab,) * i + (vocab,)).copy()
        for i, t in enumerate(chain_tokens)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sps", "asps"])
@pytest.mark.parametrize("sparse", [0.0, 0.5], ids=["dense", "zeros"])
def test_single_chain_law_is_exact_by_enumeration(method, sparse):
    """Every lookup chain of length 0..n, the code's outcome law (float64) continued by the target
    equals the target's joint law over n + 1 tokens (zeros: draft tokens of probability 0)."""
    vocab, n = 4, 3
    rng = np.random.default_rng(3)
    outcome = {"sps": chain.sps_outcome_logweights, "asps": chain.asps_outcome_logweights}[method]
    target = random_laws(rng, vocab, n + 1, sparse=sparse)
    for chain_tokens in ([2, 0, 3], [1, 1, 1]):
        x = np.asarray(chain_tokens)[None]
        p_rows = rows_along(target, x, n + 1)[0]
        with jax.enable_x64(True):
            lq = np.asarray(lookup.point_mass_laws(jnp.asarray(x[0]), vocab), np.float64)
            for length in range(n + 1):
                stop, log_full = outcome(jnp.asarray(x[0]), lq, jnp.log(p_rows), length)
                stop, full = np.exp(np.asarray(stop)), float(np.exp(log_full))
                emitted = [np.zeros(vocab ** (m + 1)) for m in range(n + 1)]
                for t in range(length):
                    at = code(x[:, :t], vocab)[0] * vocab + np.arange(vocab)
                    emitted[t][at] += stop[t]
                at = code(x[:, :length], vocab)[0] * vocab + np.arange(vocab)
                emitted[length][at] += full * p_rows[length]
                law = continue_with_target(emitted, target)
                np.testing.assert_allclose(law, joint(target, n + 1), atol=1e-12)


@pytest.mark.parametrize("scheme", ["specinfer", "spectr", "is_default"])
@pytest.mark.parametrize(
    "chains, lengths",
    [([[2, 0], [1, 3]], [2, 2]), ([[2, 0], [2, 3]], [2, 1]), ([[1, 1], [0, 2]], [1, 0])],
    ids=["distinct roots", "shared root (a branch)", "short and empty"],
)
def test_multi_draft_law_is_exact_by_enumeration(scheme, chains, lengths):
    """K point-mass chains through the library's node scheme (the tree walk of
    multidraft_reference.py, with the ASpS tail): the emitted law continued by the target is the
    target's. Chains sharing a root token form a branch; the repeat is rejected with certainty."""
    vocab, n = 4, 2
    target = random_laws(np.random.default_rng(5), vocab, n + 1, sparse=0.3)
    drafts = [_point_mass_model(c, vocab) for c in chains]
    law, marginal = tree_law(node_law(scheme, vocab), target, drafts, n, lengths, tail=True)
    assert continuation_error(law, target, n) < 1e-9
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)


# --------------------------------------------------------------------------------------------
# Statistical: sample(draft="lookup") against transformers' exact law

VOCAB = 12
ROWS = 2500
SETTINGS = [
    dict(temperature=1.0, top_k=0, top_p=1.0),
    dict(temperature=0.8, top_k=8, top_p=0.9),
]


def _warp(logits, temperature, top_k, top_p, bias=None):
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = logits[None].clone()
    if bias is not None:
        scores = scores + bias
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores[0].double(), -1).numpy()


def _two_token_law(hf, prompt, bias=None, **setting):
    with torch.no_grad():
        p1 = _warp(hf(torch.tensor([prompt])).logits[0, -1], bias=bias, **setting)
        second = hf(torch.tensor([prompt + [x] for x in range(VOCAB)])).logits[:, -1]
        p2 = np.stack([_warp(second[x], bias=bias, **setting) for x in range(VOCAB)])
    return p1[:, None] * p2


@pytest.fixture(scope="module")
def copy_case(tmp_path_factory):
    """A tiny target and a prompt ``1 5 c c' 2 1 5 d d' 1 5`` whose suffix ``1 5`` recurs: the
    lookup drafts ``d d'`` (most recent) and ``c c'``; ``d d'`` is the pair the target is likeliest
    to copy, so acceptances are frequent."""
    path = tmp_path_factory.mktemp("lookup") / "target"
    hf = write_tiny_llama(path, seed=0, vocab_size=VOCAB, initializer_range=0.4)
    model = asps_jax.load_model(str(path))
    c = [3, 7]
    pairs = [(a, b) for a in range(VOCAB) for b in range(VOCAB) if a != c[0]]
    prompts = [[1, 5, *c, 2, 1, 5, a, b, 1, 5] for a, b in pairs]
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor(prompts)).logits[:, -1].double(), -1)
        seconds = torch.tensor([p + [a] for p, (a, _) in zip(prompts, pairs)])
        p2 = torch.softmax(hf(seconds).logits[:, -1].double(), -1)
    score = [p1[i, a] * p2[i, b] for i, (a, b) in enumerate(pairs)]
    best = int(np.argmax(score))
    return hf, model, prompts[best]


def _chi_square(counts, law):
    from scipy import stats

    expected = law.reshape(-1) * counts.sum()
    observed = counts.reshape(-1)
    assert observed[expected == 0].sum() == 0, "a zero-probability string was emitted"
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, num_drafts, banned_half",
    [("sps", 1, False), ("asps", 1, True), ("specinfer", 2, False)],
    ids=["sps", "asps, and a half with the draft token banned", "specinfer K=2"],
)
def test_sample_law_with_lookup(copy_case, method, num_drafts, banned_half):
    """ROWS rows per setting in one jitted call; the first two tokens against transformers. For
    asps a second half of the rows (the same call: logit_bias is one dict per prompt) bans the
    most recent chain's first token, so that draft is always rejected."""
    hf, model, prompt = copy_case
    banned = prompt[7]  # the most recent chain's first token: banned by logit_bias, rejected
    biases = [None, {banned: -float("inf")}] if banned_half else [None]
    groups = [(bias, setting) for bias in biases for setting in SETTINGS]
    per_row = {k: np.repeat([s[k] for _, s in groups], ROWS) for k in SETTINGS[0]}
    logit_bias = [bias or {} for bias, _ in groups for _ in range(ROWS)] if banned_half else None
    out = asps_jax.sample(
        model,
        "lookup",
        [prompt] * (ROWS * len(groups)),
        key=jax.random.key(11),
        max_new_tokens=2,
        method=method,
        num_drafts=num_drafts,
        num_draft_tokens=2,
        lookup_ngram=2,
        eos_token_id=-1,
        logit_bias=logit_bias,
        **per_row,
    )
    tokens = np.asarray(out.tokens)
    unbiased = slice(0, ROWS * len(SETTINGS))
    stats = out.stats
    assert float(np.mean(np.asarray(stats["decisions"]))) > 0.5  # the lookup drafted
    assert float(np.mean(np.asarray(stats["accepted"])[unbiased])) > 0.05
    for i, (bias, setting) in enumerate(groups):
        rows = tokens[i * ROWS : (i + 1) * ROWS]
        counts = np.zeros((VOCAB, VOCAB))
        np.add.at(counts, (rows[:, 0], rows[:, 1]), 1)
        torch_bias = None
        if bias:
            torch_bias = torch.zeros(VOCAB)
            torch_bias[banned] = -float("inf")
        law = _two_token_law(hf, prompt, bias=torch_bias, **setting)
        pvalue = _chi_square(counts, law)
        assert pvalue > 1e-3, f"{method} {setting} bias={bias}: chi-square p-value {pvalue:.2e}"


# --------------------------------------------------------------------------------------------
# Bad options


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(draft="lookups"), "draft: unknown drafter 'lookups'"),
        (dict(lookup_ngram=0), "lookup_ngram must be an integer >= 1"),
        (dict(lookup_max=0), "lookup_max must be an integer >= 1"),
        (dict(lookup_ngram=2.5), "lookup_ngram must be an integer >= 1"),
        (dict(method="tv", num_drafts=2), "draft='lookup': method 'tv'"),
        (dict(draft_stop="confidence:0.5"), "draft_stop: a lookup draft has no draft law"),
    ],
)
def test_bad_lookup_options_are_one_line_errors(copy_case, kwargs, match):
    _, model, prompt = copy_case
    kwargs = {"draft": "lookup", "method": "asps", **kwargs}
    with pytest.raises(ValueError, match=match) as err:
        asps_jax.sample(
            model, kwargs.pop("draft"), [prompt], key=jax.random.key(0), max_new_tokens=2, **kwargs
        )
    assert "\n" not in str(err.value)


def test_lookup_options_need_draft_lookup(copy_case):
    _, model, prompt = copy_case
    with pytest.raises(ValueError, match="lookup_ngram is an option of draft='lookup'"):
        asps_jax.sample(
            model, model, [prompt], key=jax.random.key(0), max_new_tokens=2, lookup_ngram=2
        )


# --------------------------------------------------------------------------------------------
# The command line


def _load_cli():
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "sample.py"
    spec = importlib.util.spec_from_file_location("sample_cli_lookup", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_cli_draft_lookup_runs(capsys):
    import json

    cli = _load_cli()
    prompt = "ROMEO: But soft, what light. ROMEO: But soft, what light. ROMEO: But soft"
    argv = ["--draft", "lookup", "--lookup-ngram", "2", "--lookup-max", "3", "--prompt", prompt]
    assert cli.main(argv + ["--max-new-tokens", "6", "--temperature", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_draft_tokens"] == 3 and out["new_tokens"] == 6


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--lookup-ngram", "0"], "argument --lookup-ngram: expected a positive integer"),
        (["--lookup-max", "x"], "argument --lookup-max: expected a positive integer"),
        (["--num-draft-tokens", "often"], "expected a positive integer or 'auto'"),
    ],
)
def test_cli_bad_lookup_flags_exit_with_one_line(capsys, argv, needle):
    cli = _load_cli()
    with pytest.raises(SystemExit) as info:
        cli.main(["--draft", "lookup", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err


def test_cli_lookup_with_a_tree_method_is_one_line(capsys):
    cli = _load_cli()
    assert cli.main(["--draft", "lookup", "--method", "tv", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "draft='lookup': method 'tv'" in err
