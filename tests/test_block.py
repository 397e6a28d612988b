"""A parallel block drafter (``draft="block:PATH"``, asps_jax/drafters/block.py) on a tiny Llama.

References: transformers (the target's features, laws and greedy generate), a float64 NumPy block
read from the files on disk (tests/block_reference.py: the draft laws), the float64 outcome laws of
tests/tabular.py, tests/multidraft_reference.py and tests/tree_reference.py (exact enumeration),
controls_reference.py (processed laws), and the checkpoint tensors the test writes itself. The
drafter has random, peaked weights (std 0.5), two layers, a block of 3 positions (the steps use the
first N = 2), a draft vocabulary of V - 1 tokens (token 3 has draft probability 0: the residual
covers it), and reads the target's layers (0, 2, 1). Its readout is the recurrent one (depth i's
law depends on the drafted path) unless a test names ``"position"`` (``tiny``'s parameter).
"""

from __future__ import annotations

import functools
import json
import shutil
import types
from collections import defaultdict

import block_reference
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tabular as tab
import torch
import tree_reference as tref
from controls_reference import warped_probs
from hf_checkpoints import write_tiny_llama
from multidraft_laws import node_law
from multidraft_reference import tree_law
from test_controls import _tree_outcome_fn
from test_head import _processed_laws
from test_self_draft import PROMPT, VOCAB, N
from test_verify_chain import code_outcome

import asps_jax
from asps_jax import decode, decode_state, trees
from asps_jax.drafters import block
from asps_jax.drafters import block_model as bm
from asps_jax.models.cards import MODELS_DIR
from asps_jax.sampler import prepare

LAYERS = (0, 2, 1)
D2T = [0, 1, 2, 4]  # the draft vocabulary: every target token but 3
OUT = 3
BLOCK = 3
WARP = dict(temperature=0.8, top_k=3, top_p=0.98)  # leaves the (2, 2) tree two root tokens
PLAIN = dict(temperature=1.0, top_k=0, top_p=1.0)
FAST = {"xla_backend_optimization_level": 0}


READOUTS = ["recurrent", "position"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, request):
    """The tiny 3-layer Llama of test_self_draft and one block drafter saved to disk, with its
    NumPy reference read back from the files (its readout ``request.param``, else recurrent)."""
    readout = getattr(request, "param", "recurrent")
    root = tmp_path_factory.mktemp("block")
    hf = write_tiny_llama(
        root / "target", seed=3, vocab_size=VOCAB, num_hidden_layers=3, initializer_range=0.5
    )
    target = asps_jax.load_model(str(root / "target"))
    config = bm.BlockConfig.for_target(
        target.config, draft_vocab_size=len(D2T), layers=LAYERS, block_size=BLOCK, num_layers=2,
        readout=readout,
    )  # fmt: skip
    params = bm.init_params(config, jax.random.key(1), target.params["embed"], D2T, std=0.5)
    if readout == "recurrent":  # the block's states are large: the readout reads them scaled
        E = config.hidden_size  # down, so that the drafted token counts as much
        w = params["readout_in"]
        params["readout_in"] = w.at[:, :E].multiply(0.2).at[:, 2 * E :].multiply(0.2)
        params["readout_norm"] = params["readout_norm"] * 3
    folder = bm.save(root / "block", config, params)
    embed = hf.model.embed_tokens.weight.detach().double().numpy()
    return types.SimpleNamespace(
        hf=hf,
        target=target,
        config=config,
        params=params,
        folder=folder,
        spec=block.PREFIX + str(folder),
        ref=block_reference.Block(folder, embed),
    )


@pytest.mark.parametrize("tiny", READOUTS, indirect=True)
def test_block_forward_is_the_numpy_block(tiny):
    """The loaded drafter's context keys / values and block forward after PROMPT (the recurrent
    readout teacher-forced on drafted tokens 2, 4) give the NumPy block's logits, in the stored
    layout and in the CPU run layout (per-layer ``[in, out]`` weights, a cache buffer per layer);
    the placed laws are 0 outside the draft vocabulary and peaked."""
    loaded = block.load_block(tiny.folder, tiny.target)
    assert loaded.config == tiny.config
    m = len(PROMPT) - 1
    features = block_reference.hf_features(tiny.hf, PROMPT, LAYERS)[:m]

    @functools.partial(jax.jit, compiler_options=FAST)
    def run(params, features):
        ctx = bm.context_kv(tiny.config, params, features[None], jnp.arange(m)[None])
        k, v = jnp.swapaxes(ctx.k, 2, 3), jnp.swapaxes(ctx.v, 2, 3)
        if "layers" in params:  # the run layout's cache: one buffer per layer
            k, v = tuple(k), tuple(v)
        valid = jnp.ones((1, 1, m), bool)
        last = bm.context(tiny.config, params, features[None, -1:])
        root = jnp.asarray([[PROMPT[-1]]])
        parents = jnp.asarray([[[PROMPT[-1], *DRAFTED]]])
        return bm.forward(
            tiny.config, params, k, v, valid, last, root, jnp.asarray([[m]]), parents
        )[0, 0]

    want = tiny.ref.logits(features, PROMPT[-1], DRAFTED)
    run_params = bm.prepare_params(tiny.config, loaded.params)
    assert bm.prepare_params(tiny.config, run_params) is run_params
    assert len(run_params["layers"]) == 2 and run_params["layers"][0]["wq"].shape == (
        tiny.config.hidden_size, tiny.config.num_attention_heads * tiny.config.head_dim
    )  # fmt: skip
    for params in (loaded.params, run_params):
        got = np.asarray(run(params, jnp.asarray(features, jnp.float32)))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    laws = tiny.ref.laws(tiny.hf, PROMPT, drafted=DRAFTED)
    assert np.all(laws[:, OUT] == 0) and np.abs(laws - 1 / VOCAB).max() > 0.3


DRAFTED = [2, 4]  # the first BLOCK - 1 drafted tokens, for the recurrent readout


def test_recurrent_laws_follow_the_drafted_path(tiny):
    """The recurrent readout's depth-2 law changes with the token drafted at depth 1 (the
    position-wise one's cannot); a config without ``readout`` is position-wise."""
    features = block_reference.hf_features(tiny.hf, PROMPT, LAYERS)[: len(PROMPT) - 1]
    a, b = (tiny.ref.logits(features, PROMPT[-1], [x, 0]) for x in (0, 2))
    assert np.abs(a[0] - b[0]).max() == 0 and np.abs(a[1] - b[1]).max() > 0.3
    raw = tiny.config.to_hf()
    del raw["block_config"]["readout"]
    assert bm.BlockConfig.from_hf(raw, tiny.target.config).readout == "position"


# --- The draft laws, step by step ---------------------------------------------------------------

STEPS = 3
LAW_PROMPTS = [PROMPT, PROMPT[:2], [3], [2, 2, 0, 1]] * 2


@functools.partial(jax.jit, static_argnums=0)
def _run(dec, target_params, draft_params, sampling, prompts, lengths, keys):
    """Prefill and STEPS steps in one program: each step's draft laws by root path, then the
    emitted tokens and counts."""
    state = decode_state.prefill(dec, target_params, draft_params, prompts, lengths, keys)
    nodes = dec.spec.tree.layout.chain_nodes

    def body(state, _):
        drafts = decode._draft(dec, draft_params, sampling, state)
        before = state.num_generated
        state = decode._step(dec, target_params, draft_params, sampling, state)
        return state, (drafts.logprobs_BNV[:, nodes], drafts.tokens_BN[:, nodes], before)

    state, out = jax.lax.scan(body, state, None, length=STEPS)
    return out, state.tokens, state.num_generated


@pytest.mark.slow
@pytest.mark.parametrize("tiny", READOUTS, indirect=True)
def test_draft_laws_are_the_numpy_block(tiny):
    """Step by step (ragged prompts, a one-token one, K = 2 chains), both chains' draft laws at
    depths 0 and 1 are the NumPy block's laws after the committed text (the recurrent readout's
    after the chain's own drafted tokens): after the prefill, then after steps that accepted some
    draft tokens and rejected others (the accepted path's features from the scoring pass became
    the drafter's context)."""
    call = prepare(
        tiny.target, tiny.spec, LAW_PROMPTS, key=jax.random.key(5), max_new_tokens=12,
        method="specinfer", num_drafts=2, num_draft_tokens=N, eos_token_id=-1,
    )  # fmt: skip
    args = call.inputs.kwargs()
    names = ("target_params", "draft_params", "sampling", "prompts_BP", "prompt_lengths_B")
    (laws, drafted, before), tokens, count = _run(
        call.decoder, *(args[k] for k in names), args["row_keys_B"]
    )
    laws, before, tokens = np.exp(np.asarray(laws)), np.asarray(before), np.asarray(tokens)
    drafted, checked = np.asarray(drafted), 0
    for b, prompt in enumerate(LAW_PROMPTS[:4]):
        for s in range(STEPS):
            text = prompt + tokens[b, : before[s, b]].tolist()
            for k in range(2):
                path = drafted[s, b, k, : BLOCK - 1].tolist()
                want = tiny.ref.laws(tiny.hf, text, drafted=path)[:N]
                np.testing.assert_allclose(laws[s, b, k], want, atol=1e-5, err_msg=f"{b} {s}")
                checked += 1
    assert checked == 24 and np.all(laws[..., OUT] == 0)
    emitted = np.diff(np.concatenate([before, np.asarray(count)[None]]), axis=0)
    assert np.any(emitted == 1) and np.any(emitted == N + 1)  # rejected and fully accepted


# --- Exactness ----------------------------------------------------------------------------------


def _tree_enumeration(method, target, draws, tree):
    """The emitted law of ``method`` over every draw of ``tree``, continued by ``target``."""
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
    return tref.continued(total, target, N + 1)


def _enumerated(method, target, draft):
    """``method``'s exact emitted law with ``draft``'s laws, continued to N + 1 tokens."""
    if method in ("sps", "asps"):
        drafts, weight, q_rows, p_rows = tab.draft_enumeration(target, draft, N)
        stop, full = code_outcome(method, drafts, q_rows, p_rows, N)
        emitted = tab.emitted_law(stop, full, weight, drafts, p_rows[:, N], N)
        return tab.continue_with_target(emitted, target)
    if method in ("tv", "is_bv"):  # a (2, 2) tree: TV draws siblings without replacement
        tree = trees.branching_token_tree((2, 2))
        draws = list(tref.tree_draws(target, draft, list(tree.parents), method != "tv"))
        return _tree_enumeration(method, target, draws, tree)
    scheme = {"is": "is_default"}.get(method, method)
    total, _ = tree_law(node_law(scheme, VOCAB), target, [draft, draft], N)
    return tref.continued(total, target, N + 1)


@pytest.mark.slow
@pytest.mark.parametrize("tiny", READOUTS, indirect=True)
@pytest.mark.parametrize("warp", [{}, WARP], ids=["T1", "T0.8-top-k-p"])
def test_exact_enumeration_with_the_block(tiny, warp):
    """The block's laws (the NumPy reference, processed like the target's; depth 2's after the
    drafted token at depth 1 with the recurrent readout, position-wise otherwise) under
    SpS, ASpS, SpecInfer and IS with two chains, TV on a (2, 2) tree drawn without replacement and
    IS+BV on one drawn independently: the emitted string continued by the target has exactly the
    target's (processed) law, the token outside the draft vocabulary included."""
    target = _processed_laws(tiny.hf, N + 1, warp)
    process = functools.partial(warped_probs, **warp) if warp else None
    draft = block_reference.tabular_laws(tiny.ref, tiny.hf, PROMPT, N, process)
    assert max(np.abs(t - d).max() for t, d in zip(target, draft)) > 0.2  # not the target
    assert all(np.all(d[..., OUT] == 0) for d in draft) and target[1][..., OUT].max() > 0.05
    varies = np.abs(draft[1] - draft[1][:1]).max() > 0.05  # depth 2's law follows depth 1's token
    assert varies == (tiny.config.readout == "recurrent")
    want = tab.joint(target, N + 1)
    for method in ("sps", "asps", "specinfer", "is", "tv", "is_bv"):
        got = _enumerated(method, target, draft)
        assert np.abs(got - want).max() <= 1e-10, method


ROWS = 3000  # per setting; two settings (T = 1, and T = 0.8 with top-k / top-p) in one call
STAT_CASES = [
    ("sps", dict(num_draft_tokens=N), "recurrent"),
    ("asps", dict(num_draft_tokens=N), "recurrent"),
    ("specinfer", dict(num_drafts=2, num_draft_tokens=N), "recurrent"),
    ("is", dict(num_drafts=2, num_draft_tokens=N), "recurrent"),
    ("tv", dict(tree=(2, 2)), "recurrent"),
    ("is_bv", dict(tree=(2, 2)), "recurrent"),
]


# At the suite's -O0, not marked optimized: with the block drafter the 6,000-row run is ~2.5 CPU-s
# at level 1 and the compile ~10, which -O0 shortens by more than the run grows (the six: 98 CPU-s
# against 87 and 85 in two runs, one file alone, load 5-7).
@pytest.mark.slow
@pytest.mark.parametrize(
    "method, kw, tiny", STAT_CASES, ids=[f"{m}-{r}" for m, _, r in STAT_CASES], indirect=["tiny"]
)
def test_statistical_law(tiny, method, kw):
    """2 x ROWS rows in one jitted call, half at T = 1 and half at T = 0.8 with top-k and top-p
    (per-row values): each half's first three tokens against transformers' exact processed law
    (chi-square); the draft was used and the token it never drafts was emitted."""
    per_row = {k: [plain] * ROWS + [WARP[k]] * ROWS for k, plain in PLAIN.items()}
    out = asps_jax.sample(
        tiny.target, tiny.spec, [PROMPT] * (2 * ROWS), key=jax.random.key(11), max_new_tokens=3,
        method=method, eos_token_id=-1, **per_row, **kw,
    )  # fmt: skip
    tokens = np.asarray(out.tokens)
    assert np.all(np.asarray(out.lengths) == 3)
    index = (tokens[:, 0] * VOCAB + tokens[:, 1]) * VOCAB + tokens[:, 2]
    for half, warp in enumerate(({}, WARP)):
        law = tab.joint(_processed_laws(tiny.hf, 3, warp), 3)
        rows = slice(half * ROWS, (half + 1) * ROWS)
        pvalue = tab.chi_square_pvalue(index[rows], VOCAB**3, law)
        assert pvalue > 1e-3, f"{method} {warp}: chi-square p-value {pvalue:.2e}"
    assert np.any(tokens == OUT)
    assert np.mean(np.asarray(out.stats["tokens_per_step"])) > 1.2


# The greedy test's call and the Sampler test's share one compiled program (the whole block
# drafted, 8 new tokens; the temperature is a per-row value).
RUN_PROMPT = [3, 1, 4, 1, 0]
RUN = dict(method="asps", num_draft_tokens=BLOCK, eos_token_id=-1)


@pytest.mark.slow
def test_greedy_is_transformers_greedy(tiny):
    """At T = 0 the block drafter's run emits transformers' greedy continuation."""
    prompt = RUN_PROMPT
    out = asps_jax.sample(
        tiny.target, tiny.spec, [prompt], seed=0, max_new_tokens=8, temperature=0.0, **RUN
    )
    text = list(prompt)
    with torch.no_grad():  # transformers' greedy decoding, token by token (no EOS stop)
        for _ in range(8):
            text.append(int(tiny.hf(torch.tensor([text])).logits[0, -1].argmax()))
    assert np.asarray(out.tokens)[0].tolist() == text[len(prompt) :]


# --- Checkpoints --------------------------------------------------------------------------------


def test_save_then_load_gives_the_same_drafter(tiny, tmp_path):
    """save -> load_block: every parameter, the vocabulary map and the config back as they were;
    ``d2t`` is written as int64 offsets and ``t2d`` as the draft vocabulary's mask (EAGLE-3's
    convention), and a saved embedding is read back."""
    from safetensors.numpy import load_file

    loaded = block.load_block(tiny.folder, tiny.target)
    for name, value in tiny.params.items():
        np.testing.assert_array_equal(np.asarray(loaded.params[name]), np.asarray(value), name)
    tensors = load_file(tiny.folder / bm.WEIGHTS_FILE)
    assert tensors["d2t"].tolist() == [0, 0, 0, 1] and tensors["t2d"].tolist() == [1, 1, 1, 0, 1]
    own = dict(tiny.params, embed=tiny.params["embed"] * 2)
    again = block.load_block(bm.save(tmp_path / "own", tiny.config, own, embed=True), tiny.target)
    np.testing.assert_array_equal(np.asarray(again.params["embed"]), np.asarray(own["embed"]))


def _variant(tiny, tmp_path, config=None, tensors=None, drop=(), raw=None):
    """A copy of the drafter's folder with config keys / tensors changed, dropped or replaced."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "variant"
    shutil.copytree(tiny.folder, folder)
    cfg = json.loads((folder / bm.CONFIG_FILE).read_text())
    if tensors or drop:
        weights = load_file(folder / bm.WEIGHTS_FILE)
        weights = {k: v for k, v in {**weights, **(tensors or {})}.items() if k not in drop}
        save_file(weights, str(folder / bm.WEIGHTS_FILE))
    if config:
        cfg.update(config)
        (folder / bm.CONFIG_FILE).write_text(json.dumps(cfg))
    for name, data in (raw or {}).items():
        (folder / name).write_bytes(data)
    return folder


def _offsets(ids):
    return np.asarray(ids, np.int64) - np.arange(len(ids))


FOR_ANOTHER = "it was trained for another target"
BAD_BLOCKS = [
    ("no_folder", {}, "expected a block drafter folder .*found no such folder"),
    ("not_json", dict(raw={"config.json": b"{'hidden_size'"}), "config.json is not valid JSON"),
    ("json_list", dict(raw={"config.json": b"[16]"}), "config.json is not a JSON object"),
    (
        "architecture",
        dict(config={"architectures": ["LlamaForCausalLMEagle3"]}),
        r"config.json: not a block drafter \(architectures \['LlamaForCausalLMEagle3'\]\)",
    ),
    ("no_block", dict(config={"block_config": None}), "not a valid block drafter config"),
    ("zero_layers", dict(config={"num_hidden_layers": 0}), "num_hidden_layers must be >= 1"),
    (
        "missing_tensor",
        dict(drop=("layers.1.self_attn.k_proj.weight",)),
        "the weights lack tensor 'layers.1.self_attn.k_proj.weight'",
    ),
    (
        "shape",
        dict(tensors={"mask_embedding": np.zeros((2, 16), np.float32)}),
        r"tensor 'mask_embedding' has shape \[2, 16\], the config says \[3, 16\]",
    ),
    (
        "corrupt",
        dict(raw={"model.safetensors": np.random.default_rng(0).bytes(300)}),
        "model.safetensors is (truncated|corrupt)",
    ),
    ("no_d2t", dict(drop=("d2t",)), r"lack 'd2t' \(the draft-to-target map\)"),
    (
        "readout",
        dict(config={"block_config": {"block_size": 3, "readout": "attention"}}),
        r"block_config.readout must be one of \['position', 'recurrent'\], got 'attention'",
    ),
    (
        "readout_size",
        dict(config={"block_config": {"block_size": 3, "readout": "recurrent"}}),
        "block_config.readout_size must be >= 1, got 0",
    ),
    (
        "no_readout_tensor",
        dict(drop=("readout.fc_in.weight",)),
        "the weights lack tensor 'readout.fc_in.weight'",
    ),
    ("d2t_outside", dict(tensors={"d2t": _offsets([0, 1, 2, 5])}), "'d2t' must map each"),
    ("d2t_twice", dict(tensors={"d2t": _offsets([0, 1, 1, 4])}), "maps two draft ids to one"),
    (
        "width",
        dict(config={"target_hidden_size": 32}),
        f"reads features of width 32, the target .* has hidden size 16; {FOR_ANOTHER}",
    ),
    (
        "vocab",
        dict(config={"vocab_size": 6}),
        f"maps to a vocabulary of 6 tokens, the target .* has 5; {FOR_ANOTHER}",
    ),
    (
        "layers",
        dict(config={"block_config": {"block_size": 3, "target_layer_ids": [0, 1, 3]}}),
        r"reads target layers \[0, 1, 3\], the target has 3 \(ids 0 .. 2\)",
    ),
]


@pytest.mark.parametrize("case, change, match", BAD_BLOCKS, ids=[c[0] for c in BAD_BLOCKS])
def test_bad_checkpoint_is_a_one_line_error(tiny, tmp_path, case, change, match):
    """A broken or mismatched checkpoint: one line naming the folder, before anything runs."""
    folder = (
        tmp_path / "nothing here" if case == "no_folder" else _variant(tiny, tmp_path, **change)
    )
    with pytest.raises(ValueError, match=match) as err:
        asps_jax.sample(tiny.target, block.PREFIX + str(folder), [PROMPT], seed=0, max_new_tokens=2)
    assert "\n" not in str(err.value) and str(folder) in str(err.value)


def test_bad_use_is_a_one_line_error(tiny):
    """'block:' without a path, a draft longer than the block, and draft_stop."""
    calls = [
        (dict(draft="block:"), r"draft='block:': give the drafter's folder"),
        (
            dict(num_draft_tokens=BLOCK + 1),
            r"num_draft_tokens=4: the block drafter drafts at most 3",
        ),
        (dict(draft_stop="confidence:0.5"), r"draft_stop: the confidence stop is an option of"),
    ]
    for kw, match in calls:
        kw = {"draft": tiny.spec, "method": "asps", **kw}
        draft = kw.pop("draft")
        with pytest.raises(ValueError, match=match) as err:
            asps_jax.sample(tiny.target, draft, [PROMPT], seed=0, max_new_tokens=2, **kw)
        assert "\n" not in str(err.value), kw


@pytest.mark.slow
def test_sampler_update_params_keeps_the_block_drafter(tiny):
    """A ``Sampler`` with a block drafter takes new target weights without recompiling and then
    samples what ``sample`` does with them (the drafter keeps its own weights)."""
    sampler = asps_jax.Sampler(tiny.target, tiny.spec, **RUN)
    sampler([RUN_PROMPT], max_new_tokens=8, seed=0)
    new = jax.tree.map(lambda a: a * 0.9, tiny.target.params)
    sampler.update_params(new)
    before = sampler.compiles
    out = sampler([RUN_PROMPT], max_new_tokens=8, seed=1)
    assert sampler.compiles == before
    want = asps_jax.sample(sampler.target, tiny.spec, [RUN_PROMPT], max_new_tokens=8, seed=1, **RUN)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want.tokens))


# --- The bundled block drafter ------------------------------------------------------------------


def test_bundled_block_files_match_its_training_log():
    """models/tinyshakespeare-block/: a block drafter for the bundled target (its config.json read
    here, not through asps_jax), small, with the training log the script wrote."""
    folder = MODELS_DIR / "tinyshakespeare-block"
    config = json.loads((folder / "config.json").read_text())
    target = json.loads((MODELS_DIR / "tinyshakespeare-target/config.json").read_text())
    assert config["architectures"] == ["AspsBlockDrafter"] and config["block_config"]["block_size"]
    assert config["target_hidden_size"] == target["hidden_size"]
    assert config["vocab_size"] == target["vocab_size"] > config["draft_vocab_size"]
    assert (folder / "model.safetensors").stat().st_size < 6 * 2**20
    assert not (folder / "train_state.npz").exists()
    log = json.loads((folder / "training.json").read_text())
    assert log["target"] == "tinyshakespeare-target" and "--kind block" in log["command"]
    assert log["evals"][-1]["loss"] < log["evals"][0]["loss"]  # it learned


@pytest.mark.slow
def test_bundled_block_runs_out_of_the_box():
    """``draft="block:tinyshakespeare-block"`` (found under models/ by name) drafts for the
    bundled target and its drafts are accepted."""
    target = asps_jax.load_model("tinyshakespeare-target")
    prompts = [target.tokenizer.encode(line) for line in ("ROMEO:\n", "First Citizen:\nWe")]
    out = asps_jax.sample(
        target, "block:tinyshakespeare-block", prompts, seed=0, max_new_tokens=32,
        method="asps", eos_token_id=-1,
    )  # fmt: skip
    assert np.all(np.asarray(out.lengths) == 32)
    assert float(np.mean(np.asarray(out.stats["tokens_per_step"]))) > 1.5


README_REGEX = r"(ROMEO|JULIET): [a-z ]{5,40}\."


@pytest.mark.slow
def test_bundled_block_under_a_regex():
    """The bundled (recurrent) block drafter under the README's regex: at T = 0 its text is AR's
    constrained greedy text; at T = 1 on a (2, 2) tree (tv) every row is a full match, cut at
    the match by EOS, and drafts are accepted."""
    import re

    target = asps_jax.load_model("tinyshakespeare-target")
    tok, spec = target.tokenizer, "block:tinyshakespeare-block"
    kw = dict(max_new_tokens=48, regex=README_REGEX, seed=0)
    prompt = [tok.encode("JULIET:\n")]
    ar = asps_jax.sample(target, None, prompt, method="ar", temperature=0.0, **kw)
    greedy = asps_jax.sample(target, spec, prompt, method="asps", temperature=0.0, **kw)
    assert np.asarray(greedy.tokens).tolist() == np.asarray(ar.tokens).tolist()
    out = asps_jax.sample(target, spec, prompt * 4, method="tv", tree=(2, 2), **kw)
    eos = tok.eos_token_id
    for b in range(4):
        ids = np.asarray(out.tokens[b, : out.lengths[b]]).tolist()
        assert ids[-1] == eos and eos not in ids[:-1], (b, ids)
        assert re.fullmatch(README_REGEX, tok.decode(ids[:-1])), tok.decode(ids)
    assert np.asarray(out.stats["accepted"]).sum() > 0
