"""Published block-drafter layouts (asps_jax/drafters/block_layouts.py): a DFlash-layout folder read
through ``draft="block:PATH"`` and written back; P-EAGLE's and the DFlash options whose math is not
ours refused in one line.

The reference is a PyTorch DFlash drafter written here from the published architecture (z-lab's
``DFlashDraftModel``: Qwen3 decoder layers whose queries come from the block and whose keys /
values come from the fused target features followed by the block, per-head RMS norms on queries and
keys before RoPE, no mask inside the block; the block is the target's embedding of the bonus token
and of the mask token; the draft's ``norm`` then the target's ``lm_head``) on transformers' hidden
states (``hidden_states[id + 1]`` for each ``target_layer_ids`` entry), not on asps_jax. The
checkpoint is written by the test: the published tensor names and shapes, random weights.

P-EAGLE (an EAGLE-3 head with ``"parallel_drafting": true``, a pard token and ``mask_hidden``) is
checked against tests/head_reference.py's float64 EAGLE-3 layer fed the pending entries and then
n - 1 entries of the pard token with ``fc @ mask_hidden``, causally (vLLM's parallel drafting).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import types

import head_reference
import jax
import numpy as np
import pytest
import torch
from hf_checkpoints import write_tiny_llama
from safetensors.numpy import load_file, save_file

import asps_jax
from asps_jax import decode, decode_state
from asps_jax.drafters import block, peagle
from asps_jax.drafters import block_layouts as layouts
from asps_jax.drafters import block_model as bm
from asps_jax.sampler import prepare

VOCAB, E, HEADS, KV, H, F = 12, 16, 4, 2, 4, 24
TARGET_IDS = [0, 1]  # DFlash's ids: the outputs of target layers 0 and 1 (ours: entering 1, 2)
BLOCK = 4  # DFlash's block: the bonus token and 3 mask slots
MASK = 11
PROMPTS = [[1, 4, 2, 7, 3], [5, 9]]
FAST = {"xla_backend_optimization_level": 0}


def _dflash_config(**change) -> dict:
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": E,
        "intermediate_size": F,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": H,
        "num_hidden_layers": 2,
        "num_target_layers": 3,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
        "attention_bias": False,
        "hidden_act": "silu",
        "layer_types": ["full_attention", "full_attention"],
        "block_size": BLOCK,
        "dflash_config": {
            "block_size": BLOCK,
            "mask_token_id": MASK,
            "target_layer_ids": TARGET_IDS,
        },
    }
    return {**config, **change}


def _dflash_weights(seed: int) -> dict[str, np.ndarray]:
    """The published tensors of a 2-layer DFlash drafter (random; norms around 1)."""
    rng = np.random.default_rng(seed)

    def w(*shape, norm=False):
        a = 1 + 0.3 * rng.standard_normal(shape) if norm else 0.5 * rng.standard_normal(shape)
        return a.astype(np.float32)

    t = {"fc.weight": w(E, len(TARGET_IDS) * E), "hidden_norm.weight": w(E, norm=True)}
    for i in range(2):
        p = f"layers.{i}."
        t |= {
            p + "input_layernorm.weight": w(E, norm=True),
            p + "self_attn.q_proj.weight": w(HEADS * H, E),
            p + "self_attn.k_proj.weight": w(KV * H, E),
            p + "self_attn.v_proj.weight": w(KV * H, E),
            p + "self_attn.o_proj.weight": w(E, HEADS * H),
            p + "self_attn.q_norm.weight": w(H, norm=True),
            p + "self_attn.k_norm.weight": w(H, norm=True),
            p + "post_attention_layernorm.weight": w(E, norm=True),
            p + "mlp.gate_proj.weight": w(F, E),
            p + "mlp.up_proj.weight": w(F, E),
            p + "mlp.down_proj.weight": w(E, F),
        }
    return t | {"norm.weight": w(E, norm=True)}


def _write(folder, config: dict, weights: dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    hf = write_tiny_llama(
        root / "target", seed=5, vocab_size=VOCAB, num_hidden_layers=3, initializer_range=0.5
    )
    weights = _dflash_weights(0)
    folder = _write(root / "dflash", _dflash_config(), weights)
    return types.SimpleNamespace(
        hf=hf, target=asps_jax.load_model(str(root / "target")), folder=folder, weights=weights
    )


# --- The published math, in PyTorch ------------------------------------------------------------


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, positions):  # x [T, heads, H]; Hugging Face's rotate-half RoPE
    inv = 1.0 / 10000.0 ** (torch.arange(0, H, 2, dtype=torch.float64) / H)
    ang = positions[:, None].double() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    rot = torch.cat([-x[..., H // 2 :], x[..., : H // 2]], -1)
    return x * cos + rot * sin


def dflash_logits(hf, weights: dict, text: list[int]) -> torch.Tensor:
    """The DFlash drafter's logits ``[B - 1, V]`` after ``text`` (the last token the bonus one):
    context = the committed positions' target features, block = bonus + mask tokens."""
    w = {k: torch.from_numpy(v).double() for k, v in weights.items()}
    with torch.no_grad():
        hidden = hf(torch.tensor([text]), output_hidden_states=True).hidden_states
        m = len(text) - 1
        feats = torch.cat([hidden[i + 1][0, :m].double() for i in TARGET_IDS], -1)
        ctx = _rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"])
        embed = hf.model.embed_tokens.weight.double()
        x = embed[[text[-1]] + [MASK] * (BLOCK - 1)]
        q_pos, k_pos = torch.arange(m, m + BLOCK), torch.arange(m + BLOCK)
        for i in range(2):
            p = {k.removeprefix(f"layers.{i}."): v for k, v in w.items()}
            h = _rms(x, p["input_layernorm.weight"])
            both = torch.cat([ctx, h])
            q = _rms((h @ p["self_attn.q_proj.weight"].T).view(BLOCK, HEADS, H),
                     p["self_attn.q_norm.weight"])  # fmt: skip
            k = _rms((both @ p["self_attn.k_proj.weight"].T).view(-1, KV, H),
                     p["self_attn.k_norm.weight"])  # fmt: skip
            v = (both @ p["self_attn.v_proj.weight"].T).view(-1, KV, H)
            q, k = _rope(q, q_pos), _rope(k, k_pos)
            k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
            att = torch.softmax(torch.einsum("qnh,knh->nqk", q, k) * H**-0.5, -1)
            o = torch.einsum("nqk,knh->qnh", att, v).reshape(BLOCK, HEADS * H)
            x = x + o @ p["self_attn.o_proj.weight"].T
            h = _rms(x, p["post_attention_layernorm.weight"])
            gate = torch.nn.functional.silu(h @ p["mlp.gate_proj.weight"].T)
            x = x + (gate * (h @ p["mlp.up_proj.weight"].T)) @ p["mlp.down_proj.weight"].T
        return _rms(x, w["norm.weight"])[1:] @ hf.lm_head.weight.double().T


# --- Reading ------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST)
def _first_laws(dec, target_params, draft_params, sampling, prompts, lengths, keys):
    """The first step's draft laws (log, every depth) after the prefill."""
    state = decode_state.prefill(dec, target_params, draft_params, prompts, lengths, keys)
    drafts = decode._draft(dec, draft_params, sampling, state)
    return drafts.logprobs_BNV[:, dec.spec.tree.layout.chain_nodes]


def test_dflash_folder_is_read_with_the_published_math(pair):
    """``draft="block:PATH"`` on a DFlash folder: DFlash's sizes and layer ids mapped to ours, the
    mask embeddings the mask token's target row, the target's head over its whole vocabulary;
    the first step's draft laws (ragged prompts) are the PyTorch DFlash drafter's at T = 1."""
    loaded = block.load_block(pair.folder, pair.target)
    c = loaded.config
    assert (c.variant, c.block_size, c.feature_layers) == ("dflash", BLOCK - 1, (1, 2))
    embed = np.asarray(pair.target.params["embed"])
    np.testing.assert_array_equal(np.asarray(loaded.params["mask_embed"]), embed[[MASK] * 3])
    head = pair.hf.lm_head.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(loaded.params["lm_head"]), head)
    call = prepare(
        pair.target, block.PREFIX + str(pair.folder), PROMPTS, key=jax.random.key(0),
        max_new_tokens=4, method="asps", num_draft_tokens=BLOCK - 1, eos_token_id=-1,
    )  # fmt: skip
    args = call.inputs.kwargs()
    names = ("target_params", "draft_params", "sampling", "prompts_BP", "prompt_lengths_B")
    laws = np.asarray(_first_laws(call.decoder, *(args[k] for k in names), args["row_keys_B"]))
    for b, prompt in enumerate(PROMPTS):
        want = torch.log_softmax(dflash_logits(pair.hf, pair.weights, prompt), -1).numpy()
        np.testing.assert_allclose(laws[b, 0], want, atol=2e-5, err_msg=str(b))
    assert np.abs(np.exp(laws) - 1 / VOCAB).max() > 0.3  # peaked: the test can see a difference


def test_dflash_round_trip(pair, tmp_path):
    """load -> to_dflash writes the folder's tensors back bit for bit with the same DFlash config
    fields; loading that gives the same parameters; our own layout holds the variant too."""
    loaded = block.load_block(pair.folder, pair.target)
    out = layouts.save(tmp_path / "out", loaded.config, loaded.params, layout="dflash",
                       target=pair.target)  # fmt: skip
    written = load_file(out / "model.safetensors")
    assert sorted(written) == sorted(pair.weights)
    for name, value in pair.weights.items():
        np.testing.assert_array_equal(written[name], value, name)
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"] == _dflash_config()["dflash_config"]
    assert config["architectures"] == ["DFlashDraftModel"] and config["num_target_layers"] == 3
    for folder in (out, bm.save(tmp_path / "ours", loaded.config, loaded.params)):
        again = block.load_block(folder, pair.target)
        assert again.config == loaded.config
        for name, value in loaded.params.items():
            np.testing.assert_array_equal(np.asarray(again.params[name]), np.asarray(value), name)


def test_dflash_bfloat16_weights(pair, tmp_path):
    """Published DFlash weights are bfloat16 (written here by torch): read as their float values."""
    from safetensors.torch import save_file as torch_save

    folder = tmp_path / "bf16"
    shutil.copytree(pair.folder, folder)
    bf16 = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in pair.weights.items()}
    torch_save(bf16, str(folder / "model.safetensors"))
    loaded = block.load_block(folder, pair.target)
    for i in range(2):
        want = bf16[f"layers.{i}.self_attn.k_norm.weight"].float().numpy()
        np.testing.assert_array_equal(np.asarray(loaded.params["k_norm"][i]), want)
    np.testing.assert_array_equal(
        np.asarray(loaded.params["fc"]), bf16["fc.weight"].float().numpy()
    )


@pytest.mark.slow
def test_dflash_drafter_samples(pair):
    """A DFlash-layout drafter runs ``sample`` with ASpS at T = 1: full-length, in-vocabulary
    tokens, and some drafts accepted."""
    out = asps_jax.sample(
        pair.target, block.PREFIX + str(pair.folder), PROMPTS * 8, seed=3, max_new_tokens=8,
        method="asps", num_draft_tokens=BLOCK - 1, eos_token_id=-1,
    )  # fmt: skip
    tokens = np.asarray(out.tokens)
    assert np.all(np.asarray(out.lengths) == 8) and tokens.min() >= 0 and tokens.max() < VOCAB
    steps = np.asarray(out.stats["tokens_per_step"])
    assert np.all(np.isfinite(steps)) and steps.mean() > 1.0


# --- Refusals -----------------------------------------------------------------------------------

DF = _dflash_config()["dflash_config"]
BAD = [
    (
        "dflash2",
        dict(config={"architectures": ["DFlash2DraftModel"]}),
        r"unsupported DFlash family \(architectures \['DFlash2DraftModel'\]\)",
    ),
    ("causal", dict(config={"is_causal": True}), "a causal block"),
    (
        "sliding",
        dict(config={"layer_types": ["sliding_attention"] * 2}),
        r"a causal block \(is_causal / layer_types \['sliding_attention'\]\)",
    ),
    ("bias", dict(config={"attention_bias": True}), "attention_bias is true"),
    (
        "embed_scale",
        dict(config={"dflash_config": {**DF, "input_embedding_scale": 2.0}}),
        "input_embedding_scale 2.0; only 1.0",
    ),
    (
        "softcap",
        dict(config={"dflash_config": {**DF, "final_logit_softcapping": 20.0}}),
        "final_logit_softcapping 20.0",
    ),
    (
        "no_mask",
        dict(config={"dflash_config": {"block_size": 4, "target_layer_ids": TARGET_IDS}}),
        "not a valid DFlash config .*mask_token_id",
    ),
    (
        "mask_outside",
        dict(config={"dflash_config": {**DF, "mask_token_id": VOCAB}}),
        r"mask_token_id 12 is outside \[0, 12\)",
    ),
    (
        "last_layer",
        dict(config={"dflash_config": {**DF, "target_layer_ids": [0, 2]}}),
        r"target_layer_ids \[0, 2\] must be in \[0, 2\) for a target of 3 layers",
    ),
    (
        "missing_tensor",
        dict(drop=("layers.1.self_attn.k_norm.weight",)),
        "the weights lack tensor 'layers.1.self_attn.k_norm.weight'",
    ),
    (
        "shape",
        dict(tensors={"fc.weight": np.zeros((E, 3 * E), np.float32)}),
        r"tensor 'fc.weight' is float32 of shape \[16, 48\], the config says floats of shape",
    ),
    (
        "width",
        dict(config={"hidden_size": 32}),
        "reads features of width 32, the target .* has hidden size 16",
    ),
]


@pytest.mark.parametrize("case, change, match", BAD, ids=[c[0] for c in BAD])
def test_unmappable_checkpoint_is_a_one_line_error(pair, tmp_path, case, change, match):
    """A published checkpoint whose architecture is not ours, or a broken DFlash one: one line
    naming the folder, before anything runs."""
    folder = tmp_path / "bad"
    shutil.copytree(pair.folder, folder)
    config = {**_dflash_config(), **change.get("config", {})}
    weights = {**pair.weights, **change.get("tensors", {})}
    weights = {k: v for k, v in weights.items() if k not in change.get("drop", ())}
    _write(folder, config, weights)
    with pytest.raises(ValueError, match=match) as err:
        asps_jax.sample(pair.target, block.PREFIX + str(folder), [[1]], seed=0, max_new_tokens=2)
    assert "\n" not in str(err.value) and str(folder) in str(err.value)


def test_unwritable_drafter_is_a_one_line_error(pair, tmp_path):
    """Writing what the DFlash layout cannot hold (our variant, a recurrent readout, another head,
    mask embeddings that are not one token's, a draft vocabulary) or P-EAGLE: one line, nothing
    written."""
    loaded = block.load_block(pair.folder, pair.target)
    c, p = loaded.config, loaded.params
    ours = bm.BlockConfig.for_target(pair.target.config, layers=(1, 2), block_size=3)
    ours_params = bm.init_params(ours, jax.random.key(0), p["embed"], np.arange(VOCAB))
    masks = np.asarray(p["mask_embed"]).copy()
    masks[1] += 1.0
    cases = [
        (ours, ours_params, "dflash", "variant 'asps' .* holds variant 'dflash' only"),
        (
            dataclasses.replace(c, readout="recurrent", readout_size=4),
            p,
            "dflash",
            "readout is 'recurrent'; DFlash reads each position's law from its state alone",
        ),  # fmt: skip
        (c, dict(p, lm_head=p["lm_head"] * 2), "dflash", "lm_head is not the target's output head"),
        (c, dict(p, mask_embed=masks), "dflash", "not N copies of one target token's embedding"),
        (c, p, "p-eagle", "a block drafter cannot be written in it: P-EAGLE's layer attends"),
        (c, p, "medusa", r"layout='medusa': one of \['asps', 'dflash', 'p-eagle'\]"),
    ]
    for i, (config, params, layout, match) in enumerate(cases):
        out = tmp_path / f"out{i}"
        with pytest.raises(ValueError, match=match) as err:
            layouts.save(out, config, params, layout=layout, target=pair.target)
        assert "\n" not in str(err.value) and not out.exists(), layout


# --- P-EAGLE ------------------------------------------------------------------------------------

PARD, PEAGLE_N = 10, 3
PEAGLE_LAYERS = [2, 1, 0]  # ours and EAGLE-3's ids: the streams entering these target layers
PEAGLE_D2T = [0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11]  # every target token but 4


def _peagle_folder(folder, seed: int = 1, **change):
    """A P-EAGLE head in the EAGLE-3 layout, as vLLM reads it: random weights (norms around 1),
    ``d2t`` offsets / ``t2d``, ``mask_hidden`` of shape [1, 1, F], and ``"parallel_drafting"``
    with a pard token in config.json."""
    rng = np.random.default_rng(seed)
    w = lambda *shape: (0.5 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    norm = lambda: (1 + 0.3 * rng.standard_normal(E)).astype(np.float32)  # noqa: E731
    m = "midlayer."
    tensors = {
        "fc.weight": w(E, 3 * E),
        m + "input_layernorm.weight": norm(),
        m + "hidden_norm.weight": norm(),
        m + "self_attn.q_proj.weight": w(HEADS * H, 2 * E),
        m + "self_attn.k_proj.weight": w(KV * H, 2 * E),
        m + "self_attn.v_proj.weight": w(KV * H, 2 * E),
        m + "self_attn.o_proj.weight": w(E, HEADS * H),
        m + "post_attention_layernorm.weight": norm(),
        m + "mlp.gate_proj.weight": w(F, E),
        m + "mlp.up_proj.weight": w(F, E),
        m + "mlp.down_proj.weight": w(E, F),
        "norm.weight": norm(),
        "lm_head.weight": w(len(PEAGLE_D2T), E),
        "d2t": np.asarray(PEAGLE_D2T, np.int64) - np.arange(len(PEAGLE_D2T)),
        "t2d": np.isin(np.arange(VOCAB), PEAGLE_D2T),
        "mask_hidden": w(1, 1, 3 * E),
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": E,
        "intermediate_size": F,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": H,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "vocab_size": VOCAB,
        "draft_vocab_size": len(PEAGLE_D2T),
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": PEAGLE_LAYERS},
        "parallel_drafting": True,
        "pard_token": PARD,
        **change,
    }
    return _write(folder, config, tensors), tensors


def peagle_laws(ref, tensors, hf, text, n: int) -> np.ndarray:
    """P-EAGLE's n laws after ``text`` (its last token the bonus one): the pending entries, then
    n - 1 pard entries with ``fc @ mask_hidden``, each law placed on the target's vocabulary."""
    m = len(text) - 1
    features = head_reference.hf_features(hf, text, PEAGLE_LAYERS)
    hiddens = list(ref.fused(features[:m])) if m else [np.zeros(E)]
    tokens = list(text[1:]) if m else list(text)
    mask = ref.fused(tensors["mask_hidden"].reshape(1, -1))[0]
    logits, _ = ref.entries(hiddens + [mask] * (n - 1), tokens + [PARD] * (n - 1))
    last = len(hiddens) - 1
    return np.stack([ref.law(row) for row in logits[last : last + n]])


PEAGLE_PROMPTS = [[1, 4, 2, 7, 3], [5]]  # the one-token prompt: EAGLE-3's placeholder entry


def test_peagle_folder_is_read_with_the_published_math(pair, tmp_path):
    """``draft="block:PATH"`` on a P-EAGLE folder: an EAGLE-3 head drafting in parallel; the first
    step's laws at every depth of both chains (ragged prompts, a one-token one) are the
    reference's, 0 at the token outside the draft vocabulary."""
    folder, tensors = _peagle_folder(tmp_path / "peagle")
    loaded = block.load_block(folder, pair.target)
    assert isinstance(loaded.config, peagle.PEagleConfig) and loaded.config.pard_token == PARD
    call = prepare(
        pair.target, block.PREFIX + str(folder), PEAGLE_PROMPTS, key=jax.random.key(0),
        max_new_tokens=4, method="specinfer", num_drafts=2, num_draft_tokens=PEAGLE_N,
        eos_token_id=-1,
    )  # fmt: skip
    args = call.inputs.kwargs()
    names = ("target_params", "draft_params", "sampling", "prompts_BP", "prompt_lengths_B")
    laws = np.exp(_first_laws(call.decoder, *(args[k] for k in names), args["row_keys_B"]))
    embed = pair.hf.model.embed_tokens.weight.detach().double().numpy()
    ref = head_reference.Head(folder, embed)
    for b, prompt in enumerate(PEAGLE_PROMPTS):
        want = peagle_laws(ref, tensors, pair.hf, prompt, PEAGLE_N)
        for k in range(2):  # both chains (the head's cache replicas) draw from the same laws
            np.testing.assert_allclose(np.asarray(laws[b, k]), want, atol=2e-5, err_msg=f"{b}")
    assert np.all(np.asarray(laws)[..., 4] == 0) and np.abs(want - 1 / VOCAB).max() > 0.3


def test_peagle_round_trip(pair, tmp_path):
    """load -> save(layout="p-eagle") writes the head's tensors back (``mask_hidden`` flattened, as
    vLLM reads it) with the P-EAGLE config fields; loading that gives the same parameters."""
    folder, tensors = _peagle_folder(tmp_path / "peagle")
    loaded = block.load_block(folder, pair.target)
    out = layouts.save(tmp_path / "out", loaded.config, loaded.params, layout="p-eagle")
    written = load_file(out / "model.safetensors")
    assert sorted(written) == sorted(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(written[name], value.reshape(written[name].shape), name)
    config = json.loads((out / "config.json").read_text())
    assert config["parallel_drafting"] is True and config["pard_token"] == PARD
    again = block.load_block(out, pair.target)
    assert again.config == loaded.config
    for name, value in loaded.params.items():
        np.testing.assert_array_equal(np.asarray(again.params[name]), np.asarray(value), name)


@pytest.mark.slow
def test_peagle_drafter_samples(pair, tmp_path):
    """A P-EAGLE drafter runs ``sample`` with ASpS at T = 1 (steps after the first: the pending
    entries of accepted paths): full-length, in-vocabulary tokens."""
    folder, _ = _peagle_folder(tmp_path / "peagle")
    out = asps_jax.sample(
        pair.target, block.PREFIX + str(folder), PEAGLE_PROMPTS * 2, seed=3, max_new_tokens=8,
        method="asps", num_draft_tokens=PEAGLE_N, eos_token_id=-1,
    )  # fmt: skip
    tokens = np.asarray(out.tokens)
    assert np.all(np.asarray(out.lengths) == 8) and tokens.min() >= 0 and tokens.max() < VOCAB
    assert np.all(np.isfinite(np.asarray(out.stats["tokens_per_step"])))


BAD_PEAGLE = [
    ("no_pard", dict(pard_token=None), r"needs 'pard_token' \(or 'ptd_token_id'\)"),
    ("pard_outside", dict(pard_token=VOCAB), r"a token id in \[0, 12\), got 12"),
    ("two_layers", dict(num_hidden_layers=2), "an EAGLE-3 head has one layer, got 2"),
    ("speculators", dict(speculators_model_type="peagle"), "the speculators' P-EAGLE config"),
]


@pytest.mark.parametrize("case, change, match", BAD_PEAGLE, ids=[c[0] for c in BAD_PEAGLE])
def test_bad_peagle_is_a_one_line_error(pair, tmp_path, case, change, match):
    """A P-EAGLE folder that cannot be read: one line naming the folder."""
    folder, _ = _peagle_folder(tmp_path / "bad", **change)
    with pytest.raises(ValueError, match=match) as err:
        asps_jax.sample(pair.target, block.PREFIX + str(folder), [[1]], seed=0, max_new_tokens=2)
    assert "\n" not in str(err.value) and str(folder) in str(err.value)


def test_peagle_folder_as_an_eagle3_head_is_a_one_line_error(pair, tmp_path):
    """``eagle3:PATH`` on a P-EAGLE folder would draft it one forward per token, not as trained:
    refused in one line that names ``block:PATH``."""
    from asps_jax.models import eagle3

    folder, _ = _peagle_folder(tmp_path / "peagle")
    with pytest.raises(ValueError, match=r'parallel_drafting.*draft="block:') as err:
        eagle3.load_head(folder, pair.target)
    assert "\n" not in str(err.value) and str(folder) in str(err.value)


def test_missing_mask_hidden_is_a_one_line_error(pair, tmp_path):
    folder, tensors = _peagle_folder(tmp_path / "bad")
    save_file(
        {k: v for k, v in tensors.items() if k != "mask_hidden"}, str(folder / "model.safetensors")
    )
    with pytest.raises(ValueError, match="tensor 'mask_hidden' is missing") as err:
        block.load_block(folder, pair.target)
    assert "\n" not in str(err.value)


def test_published_drafters_place_on_a_mesh(pair, tmp_path):
    """Every parameter of a DFlash-layout and a P-EAGLE drafter has its logical axes (what
    ``shard_params`` reads): on a data=2, model=4 mesh a chip holds less than the whole."""
    from asps_jax import sharding

    folder, _ = _peagle_folder(tmp_path / "peagle")
    for loaded in (
        block.load_block(pair.folder, pair.target),
        block.load_block(folder, pair.target),
    ):
        whole = sum(a.size * a.dtype.itemsize for a in loaded.params.values())
        per_chip = sharding.chip_bytes(loaded.params, loaded.config, {"data": 2, "model": 4})
        assert 0 < per_chip < whole, type(loaded.config).__name__


def test_dflash_config_fields():
    """transformers 5's ``rope_parameters``, DFlash's default ``target_layer_ids`` (one per draft
    layer, 1 .. L - 3 evenly: [1, 9, 17, 25, 33] for 5 layers on a 36-layer target) and a
    top-level ``block_size``; a tied target's head is its embedding."""
    raw = _dflash_config(rope_theta=None, rope_parameters={"rope_type": "default",
                         "rope_theta": 5e5}, num_hidden_layers=5, num_target_layers=36)  # fmt: skip
    raw["dflash_config"] = {"mask_token_id": MASK}
    raw["block_size"] = 8
    target_config = types.SimpleNamespace(num_hidden_layers=36)
    c, mask = layouts.dflash_config(raw, target_config, "here")
    assert (c.rope_theta, c.rope_scaling, mask, c.block_size) == (5e5, None, MASK, 7)
    assert c.feature_layers == (2, 10, 18, 26, 34)  # DFlash's ids + 1: the streams entering them
    embed = np.arange(6, dtype=np.float32).reshape(3, 2)
    tied = types.SimpleNamespace(params={"embed": embed})
    np.testing.assert_array_equal(layouts.target_head(tied), embed)
