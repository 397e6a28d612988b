"""Self-drafting (``draft="self:L"``): the target's first L layers, final norm and head drafting.

References: transformers (the target, and the target with its layer list cut to L, for the draft's
law), the float64 NumPy outcome laws of tests/tabular.py and tests/multidraft_reference.py (exact
enumeration), and the draft laws of the separate draft cache built by the existing path (the
shared cache must give the same laws).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import itertools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tabular as tab
import torch
from hf_checkpoints import write_tiny_llama
from multidraft_laws import node_law
from multidraft_reference import continuation_error, tree_law

import asps_jax
from asps_jax import decode, decode_state, drafters, kv_cache
from asps_jax.drafters import self_layers as selfdraft
from asps_jax.models import LlamaConfig, MistralConfig, Model, Qwen3Config, own_model
from asps_jax.models.base import run_params
from asps_jax.models.decoder import init_params as decoder_init
from asps_jax.models.llama import init_params as llama_init
from asps_jax.sampler import prepare
from asps_jax.verify import chain

VOCAB = 5
LAYERS = 3
PROMPT = [1, 4, 2]
N = 2


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(hf target, hf self-draft of L = 1 and 2, our target): a tiny Llama with peaked laws."""
    path = tmp_path_factory.mktemp("selfdraft")
    hf = write_tiny_llama(
        path, seed=3, vocab_size=VOCAB, num_hidden_layers=LAYERS, initializer_range=0.5
    )
    cut = {}
    for layers in (1, 2):
        m = copy.deepcopy(hf)
        m.model.layers = m.model.layers[:layers]
        m.config.num_hidden_layers = layers
        cut[layers] = m
    return hf, cut, asps_jax.load_model(str(path))


def _laws(hf_model, depth: int) -> list[np.ndarray]:
    """Tabular float64 laws (tests/tabular.py layout) of ``hf_model`` after PROMPT, depth
    ``depth``: ``laws[i][x_1..x_i]`` is the law of the next token."""
    out = []
    for i in range(depth):
        prefixes = list(itertools.product(range(VOCAB), repeat=i))
        with torch.no_grad():
            logits = hf_model(torch.tensor([PROMPT + list(x) for x in prefixes])).logits[:, -1]
        law = torch.softmax(logits.double(), -1).numpy()
        out.append(law.reshape((VOCAB,) * i + (VOCAB,)))
    return out


@pytest.mark.slow
def test_the_draft_is_the_cut_target_and_shares_its_weights(models):
    hf, cut, target = models
    for layers in (1, 2):
        draft = drafters.draft_model(target, f"self:{layers}")
        assert draft is drafters.draft_model(target, f"self:{layers}")  # one object per (target, L)
        assert draft.config.num_hidden_layers == layers
        tokens = jnp.asarray([PROMPT + [0, 3]])
        positions = jnp.arange(5)[None]
        mask = jnp.tril(jnp.ones((1, 5, 5), bool))
        logits, _ = draft.forward(draft.params, tokens, positions, mask, None)
        with torch.no_grad():
            want = cut[layers](torch.tensor(np.asarray(tokens))).logits.numpy()
        np.testing.assert_allclose(np.asarray(logits), want, atol=2e-5)
        # Views: the embedding, head and final norm are the target's buffers; the layers are the
        # target's first ones in the one-row run layout, a copy of those layers alone.
        full = run_params(target)
        for name in ("embed", "lm_head", "final_norm"):
            assert draft.params[name] is target.params[name] is full[name]
        assert len(draft.params["layers"]) == layers
        for i in range(layers):
            for name, a in draft.params["layers"][i].items():
                np.testing.assert_array_equal(np.asarray(a), np.asarray(full["layers"][i][name]))


@pytest.mark.parametrize(
    "spec, match",
    [
        ("self:0", r"draft='self:0'.*0 < L < 3"),
        ("self:3", r"draft='self:3'.*0 < L < 3"),
        ("self:-1", r"draft='self:-1'.*0 < L < 3"),
        ("self:1.5", r"draft='self:1.5'.*integer"),
        ("self:", r"draft='self:'.*integer"),
        ("self:two", r"draft='self:two'.*integer"),
        ("lookahead", r"draft: unknown drafter 'lookahead'.*'self:L'"),
    ],
)
def test_bad_self_draft_is_a_one_line_error(models, spec, match):
    target = models[2]
    with pytest.raises(ValueError, match=match) as err:
        asps_jax.sample(target, spec, [PROMPT], key=jax.random.key(0), max_new_tokens=2)
    assert "\n" not in str(err.value)


def test_a_model_that_cannot_be_cut_is_refused():
    def forward(params, tokens, positions, mask, cache):
        raise AssertionError("never called")

    model = own_model(
        forward,
        {"w": jnp.zeros(3)},
        vocab_size=8,
        num_hidden_layers=2,
        num_key_value_heads=1,
        head_dim=2,
        max_position_embeddings=32,
    )
    with pytest.raises(ValueError, match=r"draft='self:1'.*OwnConfig") as err:
        asps_jax.sample(model, "self:1", [[1]], key=jax.random.key(0), max_new_tokens=2)
    assert "\n" not in str(err.value)


def _outcome(method, drafts, q_rows, p_rows, n):
    fn = {"sps": chain.sps_outcome_logweights, "asps": chain.asps_outcome_logweights}[method]
    with jax.enable_x64(True):
        stop, full = jax.vmap(fn, in_axes=(0, 0, 0, None))(
            jnp.asarray(drafts, jnp.int32),
            jnp.log(jnp.asarray(q_rows, jnp.float64)),
            jnp.log(jnp.asarray(p_rows, jnp.float64)),
            jnp.asarray(n, jnp.int32),
        )
    return np.exp(np.asarray(stop)), np.exp(np.asarray(full))


@pytest.mark.slow
@pytest.mark.parametrize("layers", [1, 2])
def test_exact_enumeration(models, layers):
    """The self-draft's laws (transformers with the target's layer list cut to L) verified by
    SpS, ASpS (the library's outcome laws, and the float64 reference) and SpecInfer with two
    chains: the emitted string continued by the target has exactly the target's law."""
    hf, cut, _ = models
    target, draft = _laws(hf, N + 1), _laws(cut[layers], N)
    assert max(np.abs(t - d).max() for t, d in zip(target, draft)) > 0.05  # not the target
    want = tab.joint(target, N + 1)
    drafts, weight, q_rows, p_rows = tab.draft_enumeration(target, draft, N)
    for method in ("sps", "asps"):
        stop, full = _outcome(method, drafts, q_rows, p_rows, N)
        ref_stop, ref_full = tab.REF_OUTCOME[method](drafts, q_rows, p_rows, N)
        np.testing.assert_allclose(stop, ref_stop, atol=1e-12, err_msg=method)
        np.testing.assert_allclose(full, ref_full, atol=1e-12, err_msg=method)
        emitted = tab.emitted_law(stop, full, weight, drafts, p_rows[:, N], N)
        got = tab.continue_with_target(emitted, target)
        np.testing.assert_allclose(got, want, atol=1e-10, err_msg=method)
    law, _ = tree_law(node_law("specinfer", VOCAB), target, [draft, draft], N)
    assert continuation_error(law, target, N) <= 1e-10


ROWS = 6000
STAT_METHODS = [("sps", 1), ("asps", 1), ("specinfer", 2)]


@pytest.mark.slow
@pytest.mark.parametrize("method, num_drafts", STAT_METHODS)
def test_statistical_law(models, method, num_drafts):
    """ROWS rows (one jitted loop) with the shared cache: the first three tokens against
    transformers' exact law (chi-square), and the draft was used (tokens per step > 1)."""
    hf, _, target = models
    out = asps_jax.sample(
        target,
        "self:1",
        [PROMPT] * ROWS,
        key=jax.random.key(11),
        max_new_tokens=3,
        method=method,
        num_drafts=num_drafts,
        num_draft_tokens=N,
        eos_token_id=-1,
    )
    tokens = np.asarray(out.tokens)
    assert np.all(np.asarray(out.lengths) == 3)
    index = (tokens[:, 0] * VOCAB + tokens[:, 1]) * VOCAB + tokens[:, 2]
    law = tab.joint(_laws(hf, 3), 3)
    pvalue = tab.chi_square_pvalue(index, VOCAB**3, law)
    assert pvalue > 1e-3, f"{method}: chi-square p-value {pvalue:.2e}"
    assert np.mean(np.asarray(out.stats["tokens_per_step"])) > 1.2


STEPS = 4


@functools.partial(jax.jit, static_argnums=(0, 1))
def _both_runs(shared, separate, target_params, draft_params, sampling, prompts, lengths, keys):
    """For each decoder, prefill and STEPS steps in one program: the draft laws of every step
    (``_draft``, as the step draws them), the emitted tokens and counts after each step."""
    out = []
    for dec in (shared, separate):
        state = decode_state.prefill(dec, target_params, draft_params, prompts, lengths, keys)

        def body(state, _, dec=dec):
            drafts = decode._draft(dec, draft_params, sampling, state)
            # Chain k's law at depth d: its node's (the drafts are node-indexed).
            laws = drafts.logprobs_BNV[:, dec.spec.tree.layout.chain_nodes]
            state = decode._step(dec, target_params, draft_params, sampling, state)
            return state, (laws, state.tokens, state.num_generated)

        out.append(jax.lax.scan(body, state, None, length=STEPS)[1])
    return out


@pytest.mark.slow
def test_shared_cache_gives_the_laws_of_a_separate_cache(models):
    """Step by step, two chains' draft laws at every rollout depth with the target's cache
    shared equal those of a separate draft cache (the existing path: its own prefill, rollout
    and replica sync), over steps that accept some draft tokens and reject others; the two runs
    emit the same tokens. The first law after the prompt is transformers' cut model's."""
    _, cut, target = models
    rows = 12
    call = prepare(
        target,
        "self:1",
        [PROMPT, PROMPT[:2], [3]] * (rows // 3),
        key=jax.random.key(5),
        max_new_tokens=12,
        method="specinfer",
        num_drafts=2,
        num_draft_tokens=3,
        eos_token_id=-1,
    )
    args = dict(call.inputs.kwargs(), decoder=call.decoder)
    shared = args["decoder"]
    assert isinstance(shared.drafter, drafters.SharedLayers)
    separate = dataclasses.replace(shared, drafter=drafters.ModelDraft(shared.drafter.config))
    arrays = [args[k] for k in ("target_params", "draft_params", "prompts_BP")]
    arrays += [args["prompt_lengths_B"], args["row_keys_B"]]
    state = jax.eval_shape(functools.partial(decode_state.prefill, shared), *arrays)
    assert state.draft is None  # no draft cache: the target's is read
    (laws, tokens, counts), (sep_laws, sep_tokens, sep_counts) = _both_runs(
        shared,
        separate,
        *(args[k] for k in ("target_params", "draft_params", "sampling", "prompts_BP")),
        *(args[k] for k in ("prompt_lengths_B", "row_keys_B")),
    )
    np.testing.assert_allclose(np.asarray(laws), np.asarray(sep_laws), atol=2e-5)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(sep_tokens))
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(sep_counts))
    with torch.no_grad():
        want = cut[1](torch.tensor([PROMPT])).logits[0, -1].log_softmax(-1).numpy()
    np.testing.assert_allclose(np.asarray(laws[0, 0, :, 0]), np.stack([want] * 2), atol=2e-5)
    emitted = np.diff(np.asarray(counts), axis=0, prepend=0).reshape(-1)
    assert np.any(emitted == 1) and np.any((emitted > 1) & (emitted < 4)) and np.any(emitted == 4)


SLIDING = ("sliding_attention",) * 3


def _decoder_model(config_class, **extra):
    config = config_class(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        initializer_range=0.3,
        **extra,
    )
    return Model("tiny", "", config, decoder_init(config, jax.random.key(0)))


@pytest.mark.slow
@pytest.mark.parametrize(
    "make, shared",
    [
        (lambda: _decoder_model(Qwen3Config), True),
        (
            lambda: _decoder_model(
                MistralConfig, sliding_window=4, layer_types=("sliding_attention",) * 3
            ),
            False,
        ),  # fmt: skip
    ],
)
def test_decoder_families(make, shared):
    """A decoder.py family cuts too; one with a sliding window keeps a separate draft cache (the
    scratch slots do not keep key positions), and both sample."""
    model = make()
    decoder = prepare(model, "self:2", [[1, 2, 3]], key=jax.random.key(0), max_new_tokens=4).decoder
    assert isinstance(decoder.drafter, drafters.SharedLayers) is shared
    assert selfdraft.can_share_cache(decoder.drafter.config) is shared
    assert decoder.drafter.config.num_hidden_layers == 2
    if shared:  # sampling with a separate draft cache is the existing path (test_decode.py)
        out = asps_jax.sample(
            model, "self:2", [[1, 2, 3]], key=jax.random.key(0), max_new_tokens=4,
            method="sps", num_draft_tokens=2,
        )  # fmt: skip
        assert int(out.lengths[0]) == 4


def test_llama_config_cut_keeps_the_rest():
    config = LlamaConfig(
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    cut = selfdraft.truncate_config(config, 2)
    assert cut == dataclasses.replace(config, num_hidden_layers=2)


def _cli():
    spec = importlib.util.spec_from_file_location(
        "sample_cli", Path(__file__).resolve().parents[1] / "scripts" / "sample.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_cli_self_draft(capsys):
    cli = _cli()
    argv = ["--max-new-tokens", "6", "--num-draft-tokens", "2", "--method", "sps", "--json"]
    assert cli.main(argv + ["--draft", "self:2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["new_tokens"] == 6 and result["tokens_per_step"] >= 1.0
    assert cli.main(argv + ["--draft", "self:9"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sample.py: error: draft='self:9'") and "\n" not in err


@pytest.mark.slow
def test_shared_feed_on_a_stacked_cache_equals_a_per_layer_one():
    """The scratch write into a stacked ``[L, ...]`` cache (GPT-2, OPT: no per-layer run layout)
    leaves the same cache and laws as into per-layer buffers; layers >= L are untouched."""
    config = LlamaConfig(
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    target = Model("t", "", config, llama_init(config, jax.random.key(0)))
    draft = drafters.draft_model(target, "self:2")
    keys = jax.random.split(jax.random.key(1), 2)
    shape = (3, 2, 1, 16, config.head_dim)  # L, B, KVH, S, H
    k, v = (jax.random.normal(key, shape) for key in keys)
    lengths = jnp.array([5, 3], jnp.int32)
    stacked = kv_cache.KVCache(k=k, v=v, lengths=lengths)
    per_layer = kv_cache.KVCache(k=tuple(k), v=tuple(v), lengths=lengths)
    tokens = jnp.array([1, 2, 3, 4], jnp.int32)  # B = 2 rows x K = 2 chains
    # Jitted (one program per cache layout) rather than op by op: CI time.
    feed = jax.jit(lambda p, c, t: selfdraft.shared_feed(draft.forward, p, c, t, 1, 2, False))
    out = [feed(draft.params, c, tokens) for c in (stacked, per_layer)]
    np.testing.assert_allclose(out[0][0], out[1][0], atol=1e-6)
    np.testing.assert_allclose(out[0][1].k, jnp.stack(out[1][1].k), atol=0)
    np.testing.assert_allclose(out[0][1].k[2], k[2], atol=0)
    assert not np.allclose(out[0][1].k[:2], k[:2])  # the scratch slots were written
    np.testing.assert_array_equal(out[0][1].lengths, lengths)
