"""The scan layout (the stored stacked layers run by one ``lax.scan``, what an accelerator runs:
``base.scan_layout_for``) against the per-layer run layout XLA:CPU runs (the layers unrolled):
the same logits, new keys / values and hidden-state features for every family with both, float
and quantized; the decoding loop's law and greedy output under the scan layout are in
``tests/test_decode.py`` (``test_scan_layout_keeps_the_law_and_the_greedy_output``).

OPT, GPT-2 and GPT-Neo have no run layout: they scan on every device (``tests/test_families.py``
checks them against transformers).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_checkpoints import FAMILY_CONFIGS

from asps_jax.kv_cache import commit, init_cache, per_layer_params
from asps_jax.models import base, llama
from asps_jax.models.quant import quantize_params

L, B, P, T = 3, 2, 6, 3  # layers, rows, prompt tokens, then T tokens (a chain) over the cache
V = 96  # the vocabulary of hf_checkpoints.FAMILY_CONFIGS
FEATURES = (0, 2, 3)  # the first layer's input, a middle one's, the last layer's output

# The RoPE decoders whose layers differ (Qwen3 and Mistral scan through the same code and are
# checked against transformers on their stacked params in tests/test_families.py): Qwen2's
# window from layer 1 on, Gemma 2's alternating local / global layers, Gemma 3's local layers
# with their own RoPE base (and the global ones with a linear scaling).
DECODERS = {
    "qwen2": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "gemma2": {},
    "gemma3_text": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
}
CASES = ["llama", "llama_int8", *DECODERS]


def _model(case: str):
    """``(config, stacked params)`` of a tiny random model of ``case``."""
    if case.startswith("llama"):
        config = llama.LlamaConfig(
            vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=L,
            num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
        )  # fmt: skip
        params = llama.init_params(config, jax.random.key(1))
        if case == "llama_int8":
            params = quantize_params(config, params, "int8")
        return config, params
    family = base.FAMILIES[case]
    config = family.config_from_hf(
        {**FAMILY_CONFIGS[case][2], "model_type": case, "num_hidden_layers": L, **DECODERS[case]}
    )
    return config, family.init_params(config, jax.random.key(1))


def prefill_then_chain(forward, params, cache, tokens_BL, prompt_len: int):
    """``(kv, out)``: the first ``prompt_len`` tokens of each row forwarded without a cache
    (causal), their keys / values ``kv`` committed into ``cache``, then ``out``, the forward of
    the remaining tokens (causal) over that cache."""
    (B, L), P = tokens_BL.shape, prompt_len
    T, S = L - P, cache.max_len
    positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    causal = jnp.tril(jnp.ones((L, L), bool))
    mask = jnp.broadcast_to(causal[:P, :P], (B, P, P))
    kv = forward(params, tokens_BL[:, :P], positions[:, :P], mask, None)[1]
    nodes = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    cache = commit(cache, kv, nodes, jnp.full((B,), P, jnp.int32))
    seen = jnp.broadcast_to(jnp.arange(S) < P, (B, T, S))
    mask = jnp.concatenate([seen, jnp.broadcast_to(causal[P:, P:], (B, T, T))], axis=-1)
    return kv, forward(params, tokens_BL[:, P:], positions[:, P:], mask, cache)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_scan_and_unrolled_layouts_give_the_same_forward(case, monkeypatch):
    """A prefill without a cache, its keys / values committed, then a chain of T tokens over the
    cache with hidden-state features: both layouts in one compiled call, within 1e-5."""
    config, stacked = _model(case)
    unrolled = base.prepare_params(config, stacked, wide=case != "llama")
    assert isinstance(unrolled["layers"], tuple) and per_layer_params(unrolled)
    monkeypatch.setenv(base.LAYOUT_ENV, "scan")
    assert base.prepare_params(config, stacked) is stacked  # the decoding loop's scan layout
    forward = base.forward_for(config, FEATURES)
    tokens = jax.random.randint(jax.random.key(2), (B, P + T), 0, V, jnp.int32)

    @jax.jit
    def run(params, cache):
        return prefill_then_chain(forward, params, cache, tokens, P)

    slots = P + T
    per_layer = init_cache(config, B, slots, per_layer=True)
    got = run(stacked, init_cache(config, B, slots))
    want = run(unrolled, per_layer)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_layout_follows_the_devices_and_the_switch(monkeypatch):
    """CPU-placed parameters run the per-layer run layout; the switch forces either one; a bad
    value of the switch is a one-line error naming it."""
    config, stacked = _model("llama")
    monkeypatch.delenv(base.LAYOUT_ENV, raising=False)
    assert not base.scan_layout_for(stacked)  # on this CPU device
    assert isinstance(base.prepare_params(config, stacked)["layers"], tuple)
    monkeypatch.setenv(base.LAYOUT_ENV, "scan")
    assert base.scan_layout_for(stacked) and base.prepare_params(config, stacked) is stacked
    monkeypatch.setenv(base.LAYOUT_ENV, "unrolled")
    assert not base.scan_layout_for(stacked)
    monkeypatch.setenv(base.LAYOUT_ENV, "stacked")
    with pytest.raises(ValueError, match=r"^ASPS_JAX_LAYOUT='stacked': must be one of") as e:
        base.prepare_params(config, stacked)
    assert "\n" not in str(e.value)
