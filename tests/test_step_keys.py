"""The speculative step derives each key once: every purpose's step key at the step's start
(``DecodeState.step_keys``), chain keys over one flat axis, and ASpS's three purposes in one
``fold_in``; the same bits as one ``fold_in`` per key (``drafters.base.step_keys``), and a bound
on the key derivations traced into the step (each is a threefry hash, ~130 lines of optimized
HLO on XLA:TPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import asps_jax
from asps_jax import decode, decode_state, sampler
from asps_jax.drafters import base


def _bits(keys):
    return np.asarray(jax.random.key_data(keys))


def test_step_keys_once_are_the_per_purpose_folds():
    row_keys = jax.random.split(jax.random.key(7), 3)
    generated = jnp.array([0, 5, 200], jnp.int32)
    fake = type("S", (), {"row_keys": row_keys, "num_generated": generated})()  # what is read
    every = base.all_step_keys(fake)
    for purpose in range(base.PURPOSES):
        step = [jax.random.fold_in(k, int(g)) for k, g in zip(row_keys, generated)]
        want = np.stack([_bits(jax.random.fold_in(k, purpose)) for k in step])
        np.testing.assert_array_equal(_bits(every[:, purpose]), want)
        np.testing.assert_array_equal(_bits(base.step_keys(fake, purpose)), want)
    chains = base.chain_keys(fake, 2)  # rows major: b * K + k
    want = [_bits(jax.random.fold_in(k, c)) for k in every[:, 0] for c in range(2)]
    np.testing.assert_array_equal(_bits(chains), np.stack(want))


@pytest.mark.slow  # loads the bundled pair and traces a step (no compile): ~4 s
def test_a_spec_step_traces_each_key_derivation_once():
    """ASpS n = 4 with the bundled draft model: the step key, its two purposes, the chain keys,
    the depth key (in the draft loop), the draft draw's redraw, ASpS's purposes and its one draw
    site's redraw: 7 ``fold_in`` and 2 ``bits`` (11 and 3 when each stage derived its own)."""
    target = asps_jax.load_model("tinyshakespeare-target")
    draft = asps_jax.load_model("tinyshakespeare-draft")
    call = sampler.prepare(
        target, draft, [target.tokenizer.encode("ROMEO:\n")], key=jax.random.key(0),
        max_new_tokens=8, eos_token_id=-1, method="asps", num_draft_tokens=4,
    )  # fmt: skip
    dec, args = call.decoder, call.inputs.kwargs()
    tp, dp, s = args["target_params"], args["draft_params"], args["sampling"]
    state = jax.eval_shape(
        lambda: decode_state.prefill(
            dec, tp, dp, args["prompts_BP"], args["prompt_lengths_B"], args["row_keys_B"]
        )
    )
    text = str(jax.make_jaxpr(lambda *a: decode._step(dec, *a))(tp, dp, s, state))
    assert text.count("random_fold_in") <= 7 and text.count("random_bits") <= 2
