"""The sampling controls (logit bias, repetition / presence / frequency penalties, no-repeat
n-grams, min-p, typical-p) and top_logprobs.

Expected values come from transformers' own processors (``RepetitionPenaltyLogitsProcessor``,
``NoRepeatNGramLogitsProcessor``, ``SequenceBiasLogitsProcessor``, ``MinPLogitsWarper``,
``TypicalLogitsWarper`` and the warpers; presence / frequency are OpenAI's formula, written out),
from transformers forwards and ``generate``, and from the NumPy reference in controls_reference.py
(cross-checked against transformers here).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tabular as tab
import torch
import transformers
from controls_reference import law, warped_probs
from test_decode import PROMPT, VOCAB, _chi_square_pvalue, write_pair

import asps_jax
from asps_jax import decode, sampler, trees
from asps_jax.controls import penalties
from asps_jax.controls.processors import SamplingParams
from asps_jax.verify.tree import tree_outcome

# A path-dependent setting: every control changes the law, and differently along each path.
CONTROLS = dict(
    logit_bias={3: -np.inf, 5: 1.5},
    repetition_penalty=1.8,
    presence_penalty=0.6,
    frequency_penalty=0.4,
    no_repeat_ngram_size=2,
)
WARP = dict(temperature=0.9, top_k=0, top_p=1.0, min_p=0.08)


def _hf_processed(logits, text, generated, controls, warp):
    """One law through transformers' processors (presence / frequency by OpenAI's formula)."""
    from transformers import (
        MinNewTokensLengthLogitsProcessor,
        MinPLogitsWarper,
        NoBadWordsLogitsProcessor,
        NoRepeatNGramLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
        TypicalLogitsWarper,
    )

    ids = torch.tensor([list(text)], dtype=torch.long)
    scores = torch.as_tensor(np.asarray(logits, np.float32))[None].clone()
    if controls.get("logit_bias"):
        bias = {(int(t),): float(b) for t, b in controls["logit_bias"].items()}
        scores = SequenceBiasLogitsProcessor(bias)(ids, scores)
    if controls.get("repetition_penalty", 1.0) != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(controls["repetition_penalty"])(ids, scores)
    new = list(text)[len(text) - generated :] if generated else []
    for token in set(new):
        scores[0, token] -= controls.get("presence_penalty", 0.0)
        scores[0, token] -= controls.get("frequency_penalty", 0.0) * new.count(token)
    if controls.get("no_repeat_ngram_size", 0):
        scores = NoRepeatNGramLogitsProcessor(controls["no_repeat_ngram_size"])(ids, scores)
    if controls.get("min_tokens", 0) and controls.get("eos_ids"):
        limit = MinNewTokensLengthLogitsProcessor(
            len(text) - generated, controls["min_tokens"], list(controls["eos_ids"])
        )
        scores = limit(ids, scores)
    if controls.get("bad_words"):
        words = [list(map(int, w)) for w in controls["bad_words"]]
        scores = NoBadWordsLogitsProcessor(words)(ids, scores)
    if warp.get("temperature", 1.0) == 0:
        return warped_probs(scores[0].double().numpy(), temperature=0)
    scores = TemperatureLogitsWarper(warp.get("temperature", 1.0))(ids, scores)
    if warp.get("top_k"):
        scores = TopKLogitsWarper(warp["top_k"])(ids, scores)
    if warp.get("top_p", 1.0) < 1.0:
        scores = TopPLogitsWarper(warp["top_p"])(ids, scores)
    if warp.get("min_p", 0.0) > 0:
        scores = MinPLogitsWarper(warp["min_p"])(ids, scores)
    if warp.get("typical_p", 1.0) < 1.0:
        scores = TypicalLogitsWarper(warp["typical_p"])(ids, scores)
    return torch.softmax(scores[0].double(), -1).numpy()


def _random_case(rng, vocab):
    prompt = rng.integers(0, vocab, rng.integers(1, 8)).tolist()
    generated = rng.integers(0, vocab, rng.integers(0, 8)).tolist()
    controls = dict(
        logit_bias={int(t): float(rng.normal()) for t in rng.integers(0, vocab, 3)},
        repetition_penalty=float(rng.choice([0.7, 1.0, 1.3, 2.5])),
        presence_penalty=float(rng.choice([0.0, 0.5, -0.3])),
        frequency_penalty=float(rng.choice([0.0, 0.25, 1.0])),
        no_repeat_ngram_size=int(rng.integers(0, 4)),
        min_tokens=max(len(generated) + int(rng.integers(-1, 3)), 0),  # around the boundary
        eos_ids=[1, 6],  # one list for every row, as the library has it
        # one-token words and longer ones, some of which end the text (their last token banned)
        bad_words=[[int(rng.integers(vocab))]]
        + [list(generated[-k:]) + [int(rng.integers(vocab))] for k in (1, 2) if len(generated) >= k]
        + [rng.integers(0, vocab, 3).tolist()],
    )
    warp = dict(
        temperature=float(rng.choice([0.7, 1.0, 1.5])),
        top_k=int(rng.choice([0, 5])),
        top_p=float(rng.choice([1.0, 0.9])),
        min_p=float(rng.choice([0.0, 0.05, 0.2])),
    )
    return prompt, generated, controls, warp


@pytest.mark.slow
def test_reference_and_library_match_transformers_processors():
    """On random logits and texts (min_tokens and bad words included): the NumPy reference
    against transformers' processors, and
    asps_jax (penalties.apply_controls + SamplingParams.process, rows of different settings, each
    law at a node below the committed text) against both."""
    rng = np.random.default_rng(0)
    vocab, cases = 20, 24
    rows = []
    for _ in range(cases):
        prompt, generated, controls, warp = _random_case(rng, vocab)
        logits = rng.normal(size=vocab).astype(np.float32) * 2.0
        logits[controls["eos_ids"]] += 3.0  # likely: min_tokens' ban of them shows in the law
        text = prompt + generated
        expected = _hf_processed(logits, text, len(generated), controls, warp)
        ours = law(logits, text, len(generated), controls, warp)
        np.testing.assert_allclose(ours, expected, atol=1e-6)
        rows.append((prompt, generated, controls, warp, logits, expected))

    # The library: committed text = prompt + the first half of the generated tokens, and the
    # law at a node whose path is the rest (so both the history and the path carry counts).
    path_len = 8
    prompts = np.zeros((cases, 8), np.int32)
    prompt_lengths = np.array([len(r[0]) for r in rows], np.int32)
    for b, r in enumerate(rows):
        prompts[b, : len(r[0])] = r[0]
    history = penalties.History.init(jnp.asarray(prompts), jnp.asarray(prompt_lengths), vocab, 16)
    block = np.full((cases, path_len), -1, np.int32)
    path = np.zeros((cases, 1, path_len), np.int32)
    committed, depth = np.zeros(cases, np.int32), np.zeros((cases, 1), np.int32)
    for b, r in enumerate(rows):
        half = len(r[1]) // 2
        committed[b] = half
        block[b, :half] = r[1][:half]
        depth[b, 0] = len(r[1]) - half
        path[b, 0, : depth[b, 0]] = r[1][half:]
    history = history.append(jnp.asarray(block), jnp.asarray(committed))
    bias = np.zeros((cases, vocab), np.float32)
    for b, r in enumerate(rows):
        for t, v in r[2]["logit_bias"].items():
            bias[b, t] += v  # a dict keeps the last value of a repeated id, like the processor
    sampling = SamplingParams.make(
        cases,
        temperature=[r[3]["temperature"] for r in rows],
        top_k=[r[3]["top_k"] for r in rows],
        top_p=[r[3]["top_p"] for r in rows],
        min_p=[r[3]["min_p"] for r in rows],
        repetition_penalty=[r[2]["repetition_penalty"] for r in rows],
        presence_penalty=[r[2]["presence_penalty"] for r in rows],
        frequency_penalty=[r[2]["frequency_penalty"] for r in rows],
        no_repeat_ngram_size=[r[2]["no_repeat_ngram_size"] for r in rows],
        logit_bias=bias,
        eos_ids=[1, 6],
        min_tokens=[r[2]["min_tokens"] for r in rows],
        bad_words=_left_padded([r[2]["bad_words"] for r in rows]),
    )
    logits = jnp.asarray(np.stack([r[4] for r in rows]))[:, None]
    lp, has_mass = penalties.process(sampling, history, logits, jnp.asarray(path), depth)
    assert bool(jnp.all(has_mass))
    for b, r in enumerate(rows):
        np.testing.assert_allclose(np.exp(np.asarray(lp[b, 0], np.float64)), r[5], atol=2e-6)


def _left_padded(words_per_row):
    """int32[B, W, L] of each row's token-id words, -1 padded on the left and below."""
    width = max(len(w) for words in words_per_row for w in words)
    count = max(len(words) for words in words_per_row)
    out = np.full((len(words_per_row), count, width), -1, np.int32)
    for b, words in enumerate(words_per_row):
        for i, w in enumerate(words):
            out[b, i, width - len(w) :] = w
    return out


@pytest.mark.slow
def test_ngram_bans_cover_history_and_path_windows():
    """Literal cases: an n-gram that spans the committed text and the node's path, one inside the
    path, none when the text is shorter than n, and n = 1 (every token of the text)."""
    vocab = 8
    history = penalties.History.init(jnp.array([[1, 2, 3, 1]]), jnp.array([4]), vocab, 8)

    process = jax.jit(penalties.process)  # one compile per n-gram window

    def banned(n, path):
        sampling = SamplingParams.make(1, no_repeat_ngram_size=n)
        path_arr = jnp.asarray([[path + [0] * (4 - len(path))]], jnp.int32)
        lp, _ = process(
            sampling, history, jnp.zeros((1, 1, vocab)), path_arr, jnp.array([[len(path)]])
        )
        return np.flatnonzero(np.asarray(lp[0, 0]) == -np.inf).tolist()

    assert banned(2, []) == [2]  # text 1 2 3 1: after "1", 2 followed 1
    assert banned(3, [2]) == [3]  # text 1 2 3 1 2: "1 2" was followed by 3
    assert banned(3, [4, 4]) == []  # "4 4" never occurred before
    assert banned(2, [4, 4]) == [4]  # "4 4" itself: after "4", 4 occurred (in the path)
    assert banned(1, [6]) == [1, 2, 3, 6]
    assert banned(6, []) == []  # shorter than n
    assert banned(0, [1, 2]) == []


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    hf_target, target, draft = write_pair(root)
    hf_draft = transformers.LlamaForCausalLM.from_pretrained(root / "draft")
    return hf_target, hf_draft, target, draft


def _last_logits(hf_model, texts):
    with torch.no_grad():
        return np.stack([hf_model(torch.tensor([list(t)])).logits[0, -1].numpy() for t in texts])


# One decode step's laws for each tree layout: K chains verified chain by chain or token by token
# (sps, asps, specinfer, spectr, is, optimal share this code path: the draft rollout and the
# target laws along each chain), K chains as a tree (tv, tv_wr, is_bv with num_drafts), and a
# branching tree drawn without replacement (tv; is_bv / tv_wr draw it independently, the same
# node laws).
LAYOUTS = [
    ("specinfer", dict(num_drafts=2, num_draft_tokens=3)),
    ("tv_wr", dict(num_drafts=2, num_draft_tokens=2)),
    ("tv", dict(tree=(2, 2))),
]


@pytest.mark.slow
@pytest.mark.parametrize("method, shape", LAYOUTS)
def test_every_node_law_is_processed_from_its_own_path(models, method, shape):
    """With generated tokens in the committed text, the draft law and the target law at every
    node of a step's tree equal transformers' processors applied to the model's logits after
    that node's own text (prompt + generated + the node's path). The verifiers are exact for
    arbitrary laws per node, so this is what keeps every method's output law exact."""
    hf_target, hf_draft, target, draft = models
    prompts = [PROMPT, [4, 7, 9, 1, 0, 11, 6]]
    generated = [[1, 9, 1, 4], [6, 6, 2, 7]]  # committed as if generated (the models' caches
    # hold the prompt only: the logits come from the prompt, the controls from the whole text)
    controls = dict(CONTROLS, no_repeat_ngram_size=[2, 3], repetition_penalty=[1.8, 0.6])
    call = sampler.prepare(
        target, draft, prompts, key=jax.random.key(3), max_new_tokens=8, method=method,
        eos_token_id=-1, draft_temperature=1.2, **controls, **WARP, **shape,
    )  # fmt: skip
    dec, inputs = call.decoder, call.inputs
    spec = dec.spec
    state = decode.prefill(dec, **inputs.prefill_kwargs())
    block = np.full((state.root.shape[0], 4), -1, np.int32)
    block[:2] = generated
    history = state.history.append(jnp.asarray(block), jnp.array([4, 4] + [0] * (len(block) - 2)))
    state = dataclasses.replace(state, history=history)

    @jax.jit
    def laws(inputs, state):
        drafts = decode._draft(dec, inputs.draft_params, inputs.sampling, state)
        target_lp, _, _, _ = decode._score(
            dec, inputs.target_params, inputs.sampling, state, drafts
        )
        return drafts, target_lp

    drafts, target_lp = laws(inputs, state)
    tree = spec.tree.nodes
    node_tokens_BN = np.asarray(drafts.tokens_BN)
    scored_BN = np.asarray(drafts.scored_BN)
    draft_lp = np.asarray(drafts.logprobs_BNV, np.float64)
    target_lp = np.asarray(target_lp, np.float64)
    checked = 0

    def check(hf_model, b, paths, ours, warp):
        nonlocal checked
        text = prompts[b] + generated[b]
        raw = _last_logits(hf_model, [prompts[b] + p for p in paths])
        for path, lp, logits in zip(paths, ours, raw):
            expected = _hf_processed(
                logits, text + path, len(generated[b]) + len(path), _row(controls, b), warp
            )
            np.testing.assert_allclose(np.exp(lp), expected, atol=2e-5, err_msg=str(path))
            checked += 1

    def path(b, i, last):  # the tokens of node i's root path below the root, up to depth last
        return node_tokens_BN[b, tree.paths[i, 1 : last + 1]].tolist()

    for b in range(len(prompts)):
        # Every node's draft law, from its own path (its ancestors' tokens).
        nodes = range(1, tree.num_nodes)
        paths = [path(b, i, tree.depth[i] - 1) for i in nodes]
        check(hf_draft, b, paths, [draft_lp[b, i] for i in nodes], dict(WARP, temperature=1.2))
        # Every target law the verifier reads: the scored slots' (node i: after its path).
        nodes = [i for i in range(tree.num_nodes) if scored_BN[b, i] == i]
        paths = [path(b, i, tree.depth[i]) for i in nodes]
        check(hf_target, b, paths, [target_lp[b, i] for i in nodes], WARP)
    assert checked >= 12


def _row(controls, b):
    return {k: (v[b] if isinstance(v, list) else v) for k, v in controls.items()}


def _exact_two_token_law(hf_target, controls, warp):
    first = _last_logits(hf_target, [PROMPT])[0]
    p1 = _hf_processed(first, PROMPT, 0, controls, warp)
    second = _last_logits(hf_target, [PROMPT + [x] for x in range(VOCAB)])
    p2 = np.stack([_hf_processed(second[x], PROMPT + [x], 1, controls, warp) for x in range(VOCAB)])
    return p1[:, None] * p2


# One compiled run per method serves three tests: STAT_ROWS rows of each law setting, then the
# greedy rows (per-row temperature 0), with top_logprobs on.
STAT_ROWS = 6_000
NEW = 6
EOS = 7
# min_tokens = NEW bans the EOS id (made likely by a bias) at every token the tests read; bad
# words ban token 1 everywhere and 9 after 4.
LIMITS = dict(min_tokens=NEW, eos_ids=[EOS], bad_words=[[1], [4, 9]])
SETTINGS = [
    (dict(CONTROLS, logit_bias={3: -np.inf, 5: 1.5, EOS: 1.0}, **LIMITS), WARP),
    (dict(repetition_penalty=0.5, presence_penalty=0.3, frequency_penalty=-0.8, **LIMITS), {}),
    # typical-p last, after min-p (transformers' TypicalLogitsWarper)
    (dict(repetition_penalty=1.3, **LIMITS), dict(temperature=0.9, min_p=0.05, typical_p=0.5)),
]
GREEDY_PROMPTS = [PROMPT, [4, 7, 9, 1, 0, 11, 6], [2]]
GREEDY = dict(
    repetition_penalty=1.7,
    no_repeat_ngram_size=2,
    logit_bias={4: -2.0},
    bad_words=[[0], [3, 2]],
    min_tokens=NEW,
    eos_ids=[EOS],
)
# A greedy row whose EOS is the argmax: min_tokens holds it off for exactly 3 tokens.
GREEDY_EOS = dict(GREEDY, logit_bias={EOS: 50.0}, min_tokens=3)
TOP = 4
RUNS = {
    "ar": {},
    "asps": dict(num_drafts=1, num_draft_tokens=3),
    "specinfer": dict(num_drafts=2, num_draft_tokens=2),
    "tv": dict(tree=(2, 2)),
}


@pytest.fixture(scope="module")
def run(models):
    _, _, target, draft = models
    done = {}

    def get(method):
        if method in done:
            return done[method]
        settings = [s for s in SETTINGS for _ in range(STAT_ROWS)]
        # (typical-p on the greedy rows: a greedy decode is transformers' with no warper)
        settings += [(GREEDY, dict(temperature=0.0, typical_p=0.3))] * len(GREEDY_PROMPTS)
        settings += [(GREEDY_EOS, dict(temperature=0.0))]
        per_row = {
            name: [c.get(name, d) for c, _ in settings]
            for name, d in (
                ("repetition_penalty", 1.0),
                ("presence_penalty", 0.0),
                ("frequency_penalty", 0.0),
                ("no_repeat_ngram_size", 0),
                ("min_tokens", 0),
                ("bad_words", []),
            )
        }
        per_row.update(
            {
                name: [w.get(name, d) for _, w in settings]
                for name, d in (("temperature", 1.0), ("min_p", 0.0), ("typical_p", 1.0))
            }
        )
        done[method] = asps_jax.sample(
            target, draft if method != "ar" else None,
            [PROMPT] * (len(settings) - len(GREEDY_PROMPTS) - 1) + GREEDY_PROMPTS + [PROMPT],
            key=jax.random.key(11), max_new_tokens=NEW, method=method, eos_token_id=EOS,
            logit_bias=[c.get("logit_bias", {}) for c, _ in settings], return_logprobs=True,
            top_logprobs=TOP, **per_row, **RUNS[method],
        )  # fmt: skip
        return done[method]

    return get


@pytest.mark.slow
@pytest.mark.optimized  # the law run outweighs its compile (tests/conftest.py)
@pytest.mark.parametrize("method", RUNS)
def test_first_two_tokens_follow_the_processed_target_law(models, run, method):
    """End to end through asps_jax.sample: the first two tokens (one step decides both when the
    first draft token is accepted, two steps when not) against transformers' processors."""
    hf_target = models[0]
    tokens = np.asarray(run(method).tokens)
    for i, (controls, warp) in enumerate(SETTINGS):
        rows = tokens[i * STAT_ROWS : (i + 1) * STAT_ROWS]
        counts = np.zeros((VOCAB, VOCAB))
        np.add.at(counts, (rows[:, 0], rows[:, 1]), 1)
        expected = _exact_two_token_law(hf_target, controls, warp)
        pvalue = _chi_square_pvalue(counts, expected)
        assert pvalue > 1e-3, f"{method} setting {i}: chi-square p-value {pvalue:.2e}"


def _hf_generate(hf_model, prompt, max_new, **kwargs):
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
            pad_token_id=0, **{"eos_token_id": None, **kwargs},
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("method", RUNS)
def test_greedy_matches_transformers_generate(models, run, method):
    """temperature 0 with repetition_penalty, no_repeat_ngram_size, a logit bias, bad words and
    min_tokens is transformers' ``generate(repetition_penalty=..., no_repeat_ngram_size=...,
    sequence_bias=..., bad_words_ids=..., min_new_tokens=..., eos_token_id=...)`` greedy
    decoding, token for token, over several steps (the history carries across steps); a row
    whose EOS is the argmax ends right after its min_tokens."""
    hf_target = models[0]
    out = run(method)
    first = len(SETTINGS) * STAT_ROWS
    for b, (prompt, controls) in enumerate(
        [(p, GREEDY) for p in GREEDY_PROMPTS] + [(PROMPT, GREEDY_EOS)]
    ):
        expected = _hf_generate(
            hf_target, prompt, NEW, repetition_penalty=controls["repetition_penalty"],
            no_repeat_ngram_size=controls["no_repeat_ngram_size"],
            sequence_bias={(t,): v for t, v in controls["logit_bias"].items()},
            bad_words_ids=controls["bad_words"], min_new_tokens=controls["min_tokens"],
            eos_token_id=EOS,
        )  # fmt: skip
        length = int(out.lengths[first + b])
        assert np.asarray(out.tokens[first + b, :length]).tolist() == expected, (method, b)
    assert int(out.lengths[first + len(GREEDY_PROMPTS)]) == GREEDY_EOS["min_tokens"] + 1


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "tv"])
def test_top_logprobs_are_the_processed_law_of_each_emitted_token(models, run, method):
    """``top_logprobs`` and ``logprobs`` of every emitted token against the law recomputed from
    a transformers forward of its text and transformers' processors."""
    hf_target = models[0]
    out = run(method)
    ids, lps = (np.asarray(a) for a in out.top_logprobs)
    assert ids.shape[1:] == (NEW, TOP) and lps.shape == ids.shape
    rows = [0, 1, STAT_ROWS, STAT_ROWS + 1]  # both settings
    for b in rows:
        controls, warp = SETTINGS[b // STAT_ROWS]
        tokens = np.asarray(out.tokens[b]).tolist()
        texts = [PROMPT + tokens[:t] for t in range(NEW)]
        for t, logits in enumerate(_last_logits(hf_target, texts)):
            expected = _hf_processed(logits, texts[t], t, controls, warp)
            order = np.argsort(-expected, kind="stable")[:TOP]
            with np.errstate(divide="ignore"):
                np.testing.assert_allclose(lps[b, t], np.log(expected[order]), atol=1e-4)
                np.testing.assert_allclose(
                    out.logprobs[b, t], np.log(expected[tokens[t]]), atol=1e-4
                )
            finite = expected[order] > 0
            assert ids[b, t][finite].tolist() == order[finite].tolist()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
        (dict(repetition_penalty=-1.2), "repetition_penalty must be"),
        (dict(presence_penalty=np.nan), "presence_penalty must be a finite number"),
        (dict(frequency_penalty=[np.inf]), "frequency_penalty must be a finite number"),
        (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size must be an integer >= 0"),
        (dict(no_repeat_ngram_size=2.5), "no_repeat_ngram_size must be an integer"),
        (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
        (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"),
        (dict(logit_bias={VOCAB: 1.0}), "logit_bias: token id 12 lies outside"),
        (dict(logit_bias={-1: 1.0}), "logit_bias: token id -1 lies outside"),
        (dict(logit_bias={2: np.inf}), "logit_bias: the bias of token 2 must be"),
        (dict(logit_bias={2: "x"}), "logit_bias: the bias of token 2 must be"),
        (dict(logit_bias=[{2: 1.0}, {}]), "one per prompt"),
        (dict(logit_bias=[(2, 1.0)]), "logit_bias must be a"),
        (dict(top_logprobs=3), "top_logprobs needs return_logprobs=True"),
        (dict(top_logprobs=-1, return_logprobs=True), "top_logprobs must be an integer >= 0"),
        (dict(top_logprobs=VOCAB + 1, return_logprobs=True), "at most the vocabulary size 12"),
        (dict(repetition_penalty=[1.0, 2.0]), "one value per prompt"),
        (dict(min_tokens=-1), "min_tokens must be an integer >= 0"),
        (dict(min_tokens=1.5), "min_tokens must be an integer >= 0"),
        (dict(bad_words="x"), "bad_words must be a list"),
        (dict(bad_words=["x"]), "has no tokenizer to tokenize 'x' with; give token-id lists"),
        (dict(bad_words=[" "]), "each must be a non-empty string or a non-empty list"),
        (dict(bad_words=[[1, "a"]]), "each must be a non-empty string or a non-empty list"),
        (dict(bad_words=[[2, VOCAB]]), r"bad_words: \[2, 12\] has a token id outside"),
        (dict(bad_words=[[[1]], [[2]]]), "one list for all prompts or one per prompt"),
    ],
)
def test_bad_control_values_are_one_line_errors(models, kwargs, match):
    _, _, target, draft = models
    with pytest.raises(ValueError, match=match) as info:
        asps_jax.sample(target, draft, [PROMPT], key=jax.random.key(0), max_new_tokens=2, **kwargs)
    assert "\n" not in str(info.value)


def test_controls_change_no_compiled_shape():
    """Values of every control are arrays: two settings of the same controls give the same tree
    structure and shapes (no recompile); n-gram sizes within one power-of-two window share it
    too. Giving a control the call did not give is a new structure (its code enters the
    program: tests/test_program_families.py)."""
    vocab = 10
    a = SamplingParams.make(
        3, repetition_penalty=1.2, no_repeat_ngram_size=2, logit_bias=np.ones(vocab), min_p=0.0,
        presence_penalty=0.0, frequency_penalty=0.5, min_tokens=0,
        bad_words=_left_padded([[[1, 2], [3]]] * 3),
    )  # fmt: skip
    b = SamplingParams.make(
        3, repetition_penalty=[1.0, 2.0, 3.0], no_repeat_ngram_size=[4, 0, 1], min_p=0.3,
        presence_penalty=-1.0, frequency_penalty=2.0, logit_bias=np.zeros((3, vocab)),
        min_tokens=[5, 0, 9], bad_words=_left_padded([[[4], [5, 6]], [[7, 8]], [[9]]]),
    )  # fmt: skip
    shapes = [jax.tree.map(lambda x: (x.shape, x.dtype), s) for s in (a, b)]
    assert jax.tree.structure(a) == jax.tree.structure(b) and shapes[0] == shapes[1]
    assert a.ngram_window == b.ngram_window == 4
    plain = jax.tree.structure(SamplingParams.make(3))
    for given in (
        dict(min_p=0.3), dict(top_k=2), dict(top_p=0.9), dict(presence_penalty=1.0),
        dict(min_tokens=2),
    ):  # fmt: skip
        assert jax.tree.structure(SamplingParams.make(3, **given)) != plain, given
    # bad words enter with their shape: [B, 0, 1] compiles none of their code
    assert SamplingParams.make(3).bad_words.shape == (3, 0, 1) != a.bad_words.shape
    assert SamplingParams.make(3).ngram_window == 0
    assert SamplingParams.make(3, no_repeat_ngram_size=5).ngram_window == 8
    for name in SamplingParams.array_fields():
        assert getattr(a.repeat(2), name).shape[0] in (6, 1)  # eos_ids stays one list


# --- Exact enumeration on tabular models, every method -------------------------------------
# Raw tabular target (depth n + 1) and draft (depth n) laws on V tokens; the law at every prefix
# (= tree node) is processed by asps_jax's penalties.process from the committed text followed by
# that prefix, and checked against the NumPy reference. Every method's exact emitted law, over
# every draw of its tree (chains for the token-level methods, a branching (2, 2) tree for the
# sequence-level ones, as the decode loop draws them), continued by the processed target, must be
# the law of sampling token by token from the processed target.
ENUM_V, ENUM_N = 3, 2
ENUM_PROMPT, ENUM_GENERATED = [0, 1], [2, 0]
ENUM_CONTROLS = {
    "logit_bias": dict(logit_bias={1: -1.5, 2: 0.7}),
    "repetition_penalty": dict(repetition_penalty=2.5),
    "presence_frequency": dict(presence_penalty=0.9, frequency_penalty=0.6),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "min_p": dict(min_p=0.3),
    "typical_p": dict(typical_p=0.5),
    # text ... 2 0 (2 generated): EOS banned at depths 0 and 1, allowed at depth 2
    "min_tokens": dict(min_tokens=4, eos_ids=[1]),
    "bad_words": dict(bad_words=[[0, 1], [2, 0, 2], [1, 1]]),
    "all": dict(
        logit_bias={2: -0.8}, repetition_penalty=0.6, presence_penalty=-0.5,
        frequency_penalty=0.7, no_repeat_ngram_size=3, min_p=0.1, min_tokens=3, eos_ids=[2],
        bad_words=[[0, 0]],
    ),
}  # fmt: skip
ENUM_METHODS = ("sps", "asps", "specinfer", "spectr", "is", "optimal", "tv", "tv_wr", "is_bv")


_ENUM_PROCESS = jax.jit(penalties.process, static_argnames="draft")


def _processed_tables(raw, controls, temperature, draft):
    """``(ours, reference)``: the processed law tables (float64) of the raw log-law tables."""
    vocab = ENUM_V
    bias = np.zeros(vocab, np.float32)
    for t, v in controls.get("logit_bias", {}).items():
        bias[t] = v
    others = {k: v for k, v in controls.items() if k != "logit_bias"}
    if "bad_words" in others:
        others["bad_words"] = _left_padded([others["bad_words"]])
    others_ref = {k: v for k, v in controls.items() if k not in ("min_p", "typical_p")}
    sampling = SamplingParams.make(1, temperature=temperature, logit_bias=bias, **others)
    history = penalties.History.init(
        jnp.asarray([ENUM_PROMPT]), jnp.asarray([len(ENUM_PROMPT)]), vocab, 8
    ).append(jnp.asarray([ENUM_GENERATED]), jnp.asarray([len(ENUM_GENERATED)]))
    text = ENUM_PROMPT + ENUM_GENERATED
    # Every prefix of every depth as one batch of nodes: one compiled call.
    prefixes = [s for i in range(len(raw)) for s in tab.all_strings(vocab, i)]
    path = np.zeros((1, len(prefixes), ENUM_N), np.int32)
    for x, s in enumerate(prefixes):
        path[0, x, : len(s)] = s
    depth = np.array([[len(s) for s in prefixes]])
    logits = np.concatenate([t.reshape(-1, vocab) for t in raw])[None]
    lp, _ = _ENUM_PROCESS(
        sampling, history, jnp.asarray(logits, jnp.float32), jnp.asarray(path), depth, draft=draft
    )
    p = np.exp(np.asarray(lp[0], np.float64))
    reach = p.sum(-1, keepdims=True) > 0  # a prefix every token of which is banned: unused
    p = np.where(reach, p / np.where(reach, p.sum(-1, keepdims=True), 1.0), 1.0 / vocab)
    warp = dict(temperature=temperature, min_p=controls.get("min_p", 0.0))
    warp.update(typical_p=controls.get("typical_p", 1.0))
    ref = np.stack(
        [
            law(row, text + s.tolist(), len(ENUM_GENERATED) + len(s), others_ref, warp)
            for row, s in zip(logits[0], prefixes)
        ]
    )
    ref = np.where(reach, ref, 1.0 / vocab)
    np.testing.assert_allclose(p, ref, atol=2e-6)
    ours, want, start = [], [], 0
    for table in raw:
        size = table.size // vocab
        ours.append(p[start : start + size].reshape(table.shape))
        want.append(ref[start : start + size].reshape(table.shape))
        start += size
    return ours, want


@functools.cache
def _tree_outcome_fn(tree, method):
    """``fn(tokens[M, N], lq[M, N, V], lp[M, N, V]) -> joint [M, N, V]``: P(stop at slot i and
    emit y) of ``verify_tree``'s exact outcome law, for M drawn trees."""
    options = {"rule": "fixed_order"} if method == "is_bv" else {}

    def fn(tokens, lq, lp):
        valid = jnp.ones(tokens.shape, bool)
        stop, emit = tree_outcome(tree, tokens, lq, lp, valid, method, **options)
        return stop[:, None] * emit

    return jax.jit(jax.vmap(fn))


def _enumerated_law(method, target, draft):
    """The method's exact emitted law continued by ``target`` to n + 1 tokens, [V**(n+1)]."""
    import tree_reference as tref
    from multidraft_laws import node_law
    from multidraft_reference import tree_law
    from test_verify_chain import code_outcome

    n, vocab = ENUM_N, ENUM_V
    if method in ("sps", "asps"):
        drafts, weight, q_rows, p_rows = tab.draft_enumeration(target, draft, n)
        stop, full = code_outcome(method, drafts, q_rows, p_rows, n)
        emitted = tab.emitted_law(stop, full, weight, drafts, p_rows[:, n], n)
        return tab.continue_with_target(emitted, target)
    if method in ("tv", "tv_wr", "is_bv"):
        # The decode loop's layouts: K independent chains ("tv" with num_drafts), a branching
        # tree drawn independently ("tv_wr", "is_bv"; IS+BV with its deterministic rule, whose
        # law is not conditional on a selection draw).
        if method == "tv":
            tree = trees.chains_token_tree(2, n)
            draws = list(tref.chain_draws(target, [draft, draft], n))
        else:
            tree = trees.branching_token_tree((2, 2))
            draws = list(tref.tree_draws(target, draft, list(tree.parents), True))
        # Padded to every possible draw (weight 0), so one compile serves every control.
        draws += [(0.0,) + draws[0][1:]] * (vocab ** (tree.num_nodes - 1) - len(draws))
        _, tokens, q, p = (np.array(a) for a in zip(*draws))
        weight = np.array([w for w, *_ in draws])
        with jax.enable_x64(True), np.errstate(divide="ignore"):
            joint = np.asarray(
                _tree_outcome_fn(tree, method)(
                    jnp.asarray(tokens), jnp.log(jnp.asarray(q)), jnp.log(jnp.asarray(p))
                )
            )
        total = defaultdict(float)
        for d in range(len(draws)):
            for i, y in zip(*np.nonzero(joint[d] > 0)):
                prefix = tuple(int(tokens[d, j]) for j in tree.paths[i, 1 : tree.depth[i] + 1])
                total[prefix + (int(y),)] += weight[d] * joint[d, i, y]
        return tref.continued(total, target, n + 1)
    scheme = {"is": "is_default", "optimal": "optimal_g20"}.get(method, method)
    total, _ = tree_law(node_law(scheme, vocab), target, [draft, draft], n)
    return tref.continued(total, target, n + 1)


@pytest.mark.slow
@pytest.mark.parametrize("method", ENUM_METHODS)
def test_exact_enumeration_with_every_control(method):
    rng = np.random.default_rng(5)
    raw_target = [np.log(t) for t in tab.target_model(rng, ENUM_V, ENUM_N + 1, "dense")]
    raw_draft = [
        np.log(q) for q in tab.draft_model(rng, [np.exp(t) for t in raw_target], ENUM_N, "far")
    ]
    for name, controls in ENUM_CONTROLS.items():
        target, target_ref = _processed_tables(raw_target, controls, 1.0, draft=False)
        draft, _ = _processed_tables(raw_draft, controls, 1.0, draft=True)
        got = _enumerated_law(method, target, draft)
        # Exact for the processed target the loop uses, and that is the reference's law.
        np.testing.assert_allclose(got, tab.joint(target, ENUM_N + 1), atol=1e-10, err_msg=name)
        np.testing.assert_allclose(got, tab.joint(target_ref, ENUM_N + 1), atol=1e-5, err_msg=name)
        # The control changes the law along paths: the enumeration is not trivially the raw one.
        raw_joint = tab.joint([np.exp(t) for t in raw_target], ENUM_N + 1)
        assert np.abs(got - raw_joint).max() > 1e-3, name
