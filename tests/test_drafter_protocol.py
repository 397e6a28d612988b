"""A drafter written outside the package through the documented protocol
(``asps_jax.drafters.Drafter``), run by ``sample`` with several methods.

The toy drafter below draws every token of its K chains independently from one fixed law,
whatever the text: a poor drafter, but a proper one (its laws are the laws it drew from), so
every method must keep the target's law. The first two tokens of many rows (one jitted call per
method) are compared by a chi-square test with transformers' exact law of a tiny random Llama;
with continuous batching the drafter's default ``refill`` runs too. Its ``check`` refuses a
branching tree with a one-line error, as a drafter that draws chains should.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_checkpoints import write_tiny_llama

import asps_jax
from asps_jax import drafters

VOCAB = 12
ROWS = 3000
PROMPT = [1, 5, 3, 7, 2, 1, 5]


@dataclasses.dataclass(frozen=True)
class Unigram(drafters.Drafter):
    """K chains of i.i.d. tokens from the law ``softmax(logits)`` (a tuple: static, hashable)."""

    logits: tuple

    def check(self, target, spec) -> None:
        if spec.tree.plan is not None:
            raise ValueError("Unigram drafts independent chains, not a branching tree=")

    def propose(self, dec, params, sampling, state) -> drafters.Proposal:
        n, k = dec.spec.num_draft_tokens, dec.spec.tree.num_chains
        batch = state.root.shape[0]
        law_V = jax.nn.log_softmax(jnp.asarray(self.logits, jnp.float32))
        keys_R = drafters.chain_keys(state, k)
        tokens_RD = jax.vmap(lambda key: jax.random.categorical(key, law_V, shape=(n,)))(keys_R)
        return drafters.Proposal(
            tokens_BKD=tokens_RD.reshape(batch, k, n).astype(jnp.int32),
            logprobs_BKDV=jnp.broadcast_to(law_V, (batch, k, n, law_V.shape[0])),
            ok_BKD=jnp.ones((batch, k, n), bool),
            usable_BK=jnp.full((batch, k), n, jnp.int32),
        )


# Peaked on the tokens the target is likely to emit after the prompt, so drafts get accepted.
TOY = Unigram(tuple(float(x) for x in np.linspace(2.0, -2.0, VOCAB)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("toy_drafter") / "target"
    hf = write_tiny_llama(path, seed=0, vocab_size=VOCAB, initializer_range=0.4)
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([PROMPT])).logits[0, -1].double(), -1).numpy()
        second = hf(torch.tensor([PROMPT + [x] for x in range(VOCAB)])).logits[:, -1]
        p2 = torch.softmax(second.double(), -1).numpy()
    return asps_jax.load_model(str(path)), p1[:, None] * p2


def _pvalue(tokens, law):
    from scipy import stats

    counts = np.zeros((VOCAB, VOCAB))
    np.add.at(counts, (tokens[:, 0], tokens[:, 1]), 1)
    expected = law.reshape(-1) * counts.sum()
    observed = counts.reshape(-1)
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(method="sps"),
        dict(method="asps"),
        dict(method="specinfer", num_drafts=2),
        dict(method="is", num_drafts=3),
        dict(method="tv", num_drafts=2),
        dict(method="asps", batch_size=512),
    ],
    ids=["sps", "asps", "specinfer K=2", "is K=3", "tv K=2 chains", "asps slots"],
)
def test_a_user_drafter_keeps_the_target_law(tiny, kwargs):
    model, law = tiny
    out = asps_jax.sample(
        model, TOY, [PROMPT] * ROWS, key=jax.random.key(4), max_new_tokens=2,
        num_draft_tokens=2, eos_token_id=-1, **kwargs,
    )  # fmt: skip
    assert float(np.mean(np.asarray(out.stats["accepted"]))) > 0.05  # the drafts were used
    pvalue = _pvalue(np.asarray(out.tokens)[:, :2], law)
    assert pvalue > 1e-3, f"{kwargs}: chi-square p-value {pvalue:.2e}"


def test_a_user_drafter_refuses_what_it_cannot_draft(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="Unigram drafts independent chains"):
        asps_jax.sample(model, TOY, [PROMPT], key=jax.random.key(0), max_new_tokens=2,
                        method="tv", tree=(2, 1))  # fmt: skip
    with pytest.raises(ValueError, match="draft_stop: the confidence stop is an option"):
        asps_jax.sample(model, TOY, [PROMPT], key=jax.random.key(0), max_new_tokens=2,
                        draft_stop="confidence:0.5")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Broken(drafters.Drafter):
    """A drafter whose model went NaN and which cuts its own chains to nothing (usable 0, every
    law "ok"): the shared check (``Proposal.finite_BKD`` from ``drafters.finite_laws``) still
    stops the row, as a NaN draft model's does (issue 66, item 3)."""

    def propose(self, dec, params, sampling, state) -> drafters.Proposal:
        n, k = dec.spec.num_draft_tokens, dec.spec.tree.num_chains
        batch = state.root.shape[0]
        logits = jnp.full((batch, k, n, VOCAB), jnp.nan, jnp.float32)
        return drafters.Proposal(
            tokens_BKD=jnp.zeros((batch, k, n), jnp.int32),
            logprobs_BKDV=jnp.full((batch, k, n, VOCAB), -jnp.inf, jnp.float32),
            ok_BKD=jnp.ones((batch, k, n), bool),
            usable_BK=jnp.zeros((batch, k), jnp.int32),
            finite_BKD=drafters.finite_laws(logits),
        )


@pytest.mark.slow  # one compile of the sampling loop
def test_a_non_finite_draft_law_of_any_drafter_raises(tiny):
    model, _ = tiny
    with pytest.raises(asps_jax.NonFiniteLogitsError, match=r"rows \[0\] stopped at new-token "
                       r"positions \[0\]") as err:  # fmt: skip
        asps_jax.sample(model, Broken(), [PROMPT], key=jax.random.key(0), max_new_tokens=2,
                        num_draft_tokens=2)  # fmt: skip
    assert int(err.value.output.lengths[0]) == 0


NUMBERS = {4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 12: "twelve", 13: "thirteen"}


def test_the_docs_count_and_name_the_protocols_methods():
    """design.md's "Adding a drafter" and drafters/base.py's docstring say how many methods the
    protocol has and name each: counted from ``Drafter``'s source (the methods above its
    ``# Device`` banner are the host's), so a method added or removed shows here."""
    import ast
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    source = (root / "asps_jax/drafters/base.py").read_text(encoding="utf-8")
    banner = next(i for i, line in enumerate(source.splitlines(), 1) if "# Device" in line)
    (cls,) = [n for n in ast.parse(source).body if getattr(n, "name", "") == "Drafter"]
    methods = [f for f in cls.body if isinstance(f, ast.FunctionDef) and not f.decorator_list]
    host = [f.name for f in methods if f.lineno < banner]
    device = [f.name for f in methods if f.lineno > banner]
    assert "check" in host and "propose" in device
    design = (root / "docs/design.md").read_text(encoding="utf-8")
    section = re.search(r"^## Adding a drafter\n(.*?)(?=^## )", design, re.M | re.S).group(1)
    assert f"Its {NUMBERS[len(host) + len(device)]} methods" in section
    assert f"- {NUMBERS[len(host)]} on the host" in section
    assert f"- {NUMBERS[len(device)]} in the compiled step" in section
    assert [m for m in host + device if f"`{m}(" not in section and f"`{m}`" not in section] == []
    (row,) = [line for line in design.splitlines() if line.startswith("asps_jax/drafters/base.py")]
    assert [m for m in host + device if not re.search(rf"\b{m}\b", row)] == []
    doc = ast.get_docstring(ast.parse(source))
    assert f"through {NUMBERS[len(device)]} device methods" in doc
    assert [m for m in device if f":meth:`Drafter.{m}`" not in doc] == []
