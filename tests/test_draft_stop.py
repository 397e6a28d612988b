"""Confidence-stopped draft chains (``draft_stop="confidence:τ"``, the stop of the model
drafter's rollout, ``asps_jax/drafters/model.py``).

τ = 0 must be the fixed-length rollout draw for draw; the stopped rollout must leave its loop
early; the output law stays exact (enumeration on tabular models with the code's outcome laws, a
mutation that reads the target shows the check can fail, and a chi-square test of ``sample``
against transformers).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_checkpoints import write_tiny_llama
from tabular import all_strings, code, continue_with_target, joint, rows_along

import asps_jax
from asps_jax import decode
from asps_jax.drafters import model as model_draft
from asps_jax.models import forward_for
from asps_jax.verify import chain

VOCAB = 12
_HF_DRAFT = []


def pair_hf_draft():
    return _HF_DRAFT[-1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("stop")
    hf = write_tiny_llama(root / "t", seed=0, vocab_size=VOCAB, initializer_range=0.4)
    hf_draft = write_tiny_llama(
        root / "d", seed=1, vocab_size=VOCAB, initializer_range=0.4, noise_from=hf
    )
    _HF_DRAFT.append(hf_draft)
    return hf, asps_jax.load_model(str(root / "t")), asps_jax.load_model(str(root / "d"))


# --------------------------------------------------------------------------------------------
# τ = 0 is the fixed-n rollout, draw for draw; the loop exits early


@pytest.mark.slow
@pytest.mark.optimized  # the law run outweighs its compile (tests/conftest.py)
def test_tau_zero_equals_fixed_n_draw_for_draw(pair):
    """K = 2 chains (each stops on its own), ROWS rows at three temperatures. The stopped run has
    the shapes of the specinfer law test below (PROMPT, ROWS rows, n = 2, max_new_tokens = 3;
    τ and the temperatures are arrays), so one compiled program serves both."""
    _, target, draft = pair
    common = dict(
        key=jax.random.key(4),
        max_new_tokens=3,
        method="specinfer",
        num_drafts=2,
        num_draft_tokens=2,
        eos_token_id=-1,
        temperature=np.resize([1.0, 0.7, 1.3], ROWS),
    )
    fixed = asps_jax.sample(target, draft, [PROMPT] * ROWS, **common)
    stopped = asps_jax.sample(target, draft, [PROMPT] * ROWS, draft_stop="confidence:0", **common)
    np.testing.assert_array_equal(np.asarray(stopped.tokens), np.asarray(fixed.tokens))
    np.testing.assert_array_equal(
        np.asarray(stopped.stats["accepted"]), np.asarray(fixed.stats["accepted"])
    )
    assert np.asarray(fixed.stats["accepted"]).sum() > 0  # some drafts were accepted


@pytest.mark.slow
def test_the_stopped_rollout_leaves_its_loop_early(pair):
    """τ = 1 stops every chain at depth 0: only the root is fed (the cache advances by one slot);
    τ = 0 feeds all n + 1 tokens. The usable lengths are 0 and n."""
    _, target, draft = pair
    n = 4
    call = asps_jax.sampler.prepare(
        target, draft, [[1, 5, 3]] * 3, key=jax.random.key(0), max_new_tokens=8,
        num_draft_tokens=n,
    )  # fmt: skip
    dec, inputs = call.decoder, call.inputs
    state = dec.prefill(
        inputs.target_params,
        inputs.draft_params,
        inputs.prompts_BP,
        inputs.prompt_lengths_B,
        inputs.row_keys_B,
    )
    start = np.asarray(state.draft.lengths)
    batch = start.shape[0]  # the rows padded to the batch bucket
    for tau, fed, usable in ((1.0, 1, 0), (0.0, n + 1, n)):
        sampling = dataclasses.replace(
            inputs.sampling, draft_stop=jnp.full((batch,), tau, jnp.float32)
        )
        cache, _, _, _, _, stop = jax.jit(
            lambda c, s: model_draft.rollout(
                model_draft.own_feed(
                    forward_for(dec.drafter.config), inputs.draft_params, None, batch
                ),
                c,
                state.root,
                jax.random.split(jax.random.key(1), batch),
                draft_len=n,
                sampling=s,
                history=state.history,
                limit_R=jnp.full((batch,), n, jnp.int32),
            )
        )(state.draft, sampling)
        np.testing.assert_array_equal(np.asarray(cache.lengths), start + fed)
        assert np.asarray(stop).tolist() == [usable] * batch


# --------------------------------------------------------------------------------------------
# Exactness by enumeration


def _stopped_law(method, target, draft, n, length_of):
    """The emitted law (every string of 1..n+1 tokens, continued by the target to n + 1) when the
    draft x (drawn from ``draft``) is verified with length ``length_of(x, q_rows, p_rows)``, by
    the code's outcome law in float64, every draft enumerated with its probability."""
    vocab = target[0].shape[-1]
    outcome = {"sps": chain.sps_outcome_logweights, "asps": chain.asps_outcome_logweights}[method]
    drafts = all_strings(vocab, n)
    q_rows, p_rows = rows_along(draft, drafts, n), rows_along(target, drafts, n + 1)
    weight = np.prod(np.take_along_axis(q_rows, drafts[..., None], -1)[..., 0], -1)
    emitted = [np.zeros(vocab ** (m + 1)) for m in range(n + 1)]
    with jax.enable_x64(True):
        fn = jax.jit(outcome)
        for d, x in enumerate(drafts):
            length = length_of(x, q_rows[d], p_rows[d])
            stop, log_full = fn(
                jnp.asarray(x), jnp.log(q_rows[d]), jnp.log(p_rows[d]), jnp.int32(length)
            )
            stop, full = np.exp(np.asarray(stop)), float(np.exp(log_full))
            for t in range(length):
                at = code(x[None, :t], vocab)[0] * vocab + np.arange(vocab)
                emitted[t][at] += weight[d] * stop[t]
            at = code(x[None, :length], vocab)[0] * vocab + np.arange(vocab)
            emitted[length][at] += weight[d] * full * p_rows[d, length]
    return continue_with_target(emitted, target)


def _confidence_length(tau):
    """The rule: the first depth whose draft law's top probability is below τ (else n)."""

    def length_of(x, q_rows, p_rows):
        unsure = np.max(q_rows, axis=-1) < tau
        return int(np.argmax(unsure)) if unsure.any() else len(x)

    return length_of


def _laws(seed, vocab, n):
    from tabular import draft_model, target_model

    rng = np.random.default_rng(seed)
    target = target_model(rng, vocab, n + 1, "peaked")
    return target, draft_model(rng, target, n, "close")


@pytest.mark.parametrize("method", ["sps", "asps"])
@pytest.mark.parametrize("tau", [0.0, 0.5, 0.8])
def test_confidence_stop_law_is_exact_by_enumeration(method, tau):
    vocab, n = 3, 3
    target, draft = _laws(2, vocab, n)
    law = _stopped_law(method, target, draft, n, _confidence_length(tau))
    np.testing.assert_allclose(law, joint(target, n + 1), atol=1e-12)


def test_a_rule_that_reads_the_target_is_caught():
    """The mutation: cut the chain before a token the target finds unlikely (not a stopping time
    of the draft's information). The enumeration sees the bias."""
    vocab, n = 3, 3
    target, draft = _laws(2, vocab, n)

    def peeking(x, q_rows, p_rows):
        unlikely = p_rows[np.arange(n), x] < 0.3
        return int(np.argmax(unlikely)) if unlikely.any() else n

    law = _stopped_law("asps", target, draft, n, peeking)
    assert np.max(np.abs(law - joint(target, n + 1))) > 1e-3


# --------------------------------------------------------------------------------------------
# Statistical: sample(draft_stop=...) against transformers' exact law

ROWS = 6000
PROMPT = [1, 5, 4]  # a prompt whose depth-1 draft laws a τ splits (at temperature 1)


def _two_token_law(hf):
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([PROMPT])).logits[0, -1].double(), -1)
        seqs = torch.tensor([PROMPT + [x] for x in range(VOCAB)])
        p2 = torch.softmax(hf(seqs).logits[:, -1].double(), -1)
    return (p1[:, None] * p2).numpy(), p1.numpy(), p2.numpy()


def _splitting_tau(hf_draft):
    """A τ at which the root law never stops the chain but the depth-1 law stops it after some
    first tokens and not after others (with probability between 0.2 and 0.8): the stop then
    depends on the drawn token, which is what the test must exercise."""
    _, q1, q2 = _two_token_law(hf_draft)
    top2 = np.sort(q2.max(-1))
    for tau in (top2[1:] + top2[:-1]) / 2:  # midway: float32 rounding cannot move a law across
        stop_mass = q1[q2.max(-1) < tau].sum()
        if tau <= q1.max() and 0.2 <= stop_mass <= 0.8:
            return float(tau)
    pytest.fail("no τ splits the depth-1 laws of this draft")


@pytest.mark.slow
@pytest.mark.optimized  # the law run outweighs its compile (tests/conftest.py)
@pytest.mark.parametrize("method, num_drafts", [("asps", 1), ("specinfer", 2)])
def test_sample_law_with_confidence_stop(pair, method, num_drafts):
    """The first two tokens of ROWS rows (max_new_tokens = 3, so step one may draft 2 tokens)
    against transformers' exact law; τ splits the chains at depth 1."""
    from scipy import stats

    hf, target, draft = pair
    tau = _splitting_tau(pair_hf_draft())
    out = asps_jax.sample(
        target,
        draft,
        [PROMPT] * ROWS,
        key=jax.random.key(21),
        max_new_tokens=3,
        method=method,
        num_drafts=num_drafts,
        num_draft_tokens=2,
        eos_token_id=-1,
        draft_stop=f"confidence:{tau}",
    )
    tokens = np.asarray(out.tokens)
    law = _two_token_law(hf)[0].reshape(-1)
    counts = np.zeros((VOCAB, VOCAB))
    np.add.at(counts, (tokens[:, 0], tokens[:, 1]), 1)
    expected = law * ROWS
    observed = counts.reshape(-1)
    assert observed[expected == 0].sum() == 0
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    pvalue = stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
    assert pvalue > 1e-3, f"{method} τ={tau}: chi-square p-value {pvalue:.2e}"


# --------------------------------------------------------------------------------------------
# Bad options


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(draft_stop="confidence:1.5"), "draft_stop must be 'confidence:τ' with τ in"),
        (dict(draft_stop="entropy:0.5"), "draft_stop must be 'confidence:τ'"),
        (dict(draft_stop="confidence:"), "draft_stop must be 'confidence:τ'"),
        (dict(draft_stop=True), "draft_stop must be 'confidence:τ'"),
        (dict(draft_stop="confidence:0.5", method="tv", tree=(2, 1)), "draft_stop: confidence"),
    ],
)
def test_bad_draft_stop_is_a_one_line_error(pair, kwargs, match):
    _, target, draft = pair
    kwargs = {"method": "asps", **kwargs}
    with pytest.raises(ValueError, match=match) as err:
        asps_jax.sample(target, draft, [PROMPT], key=jax.random.key(0), max_new_tokens=2, **kwargs)
    assert "\n" not in str(err.value)


def test_decoder_without_stop_uses_the_scan_rollout(pair):
    """The spec flag is off without draft_stop (the fixed-n rollout is compiled as before)."""
    _, target, draft = pair
    call = asps_jax.sampler.prepare(target, draft, [PROMPT], key=jax.random.key(0),
                                    max_new_tokens=2)  # fmt: skip
    assert isinstance(call.decoder, decode.Decoder)
    assert not call.decoder.drafter.confidence_stop


@pytest.mark.parametrize(
    "value", ["confidence:2", "confidence", "speed:0.5", "confidence:x"], ids=str
)
def test_cli_bad_draft_stop_exits_with_one_line(capsys, value):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "sample.py"
    spec = importlib.util.spec_from_file_location("sample_cli_stop", script)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    with pytest.raises(SystemExit) as info:
        cli.main(["--draft-stop", value])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "argument --draft-stop: expected 'confidence:τ'" in err


# --------------------------------------------------------------------------------------------
# num_draft_tokens="auto"


def test_auto_choice_maximises_tokens_per_cost():
    """Emitted lengths at n_max = 2: 10 steps of 1 token, 10 of 2, 20 of 3, so P(L >= 1, 2, 3) =
    1, 0.75, 0.5 and E(n) = 1, 1.75, 2.25. A step costs 1 at n = 0 and t_max at n = 2."""
    from asps_jax import autotune

    cheap = autotune.choose([0, 10, 10, 20], t_ar=1.0, t_max=1.2)  # rates 1, 1.59, 1.875
    assert cheap.num_draft_tokens == 2
    assert cheap.tokens_per_step == pytest.approx((1.0, 1.75, 2.25))
    assert cheap.cost_ratio == pytest.approx(0.1)
    dear = autotune.choose([0, 10, 10, 20], t_ar=1.0, t_max=2.0)  # rates 1, 1.1667, 1.125
    assert dear.num_draft_tokens == 1
    assert "chose n=1" in dear.describe()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_draft_tokens="often"), "num_draft_tokens must be an integer >= 1 or 'auto'"),
        (dict(num_draft_tokens="auto", method="ar"), "num_draft_tokens='auto' chooses"),
        (dict(num_draft_tokens="auto", method="tv", tree=(2, 1)), "num_draft_tokens='auto'"),
    ],
)
def test_bad_auto_is_a_one_line_error(pair, kwargs, match):
    _, target, draft = pair
    with pytest.raises(ValueError, match=match) as err:
        asps_jax.sample(target, draft, [PROMPT], key=jax.random.key(0), max_new_tokens=2, **kwargs)
    assert "\n" not in str(err.value)
