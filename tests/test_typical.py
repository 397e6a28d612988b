"""``typical_p``: transformers' ``TypicalLogitsWarper`` (locally typical sampling, Meister et al.
2022; ``min_tokens_to_keep`` 1), the last filter after min-p, exact at every node like every
control.

Expected values come from transformers' warper itself and from a NumPy float64 reference of the
filter written here from its definition (:func:`typical_reference`), cross-checked against it:
keep the tokens whose surprisal is closest to the entropy, ``|-log p - H|`` ascending, up to the
first one at which their mass reaches ``typical_p`` (ties at that distance kept).

The rest of its proof is in test_controls.py, as for every control: the exact enumeration of
every method's law (``ENUM_CONTROLS["typical_p"]``, float64, 1e-10), the chi-square of the first
two tokens through ``asps_jax.sample`` under ar, asps, specinfer and a tv tree (its third
``SETTINGS`` row, typical-p after min-p) and greedy parity with transformers' ``generate`` (its
greedy rows carry ``typical_p``).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from controls_reference import typical_probs
from test_controls import _hf_processed
from transformers import TypicalLogitsWarper

import asps_jax
from asps_jax.cli import args as cli_args
from asps_jax.controls.processors import SamplingParams, process_logits


def _hf_typical(logits, mass):
    """transformers' law: the warper on the (already warped) logits, then a softmax."""
    scores = torch.as_tensor(np.asarray(logits, np.float32))[None]
    out = TypicalLogitsWarper(mass)(torch.zeros((1, 1), dtype=torch.long), scores)
    return torch.softmax(out[0].double(), -1).numpy()


def _cases(rng, count, vocab):
    """Random logits (peaked and flat, some tokens masked) and masses."""
    logits = rng.normal(size=(count, vocab)) * rng.choice([0.5, 2.0, 5.0], (count, 1))
    logits[rng.random((count, vocab)) < 0.1] = -np.inf
    logits[:, 0] = np.maximum(logits[:, 0], 0.0)  # at least one finite logit per row
    return logits.astype(np.float32), rng.choice([0.05, 0.2, 0.5, 0.9, 0.99], count)


@pytest.mark.slow
def test_reference_and_library_match_transformers_typical_warper():
    """On random logits: the NumPy reference and ``process_logits(typical_p=...)`` (one row at a
    time, and SamplingParams.process with rows of different settings) against transformers'
    ``TypicalLogitsWarper``; with temperature, top-k, top-p and min-p before it, in transformers'
    order (``TemperatureLogitsWarper`` ... ``MinPLogitsWarper``, then ``TypicalLogitsWarper``)."""
    rng = np.random.default_rng(0)
    vocab = 40
    logits, mass = _cases(rng, 48, vocab)
    for row, m in zip(logits, mass):
        law = np.exp(row - row.max())
        np.testing.assert_allclose(typical_probs(law, m), _hf_typical(row, m), atol=1e-6)
    typical = jax.vmap(process_logits, in_axes=(0, None, None, None, None, 0))
    ours = np.exp(np.asarray(typical(logits, 1.0, None, None, None, mass), np.float64))
    expected = np.stack([_hf_typical(row, m) for row, m in zip(logits, mass)])
    np.testing.assert_allclose(ours, expected, atol=1e-6)
    assert np.sum(expected == 0) > np.sum(np.isinf(logits)) + len(logits)  # it does cut

    # The batch path, other filters first (rows with typical_p = 1: off, and greedy rows).
    temperature = rng.choice([0.0, 0.7, 1.0, 1.5], len(logits))
    top_k = rng.choice([0, 5, 50], len(logits))
    top_p = rng.choice([1.0, 0.9], len(logits))
    min_p = rng.choice([0.0, 0.05], len(logits))
    typical = np.where(rng.random(len(logits)) < 0.2, 1.0, mass)
    params = SamplingParams.make(
        len(logits), temperature, top_k, top_p, min_p=min_p, typical_p=typical
    )
    assert params.filters == ("top_k", "top_p", "min_p", "typical_p")
    got = np.exp(np.asarray(jax.jit(SamplingParams.process)(params, logits), np.float64))
    for b in range(len(logits)):
        warp = dict(
            temperature=temperature[b], top_k=int(top_k[b]), top_p=top_p[b], min_p=min_p[b],
            typical_p=typical[b],
        )  # fmt: skip
        want = _hf_processed(logits[b], [0], 0, {}, warp)
        np.testing.assert_allclose(got[b], want, atol=1e-6, err_msg=str(warp))


def test_typical_p_is_checked_like_every_control():
    """One-line errors naming it, from its declaration; 1 turns it off (at run time: given, it is
    compiled), and the command line's ``--typical-p`` reaches it."""
    for bad in (0.0, 1.5, -0.1, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match="typical_p must be") as err:
            asps_jax.Sampling(typical_p=bad)
        assert "\n" not in str(err.value)
    assert SamplingParams.make(2).filters == ()
    assert SamplingParams.make(2, typical_p=1.0).filters == ("typical_p",)
    args = cli_args.build_parser().parse_args(["--typical-p", "0.4"])
    assert cli_args.sampling_kwargs(args)["typical_p"] == 0.4


def test_typical_p_alone_takes_the_unsorted_path():
    """Without top-k and top-p the batch needs no sort: min-p and typical-p alone (and rows
    where both are off) against transformers."""
    rng = np.random.default_rng(1)
    logits, mass = _cases(rng, 8, 40)
    typical = np.where(np.arange(8) < 2, 1.0, mass)
    min_p = np.where(np.arange(8) % 2 == 0, 0.0, 0.1)
    params = SamplingParams.make(8, 1.0, min_p=min_p, typical_p=typical)
    got = np.exp(np.asarray(jax.jit(SamplingParams.process)(params, logits), np.float64))
    for b in range(8):
        want = _hf_processed(logits[b], [0], 0, {}, dict(min_p=min_p[b], typical_p=typical[b]))
        np.testing.assert_allclose(got[b], want, atol=1e-6)
