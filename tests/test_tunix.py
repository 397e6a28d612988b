"""``asps_jax.integrations.tunix``: the google-tunix back end against tunix's own code.

On tiny random tunix models (built here, no download) and a local word-level tokenizer: the
parameter map gives tunix's logits (Llama3, Qwen2, Qwen3); greedy outputs equal tunix's native
``Sampler`` field for field; at temperature 1 the law of the first two tokens equals the native
sampler's (a chi-square two-sample test that rejects a different temperature); the logprobs and
logits equal tunix's teacher-forced forward; new weights change the outputs without building a
program; tunix's RL rollout code (``VanillaRollout``'s calls, ``RLCluster``'s construction of a
custom engine, ``sync_weights``' transfer guards) drives it; unsupported arguments are one-line
errors. The asps_jax calls share one compiled loop (up to 8 rows share a batch bucket, and the
loop always gathers logprobs), but for the slow test's, which bans tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("tunix.generate.base_sampler")
from flax import nnx  # noqa: E402
from scipy import stats  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from tunix.generate import sampler as tunix_sampler  # noqa: E402
from tunix.generate import utils as tunix_utils  # noqa: E402
from tunix.models.llama3 import model as llama3  # noqa: E402
from tunix.models.qwen2 import model as qwen2  # noqa: E402
from tunix.models.qwen3 import model as qwen3  # noqa: E402
from tunix.rl.rollout import base_rollout, vanilla_rollout  # noqa: E402

from asps_jax import compile_cache  # noqa: E402
from asps_jax.controls.sampling import Sampling  # noqa: E402
from asps_jax.drafters import block, block_model  # noqa: E402
from asps_jax.integrations.tunix import AspsRollout, AspsSampler, asps_model  # noqa: E402

# 16 tokens: unk 0, bos 1, eos 2, which is also the pad id (as for Llama 3's tokenizers): tunix's
# native sampler masks a *generated* pad id out of the attention, so a pad id that can be
# generated mid-text would change its law; an EOS ends the text first.
WORDS = ["<unk>", "<bos>", "<eos>", *"abcdefghijklm"]
PAD = 2
SIZES = dict(num_layers=2, vocab_size=16, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8)
OPTIONS = dict(num_draft_tokens=2)
PROMPTS = ["a b c", "d e f g h", "m"]


def _tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<eos>",
    )


def _random(make, seed: int, sharding=None):
    """``make()``'s module with random weights (norm scales near 1, biases small, projections
    ~ N(0, 1 / fan_in), embedding and head 3x that: peaked but not degenerate laws), drawn on the
    host (no eager initialisers) and placed with ``sharding`` (default: the default device)."""
    graphdef, state = nnx.split(nnx.eval_shape(make))
    rng = np.random.default_rng(seed)
    flat, tree = jax.tree_util.tree_flatten_with_path(state)
    leaves = []
    for path, x in flat:
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            v = 1 + 0.2 * rng.standard_normal(x.shape)
        elif "bias" in name:
            v = 0.3 * rng.standard_normal(x.shape)
        else:
            scale = 3.0 if ("embedding" in name or "lm_head" in name) else 1.0
            v = scale * rng.standard_normal(x.shape) / np.sqrt(x.shape[0])
        leaves.append(jax.device_put(np.asarray(v, x.dtype), sharding))
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))


def _llama(seed: int):
    """The Llama3 of every test but the map's, on a one-device mesh with tunix's axis names:
    RL models live on a mesh (``RLCluster`` shards them), and tunix's resharding expects
    ``NamedSharding`` arrays."""
    config = llama3.ModelConfig(
        **SIZES, num_kv_heads=2, rope_theta=500_000, norm_eps=1e-5, weight_tying=False
    )
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    on_mesh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return _random(lambda: llama3.Llama3(config, rngs=nnx.Rngs(0)), seed, on_mesh)


def _native(model, tok):
    cache = tunix_sampler.CacheConfig(cache_size=32, num_layers=2, num_kv_heads=2, head_dim=8)
    return tunix_sampler.Sampler(model, tok, cache)


def _call(sampler, prompts, **kwargs):
    with jax.numpy_rank_promotion("allow"):  # tunix's own code promotes ranks
        return sampler(prompts, **kwargs)


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


@pytest.fixture(scope="module")
def model():
    return _llama(seed=1)


@pytest.fixture(scope="module")
def ours(model, tok):
    return AspsSampler(model, tok, "self:1", **OPTIONS)


@pytest.fixture(scope="module")
def native(model, tok):
    return _native(model, tok)


@pytest.fixture(scope="module")
def block_draft(model, tmp_path_factory):
    """``draft=`` naming a random block drafter (blocks of 3, the recurrent readout the bundled
    one has) written for ``model``'s features."""
    target = asps_model(model)
    config = block_model.BlockConfig.for_target(target.config, block_size=3, readout="recurrent")
    d2t = list(range(config.vocab_size))
    params = block_model.init_params(config, jax.random.key(3), target.params["embed"], d2t, 0.5)
    path = tmp_path_factory.mktemp("block") / "drafter"
    block_model.save(path, config, params)
    return block.PREFIX + str(path)


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# --- (a) the parameter map --------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_mapped_logits_equal_tunix_forward(family):
    kv = dict(num_kv_heads=2, norm_eps=1e-6)
    make = {
        "llama3": lambda: llama3.Llama3(
            llama3.ModelConfig(**SIZES, **kv, rope_theta=500_000, weight_tying=True),
            rngs=nnx.Rngs(0),
        ),
        "qwen2": lambda: qwen2.Qwen2(
            qwen2.ModelConfig(**SIZES, **kv, rope_theta=10_000, use_tied_embedding=False),
            rngs=nnx.Rngs(0),
        ),
        "qwen3": lambda: qwen3.Qwen3(
            qwen3.ModelConfig(**SIZES, **kv, rope_theta=10_000, use_tied_embedding=True),
            rngs=nnx.Rngs(0),
        ),
    }[family]
    module = _random(make, seed=3)
    tokens = jnp.array([[0, 0, 1, 5, 6, 7, 8, 3], [1, 4, 4, 9, 10, 11, 12, 13]], jnp.int32)
    valid = tokens != 0
    positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    mask = jnp.tril(jnp.ones((8, 8), bool))[None] & (
        valid[:, None, :] | jnp.eye(8, dtype=bool)[None]
    )
    graphdef, state = nnx.split(module)

    @jax.jit
    def theirs(state):
        return nnx.merge(graphdef, state)(tokens, positions, None, mask)[0]

    with jax.numpy_rank_promotion("allow"):
        expected = np.asarray(theirs(state))
    ported = asps_model(module)
    got, _ = jax.jit(ported.forward)(ported.params, tokens, positions, mask, None)
    np.testing.assert_allclose(np.asarray(got)[valid], expected[valid], atol=2e-5, rtol=1e-5)


# --- (b) greedy: the native sampler's outputs -------------------------------------------------


def test_greedy_equals_native_sampler(ours, native):
    for kwargs in (
        dict(max_generation_steps=10),
        dict(max_generation_steps=10, max_prompt_length=2, echo=True, pad_output=True),
    ):
        _same_as_native(ours, native, return_logprobs=True, **kwargs)
    plain = ours(PROMPTS, max_generation_steps=10)
    assert plain.logprobs is None and plain.logits == []
    assert plain.text == ours(PROMPTS, max_generation_steps=10).text


@pytest.mark.slow
def test_greedy_with_forbidden_tokens_equals_native_sampler(ours, native):
    """Banned tokens: a loop with a logit bias (a program of its own), and greedy logprobs from
    the teacher-forced forward (the loop's greedy law is a point mass)."""
    got = _same_as_native(
        ours, native, max_generation_steps=10, forbidden_tokens=[3, 7, 12], return_logprobs=True
    )
    assert not set(np.concatenate(got.tokens).tolist()) & {3, 7, 12}


def _same_as_native(ours, native, **kwargs):
    theirs, got = _call(native, PROMPTS, **kwargs), ours(PROMPTS, **kwargs)
    assert got.text == theirs.text
    np.testing.assert_array_equal(got.padded_prompt_tokens, theirs.padded_prompt_tokens)
    assert isinstance(got.tokens, np.ndarray) == isinstance(theirs.tokens, np.ndarray)
    assert len(got.tokens) == len(theirs.tokens) == 3
    for a, b in zip(got.tokens, theirs.tokens):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(got.logprobs, theirs.logprobs):
        np.testing.assert_allclose(a, b, atol=2e-5)
    return got


# --- (c) the law at temperature 1 --------------------------------------------------------------


def _first_two(out) -> list[tuple]:
    return [tuple(int(t) for t in row[:2]) for row in out.tokens]  # EOS first: shorter tuples


def _p_value(a: list, b: list) -> float:
    """Chi-square two-sample test on the categories, those expected < 5 times pooled."""
    cats = sorted(set(a) | set(b))
    counts = np.array([[x.count(c) for c in cats] for x in (a, b)], float)
    rare = counts.sum(0) * min(len(a), len(b)) / (len(a) + len(b)) < 5
    table = np.concatenate([counts[:, ~rare], counts[:, rare].sum(1, keepdims=True)], axis=1)
    table = table[:, table.sum(0) > 0]
    return stats.chi2_contingency(table)[1]


def test_law_of_two_tokens_equals_native_sampler(ours, native):
    """1,200 samples each of the first two tokens after "a b": ours (calls of
    ``multi_sampling=8``: 8 rows share the compiled loop of the other tests' 3) against the
    native sampler's (1,200 rows, one call) at T = 1; and the test's power: 400 of ours at
    T = 1.6 are rejected."""
    call = dict(max_generation_steps=2, max_prompt_length=4, top_p=1.0, multi_sampling=8)

    def ours_at(temperature, calls):
        return [
            pair
            for seed in range(calls)
            for pair in _first_two(ours(["a b"], temperature=temperature, seed=seed, **call))
        ]

    got, hotter = ours_at(1.0, 150), ours_at(1.6, 50)
    theirs = _first_two(
        _call(native, ["a b"] * 1200, max_generation_steps=2, max_prompt_length=4, top_p=1.0,
              temperature=1.0, seed=8)
    )  # fmt: skip
    assert len(set(got)) > 20  # a law with some spread, not a point mass
    assert _p_value(got, theirs) > 1e-3
    assert _p_value(hotter, theirs) < 1e-3


# --- (d) logprobs and logits: tunix's teacher-forced forward ------------------------------------


def test_logprobs_and_logits_equal_tunix_forward(ours, model, tok):
    """Our logprobs (T = 1, the loop's) and logits (our forward) against tunix's
    ``compute_per_token_logps`` and model forward on the same prompt and completion tokens."""
    out = ours(
        PROMPTS,
        max_generation_steps=6,
        max_prompt_length=8,
        temperature=1.0,
        top_p=1.0,
        seed=[1, 2, 3],
        return_logprobs=True,
        return_logits=True,
    )
    rollout = AspsRollout(model, tok, rollout_config=None, draft="self:1", **OPTIONS)
    completions = np.array(
        [tunix_utils.pad_to_length(t, target_length=6, pad_value=PAD) for t in out.tokens]
    )
    with jax.numpy_rank_promotion("allow"):
        expected = np.asarray(
            rollout.get_per_token_logps(
                jnp.asarray(out.padded_prompt_tokens), jnp.asarray(completions)
            )
        )
    graphdef, state = nnx.split(model)
    seq = jnp.asarray(np.concatenate([out.padded_prompt_tokens, completions], axis=1))
    valid = seq != PAD
    positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    mask = jnp.tril(jnp.ones((14, 14), bool))[None] & valid[:, None, :]
    forward = jax.jit(lambda state: nnx.merge(graphdef, state)(seq, positions, None, mask)[0])
    with jax.numpy_rank_promotion("allow"):
        logits = np.asarray(forward(state))
    for r, tokens in enumerate(out.tokens):
        k = len(tokens)
        np.testing.assert_allclose(out.logprobs[r][:k], expected[r, :k], atol=2e-5)
        np.testing.assert_allclose(out.logits[r][:k], logits[r, 7 : 7 + k], atol=2e-5)
        assert out.logits[r].shape == (len(tokens), 16)


# --- (e) new weights: new outputs, no new program ----------------------------------------------


@pytest.mark.parametrize("draft", ["self:1", "quant:int8", "block"])
def test_update_params_changes_outputs_without_compiling(model, tok, native, draft, request):
    """Two weight versions, one assigned to the module in place (what an optimizer step does),
    one by ``update_params``: our greedy outputs and logprobs are the native sampler's on those
    weights, and no XLA program is built (after a first call of each shape). The drafts follow
    the weights: ``self:1`` reads them, ``quant:int8`` is re-quantized from them (its quantizing
    programs are compiled once per matrix shape), a block drafter reads their features with its
    own weights."""
    if draft == "block":
        draft = request.getfixturevalue("block_draft")
    live = _llama(seed=1)  # this test's own copy: it is updated in place
    sampler = AspsSampler(live, tok, draft, **OPTIONS)
    call = dict(max_generation_steps=10, return_logprobs=True)
    first, theirs = sampler(PROMPTS, **call), _call(native, PROMPTS, **call)
    assert first.text == theirs.text
    compile_cache.count_compiles()
    built = 0  # programs built by our calls (the native sampler's own are not counted)
    try:
        # In place first: update_params makes the sampler hold the given variables instead.
        for seed, how in ((2, "in place"), (4, "update_params")):
            new = _llama(seed)
            before = compile_cache.compiles()["programs"]
            if how == "update_params":
                sampler.update_params(nnx.state(new, nnx.Param))
            else:
                nnx.update(live, nnx.state(new))
            got = sampler(PROMPTS, **call)
            built += compile_cache.compiles()["programs"] - before
            native.transformer_state = nnx.variables(new)
            theirs = _call(native, PROMPTS, **call)
            assert got.text == theirs.text and got.text != first.text
            for a, b in zip(got.logprobs, theirs.logprobs):
                np.testing.assert_allclose(a, b, atol=2e-5)
        assert built == 0
    finally:
        native.transformer_state = nnx.variables(model)


# --- (f) tunix's RL rollout code drives it ------------------------------------------------------


def test_tunix_rl_rollout_drives_it(tok):
    """``RLCluster``'s construction of a custom engine (a ``functools.partial`` of a
    ``BaseRollout``), ``VanillaRollout``'s sampler calls and weight update on our sampler, the
    GRPO learner's padding of the completions, and ``sync_weights``' transfer guards."""
    config = base_rollout.RolloutConfig(
        max_tokens_to_generate=6,
        max_prompt_length=8,
        temperature=1.0,
        top_p=1.0,
        seed=jax.random.PRNGKey(3),
        kv_cache_size=64,
        return_logprobs=True,
    )
    engine = functools.partial(AspsRollout, draft="self:1", **OPTIONS)
    assert issubclass(engine.func, base_rollout.BaseRollout)
    asps = engine(rollout_actor=_llama(seed=1), tokenizer=tok, mesh=None, rollout_config=config)
    vanilla = vanilla_rollout.VanillaRollout.__new__(vanilla_rollout.VanillaRollout)
    vanilla._sampler = AspsSampler(_llama(seed=1), tok, "self:1", **OPTIONS)
    for rollout, seed in ((asps, 5), (vanilla, 6)):
        for step in range(2):
            out = rollout.generate(PROMPTS, config)
            assert isinstance(out, base_rollout.RolloutOutput) and len(out.tokens) == 3
            assert out.left_padded_prompt_tokens.shape == (3, 8)
            completions = np.array(  # grpo_learner's padding
                [
                    tunix_utils.pad_to_length(t, target_length=6, pad_value=rollout.pad_id())
                    for t in out.tokens
                ]
            )
            with jax.numpy_rank_promotion("allow"):
                logps = np.asarray(
                    rollout.get_per_token_logps(
                        jnp.array(out.left_padded_prompt_tokens), jnp.array(completions)
                    )
                )
            for r, tokens in enumerate(out.tokens):
                k = len(tokens)
                np.testing.assert_allclose(out.logprobs[r], logps[r, :k], atol=2e-5)
            new = nnx.state(_llama(seed + step), nnx.Param)
            with (
                jax.transfer_guard_device_to_host("disallow_explicit"),
                jax.transfer_guard_host_to_device("disallow_explicit"),
            ):
                rollout.update_params(new, (nnx.Param,))
            np.testing.assert_array_equal(
                rollout.model().final_norm.w.get_value(), new["final_norm"]["w"].get_value()
            )


# --- (g) one-line errors -------------------------------------------------------------------------


def test_unsupported_arguments_are_one_line_errors(ours, model, tok):
    for kwargs, words in (
        (dict(beam_size=2), "beam_size"),
        (dict(images=np.zeros((1, 4, 4, 3))), "images"),
        (dict(multi_sampling=0), "multi_sampling"),
        (dict(max_generation_steps=0), "max_generation_steps"),
    ):
        kwargs = {"max_generation_steps": 4, **kwargs}
        with pytest.raises(ValueError, match=words) as e:
            ours(PROMPTS, **kwargs)
        _one_line(e)
    with pytest.raises(ValueError, match="input_strings is empty") as e:
        ours([], max_generation_steps=4)
    _one_line(e)
    for options, words in (
        (dict(temperature=0.5), "each call sets it"),
        (dict(repetition_penalty=1.2), "no such control"),
        (dict(typical_p=0.5), "no such control"),
        (dict(sampling=Sampling(min_p=0.1)), "sampling: tunix's samplers have no such control"),
    ):
        with pytest.raises(ValueError, match=words) as e:
            AspsSampler(model, tok, "self:1", **options)
        _one_line(e)
    with pytest.raises(ValueError, match="maps tunix.models.llama3.model.Llama3") as e:
        AspsSampler(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), tok)
    _one_line(e)
    state = nnx.state(model, nnx.Param)
    with pytest.raises(ValueError, match="layers/0/attn/q_proj/w is \\[32, 4, 4\\]") as e:
        ours.update_params({"layers": {0: {"attn": {"q_proj": {"w": jnp.zeros((32, 4, 4))}}}}})
    _one_line(e)
    with pytest.raises(ValueError, match="nope is not a variable") as e:
        ours.update_params({"nope": state["final_norm"]["w"]})
    _one_line(e)
    with pytest.raises(ValueError, match="omit draft_params") as e:
        ours.update_params(state, draft_params=state)
    _one_line(e)
