"""Weight-only quantization (asps_jax/models/quant.py): the integers and scales against a NumPy
reference, every family's quantized forward against transformers run on the dequantized weights,
a quantized target's sampling law, the target's own quantized copy as a draft (``quant:int8`` /
``quant:int4``) keeping the full-precision target's law (exact enumeration, and chi-square
through ``sample`` for sps, asps, specinfer and a tv tree), ``Sampler.update_params`` refreshing
it, and the one-line errors."""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tabular as tab
import torch
import transformers
from hf_checkpoints import FAMILY_CONFIGS, write_tiny_family, write_tiny_llama
from multidraft_laws import node_law
from multidraft_reference import continuation_error, tree_law
from test_decode import _hf_greedy
from test_self_draft import PROMPT, VOCAB, N, _cli, _laws, _outcome

import asps_jax
from asps_jax import drafters
from asps_jax.cli import flags
from asps_jax.models import quant, save_checkpoint
from asps_jax.models.base import forward_for, run_params
from asps_jax.models.llama import init_params as llama_init

INT4 = "int4:8"  # the tiny Llama: head_dim 4 (a group is two heads of wo), 16 / 32 inputs


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(hf target, our target): a 3-layer tiny Llama with peaked laws over 5 tokens."""
    path = tmp_path_factory.mktemp("quant")
    hf = write_tiny_llama(
        path, seed=3, vocab_size=VOCAB, num_hidden_layers=3, initializer_range=0.5
    )
    return hf, asps_jax.load_model(str(path))


# --- The integers and scales ------------------------------------------------------------------

# The contracted (input) axes of each stored Llama matrix [L, in..., out...], written out here
# rather than derived as quant.py does.
LLAMA_INPUTS = {"wq": (1,), "wk": (1,), "wv": (1,), "wo": (1, 2), "w_gate": (1,), "w_up": (1,)}
LLAMA_INPUTS["w_down"] = (1,)


def _tiles(w: np.ndarray, inputs: tuple, group: int | None) -> np.ndarray:
    """``w`` as ``[output channels..., groups, group]``: each output channel's inputs flattened
    in order and cut into groups of ``group`` (one group of all of them for None)."""
    last = list(range(w.ndim - len(inputs), w.ndim))
    flat = np.moveaxis(w, list(inputs), last)
    flat = flat.reshape(*flat.shape[: w.ndim - len(inputs)], -1)
    size = flat.shape[-1]
    return flat.reshape(*flat.shape[:-1], size // (group or size), group or size)


@pytest.mark.parametrize("spec, bits, group", [("int8", 8, None), (INT4, 4, 8)])
def test_integers_and_scales_are_the_numpy_reference(llama, spec, bits, group):
    """Symmetric absmax quantization in NumPy: scale = absmax / (qmax + 1/2) over each output
    channel's inputs (or group of them), integers round(w / scale) clipped to [-qmax - 1, qmax]
    (a value at a rounding tie, e.g. -absmax at -qmax - 1/2, may go either way)."""
    _, target = llama
    stored = quant.quantize_model(target, spec).params
    assert quant.is_quantized(stored) and not quant.is_quantized(target.params)
    qmax = 2 ** (bits - 1) - 1
    for name, inputs in LLAMA_INPUTS.items():
        w = _tiles(np.asarray(target.params["layers"][name], np.float32), inputs, group)
        scale = np.abs(w).max(-1, keepdims=True) / np.float32(qmax + 0.5)
        ratio = w / scale
        want = np.clip(np.round(ratio), -qmax - 1, qmax)
        q = stored["layers"][name]
        held = _tiles(np.asarray(q.qvalue, np.float32), inputs, group)
        got_scale = _tiles(np.asarray(q.scale, np.float32), inputs, 1)
        np.testing.assert_allclose(got_scale, scale, rtol=1e-6, err_msg=name)
        tie = np.abs(np.abs(ratio - np.floor(ratio)) - 0.5) < 1e-3
        np.testing.assert_array_equal(held[~tie], want[~tie], err_msg=name)
        assert np.all(np.abs(held - want) <= 1) and held.min() >= -qmax - 1 and held.max() <= qmax
        assert q.qvalue.dtype == (jnp.int8 if bits == 8 else jnp.int4), name
        deq = _tiles(np.asarray(quant.dequantize_params({"w": q})["w"]), inputs, group)
        np.testing.assert_allclose(deq, held * got_scale, rtol=1e-6, err_msg=name)
    # The rest stays float: the embedding, norms and head.
    for name in ("embed", "final_norm", "lm_head"):
        np.testing.assert_array_equal(stored[name], target.params[name])
    norms = stored["layers"]["attn_norm"]
    np.testing.assert_array_equal(norms, target.params["layers"]["attn_norm"])


# --- Every family against transformers ---------------------------------------------------------

FAMILY_SPECS = [(family, "int8") for family in FAMILY_CONFIGS] + [
    ("llama", INT4),
    ("opt", "int4:16"),
    ("gemma2", "int4:16"),
    ("qwen3", "int4:8"),
]


@pytest.mark.parametrize("family, spec", FAMILY_SPECS)
def test_quantized_forward_is_transformers_on_the_dequantized_weights(tmp_path, family, spec):
    """load_model(quantize=...) of a real checkpoint; its logits (run layout, one jitted
    forward) against transformers on the dequantized weights, written back through
    save_checkpoint: the quantized model *is* that float model."""
    if family == "llama":
        write_tiny_llama(tmp_path / "ckpt", seed=0)
    else:
        write_tiny_family(tmp_path / "ckpt", family, seed=0)
    full = asps_jax.load_model(str(tmp_path / "ckpt"))
    model = asps_jax.load_model(str(tmp_path / "ckpt"), quantize=spec)
    assert model.name.endswith(f"[{spec}]") and quant.is_quantized(model.params)
    save_checkpoint(tmp_path / "deq", model.config, quant.dequantize_params(model.params))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "deq", attn_implementation="eager"
    ).eval()
    tokens = np.array([[3, 1, 4, 1, 5, 9, 2, 6]], np.int32)
    with torch.no_grad():
        want = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    T = tokens.shape[1]
    forward = jax.jit(forward_for(model.config))
    positions = np.arange(T, dtype=np.int32)[None]
    mask = np.tril(np.ones((1, T, T), bool))
    got, _ = forward(run_params(model), tokens, positions, mask, None)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4, err_msg=family)
    if family == "llama":  # one token (a decode step's shape) too
        one, _ = forward(run_params(model), tokens[:, :1], positions[:, :1], mask[:, :1, :1], None)
        np.testing.assert_allclose(np.asarray(one), want[:, :1], rtol=1e-4, atol=1e-4)
    # ... and quantization changed the model (the comparison is not float against float).
    float_logits, _ = forward(run_params(full), tokens, positions, mask, None)
    assert np.abs(np.asarray(float_logits) - want).max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("family, quantized_target", [("gpt2", True), ("qwen3", False)])
def test_greedy_sample_is_transformers_generate(tmp_path, family, quantized_target):
    """Temperature 0 through ``sample`` with ASpS: an int8 GPT-2 target (stacked layers, a scan)
    drafted by its own first layer is transformers' greedy ``generate`` on the dequantized
    weights; a float Qwen3 target (per-layer run layout) drafted by its int8 copy is
    ``generate`` on the float weights."""
    write_tiny_family(tmp_path / "ckpt", family, seed=0)
    full = asps_jax.load_model(str(tmp_path / "ckpt"))
    target = quant.quantize_model(full, "int8") if quantized_target else full
    save_checkpoint(tmp_path / "ref", target.config, quant.dequantize_params(target.params))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ref", attn_implementation="eager"
    ).eval()
    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    expected = [_hf_greedy(hf, prompt, 6) for prompt in prompts]
    out = asps_jax.sample(
        target,
        "self:1" if quantized_target else "quant:int8",
        prompts,
        method="asps",
        key=jax.random.key(0),
        max_new_tokens=6,
        num_draft_tokens=2,
        temperature=0.0,
        eos_token_id=-1,
    )
    assert np.asarray(out.tokens).tolist() == expected


# --- Laws --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dequantized(llama, tmp_path_factory):
    """{spec: transformers model on the dequantized weights of the tiny Llama's quantized copy}."""
    _, target = llama
    out = {}
    for spec in ("int8", INT4):
        path = tmp_path_factory.mktemp(spec.replace(":", "_"))
        copy = drafters.draft_model(target, quant.PREFIX + spec)
        save_checkpoint(path, copy.config, quant.dequantize_params(copy.params))
        out[spec] = transformers.AutoModelForCausalLM.from_pretrained(
            path, attn_implementation="eager"
        ).eval()
    return out


def test_exact_enumeration_of_the_quantized_self_draft(llama, dequantized):
    """The quantized copies' laws (transformers on their dequantized weights) verified by SpS,
    ASpS and SpecInfer with two chains: the emitted string continued by the target has exactly
    the full-precision target's law."""
    hf, _ = llama
    target = _laws(hf, N + 1)
    want = tab.joint(target, N + 1)
    for spec, model in dequantized.items():
        draft = _laws(model, N)
        gap = max(np.abs(t - d).max() for t, d in zip(target, draft))
        assert gap > (1e-3 if spec == "int8" else 0.02), spec  # a draft, not the target
        drafts, weight, q_rows, p_rows = tab.draft_enumeration(target, draft, N)
        for method in ("sps", "asps"):
            stop, full = _outcome(method, drafts, q_rows, p_rows, N)
            emitted = tab.emitted_law(stop, full, weight, drafts, p_rows[:, N], N)
            got = tab.continue_with_target(emitted, target)
            np.testing.assert_allclose(got, want, atol=1e-10, err_msg=f"{spec} {method}")
        law, _ = tree_law(node_law("specinfer", VOCAB), target, [draft, draft], N)
        assert continuation_error(law, target, N) <= 1e-10, spec


ROWS = 6000
STAT_CASES = [
    ("sps", dict(num_draft_tokens=N)),
    ("asps", dict(num_draft_tokens=N)),
    ("specinfer", dict(num_drafts=2, num_draft_tokens=N)),
    ("tv", dict(tree=(2, 2))),
]


def _chi_square(out, law, what: str) -> None:
    tokens = np.asarray(out.tokens)
    assert np.all(np.asarray(out.lengths) == 3), what
    index = (tokens[:, 0] * VOCAB + tokens[:, 1]) * VOCAB + tokens[:, 2]
    pvalue = tab.chi_square_pvalue(index, VOCAB**3, law)
    assert pvalue > 1e-3, f"{what}: chi-square p-value {pvalue:.2e}"


@pytest.mark.slow
@pytest.mark.optimized  # the law run outweighs its compile (tests/conftest.py)
@pytest.mark.parametrize("method, kw", STAT_CASES, ids=[m for m, _ in STAT_CASES])
def test_quantized_self_draft_keeps_the_target_law(llama, method, kw):
    """ROWS rows (one jitted loop), the int4 copy drafting: the first three tokens against
    transformers' exact law of the full-precision target (chi-square), and the draft was used."""
    hf, target = llama
    out = asps_jax.sample(
        target,
        quant.PREFIX + INT4,
        [PROMPT] * ROWS,
        key=jax.random.key(5),
        max_new_tokens=3,
        method=method,
        eos_token_id=-1,
        **kw,
    )
    _chi_square(out, tab.joint(_laws(hf, 3), 3), f"quant:{INT4} {method}")
    assert np.mean(np.asarray(out.stats["tokens_per_step"])) > 1.2


@pytest.mark.slow
def test_quantized_target_samples_the_quantized_law(llama, dequantized):
    """A quantized target (AR) samples exactly the law of its dequantized float weights, which is
    not the full-precision law (the test tells them apart)."""
    hf, target = llama
    model = quant.quantize_model(target, INT4)
    out = asps_jax.sample(
        model, None, [PROMPT] * ROWS, key=jax.random.key(6), max_new_tokens=3, method="ar",
        eos_token_id=-1,
    )  # fmt: skip
    _chi_square(out, tab.joint(_laws(dequantized[INT4], 3), 3), "quantized target")
    tokens = np.asarray(out.tokens)
    index = (tokens[:, 0] * VOCAB + tokens[:, 1]) * VOCAB + tokens[:, 2]
    assert tab.chi_square_pvalue(index, VOCAB**3, tab.joint(_laws(hf, 3), 3)) < 1e-6


def test_update_params_refreshes_the_quantized_draft(llama):
    """Sampler(target, "quant:int8"): new target weights give a new quantized copy (made from
    them, not stale), the same tokens as a fresh sample() on them, and no recompile."""
    _, target = llama
    sampler = asps_jax.Sampler(target, "quant:int8", method="asps", num_draft_tokens=N)
    first = sampler([PROMPT], max_new_tokens=4, seed=1)
    compiles = sampler.compiles
    new = jax.tree.map(lambda a: a * 1.5, target.params)
    sampler.update_params(new)
    second = sampler([PROMPT], max_new_tokens=4, seed=1)
    assert sampler.compiles == compiles
    copy = drafters.draft_model(sampler.target, "quant:int8")
    np.testing.assert_allclose(
        quant.dequantize_params(copy.params)["layers"]["wq"], new["layers"]["wq"], atol=0.05
    )
    want = asps_jax.sample(
        sampler.target, "quant:int8", [PROMPT], seed=1, max_new_tokens=4, method="asps",
        num_draft_tokens=N,
    )  # fmt: skip
    np.testing.assert_array_equal(second.tokens, want.tokens)
    assert not np.array_equal(first.tokens, second.tokens)  # the weights did change
    with pytest.raises(ValueError, match="no weights of its own") as err:
        sampler.update_params(new, draft_params=new)
    assert "\n" not in str(err.value)


# --- One-line errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, match",
    [
        ("int3", "'int8' \\(per channel\\) or 'int4'"),
        ("int4:0", "'int4:G'"),
        ("int4:x", "'int4:G'"),
        ("int8:4", "'int8'"),
        (8, "weight-only quantization"),
        ("int4:12", "w_down has 32 inputs per output \\(32\\), which groups of 12 do not divide; "
         "give a group size that divides every matrix \\(here 'int4:8'\\) or 'int8'"),
        ("int4:3", "which groups of 3 do not divide; .* \\(here 'int4:2'\\)"),
        ("int4:\u0663", "'int4:G'"),  # an Arabic-Indic 3: ASCII digits only (issue 66)
        ("int4:+8", "'int4:G'"),
    ],
)  # fmt: skip
def test_bad_quantize_is_a_one_line_error(llama, spec, match):
    _, target = llama
    with pytest.raises(ValueError, match=match) as err:
        quant.quantize_model(target, spec)
    assert "\n" not in str(err.value)


def test_bad_requests_name_what_is_wrong(llama, tmp_path):
    _, target = llama
    with pytest.raises(ValueError, match="draft='quant:int2': weight-only") as err:
        drafters.draft_model(target, "quant:int2")
    assert "\n" not in str(err.value)
    int8 = quant.quantize_model(target, "int8")
    with pytest.raises(ValueError, match="quantized already"):
        quant.quantize_params(target.config, int8.params, "int8")
    with pytest.raises(
        ValueError, match=r"draft='quant:int4:8': the target .*\[int8\] is q"
    ) as err:
        drafters.draft_model(int8, "quant:int4:8")
    assert "\n" not in str(err.value)
    own = asps_jax.models.own_model(
        lambda *a: None, {"w": jnp.ones((4, 4))}, vocab_size=4, num_hidden_layers=1,
        num_key_value_heads=1, head_dim=4, max_position_embeddings=8,
    )  # fmt: skip
    with pytest.raises(ValueError, match="no param_axes") as err:
        quant.quantize_model(own, "int8")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="weight-only"):
        asps_jax.load_model(str(tmp_path / "nothing here"), quantize="int16")


def test_cli_flag_checks_the_spec():
    assert flags.quantize("int4:64") == "int4:64"
    with pytest.raises(argparse.ArgumentTypeError, match="^weight-only quantization is 'int8'"):
        flags.quantize("fp8")


def test_quantizing_again_compiles_nothing():
    """Quantizing a stored layout compiles one small program per matrix shape and scheme (an RL
    loop re-quantizes every update): a second weight set of the same shapes compiles nothing."""
    from asps_jax.models import LlamaConfig

    config = LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
    )  # fmt: skip
    params = llama_init(config, jax.random.key(0))
    quant.quantize_params(config, params, "int8")
    before = quant._quantize._cache_size()
    quant.quantize_params(config, jax.tree.map(lambda a: a + 1, params), "int8")
    assert quant._quantize._cache_size() == before


@pytest.mark.slow
def test_cli_quantized_target_and_draft(capsys):
    """scripts/sample.py with the target and the draft checkpoint loaded as int8, then the
    target's own int8 copy as the draft: both run, and the copy is accepted nearly always."""
    cli = _cli()
    argv = ["--max-new-tokens", "8", "--num-draft-tokens", "3", "--method", "asps", "--json"]
    assert cli.main(argv + ["--quantize", "int8", "--draft-quantize", "int8"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["new_tokens"] == 8 and result["tokens_per_step"] >= 1.0
    assert cli.main(argv + ["--draft", "quant:int8"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["new_tokens"] == 8 and result["acceptance"] > 0.9


def test_plain_int4_fits_the_bundled_pair(capsys):
    """The bundled target's matrices are 192 and 512 inputs wide with heads of 48: plain 'int4'
    takes groups of 16 (the largest of at most 128 dividing every matrix: 128, 96, 64 and 32 do
    not), the group the docs' int4 figures used; the draft's (64, 172, heads of 32) take 4. A
    given group that does not divide the draft's matrices is one line naming the draft model
    and the flag (issue 66)."""
    for name, group in (("tinyshakespeare-target", 16), ("tinyshakespeare-draft", 4)):
        model = asps_jax.load_model(name)
        got = quant.fitted(model.config, model.params, quant.parse("int4"))
        assert got == quant.Scheme("int4", group), name
        quant.plan(model.config, model.params, got)  # divides every matrix
        with pytest.raises(ValueError, match=f"here 'int4:{group}'"):
            quant.plan(model.config, model.params, quant.Scheme("int4", group + 1))
    cli = _cli()
    assert cli.main(["--max-new-tokens", "2", "--draft-quantize", "int4:64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sample.py: error: --draft-quantize int4:64: tinyshakespeare-draft's ")
    assert "(here 'int4:4')" in err and "\n" not in err
