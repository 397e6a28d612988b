"""Mesh sharding: rules, mesh specs, and the same tokens on 1 device and on 8 fake CPU devices.

The multi-device runs happen in a subprocess (``sharding_worker.py``) because the fake device
count must be set before JAX initialises; it starts first and runs while this process computes
the single-device reference tokens. The checkpoints are tiny random Llamas written by
transformers, with the shapes of ``test_decode.py`` (one compile per method in a full run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_checkpoints import write_tiny_llama
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from subprocess_env import xla_flags
from test_cli import cli

import asps_jax
from asps_jax import footprint, sampler, sharding
from asps_jax.controls import stopping
from asps_jax.controls.processors import SamplingParams
from asps_jax.controls.stopping import StopStrings
from asps_jax.drafters import block, block_model, head
from asps_jax.kv_cache import KVCache
from asps_jax.models import LlamaConfig, llama

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Same static shapes as test_decode.py: n = 2, M = 6, batch bucket 8, vocabulary 12.
CASES = {"asps": 1, "specinfer": 2}  # method -> number of drafts K
MESHES = ("data=2,model=4", "data=8,model=1")
PROMPTS = [[1, 5, 3], [4, 7, 9, 1, 0, 11, 6], [2]]
# The CLI streams through Session (prefill + compiled steps): K = 2 covers the B * K draft cache;
# a stop string puts the stop tables (replicated) and each row's tail (split by rows) in the state.
CLI_ARGS = ["--method", "specinfer", "--num-drafts", "2", "--num-draft-tokens", "2"]
CLI_ARGS += ["--max-new-tokens", "8", "--batch-size", "2", "--seed", "3", "--prompt", "ROMEO:"]
CLI_ARGS += ["--stop", "e", "--json"]


# Every other drafter, and continuous batching, on one mesh: the one-device law holds for each.
DRAFTER_MESH = "data=2,model=4"
DRAFTERS = ("self:1", "quant:int8", "eagle3", "block", "slots")
HEAD_VOCAB = [0, 1, 2, 4, 5, 7, 9, 11]  # the head's draft vocabulary (8: split by model=4)


def drafter_kwargs(name: str) -> dict:
    """Row 0 greedy (T = 0), rows 1 and 2 sampled (T = 1, one of them with top-p): one call,
    one compiled program per drafter; ``slots``: the draft model through 2 slots."""
    kwargs = dict(sample_kwargs("asps"), temperature=[0.0, 1.0, 1.0])
    return dict(kwargs, batch_size=2) if name == "slots" else kwargs


def drafter_arg(name: str, root, draft):
    """``draft=`` of a :data:`DRAFTERS` case (the head saved by the fixture under ``root``)."""
    if name == "eagle3":
        return head.PREFIX + str(root / "head")
    if name == "block":
        return block.PREFIX + str(root / "block")
    return draft if name == "slots" else name


def write_head(root, target) -> None:
    """A random EAGLE-3 head on ``target``'s features, saved where :func:`drafter_arg` reads it."""
    config = head.HeadConfig.for_target(target.config, len(HEAD_VOCAB))
    params = head.init_params(config, jax.random.key(5), target.params["embed"], HEAD_VOCAB, 0.5)
    head.save_head(root / "head", config, params)


def write_block(root, target) -> None:
    """A random block drafter (blocks of 3: the 2 draft tokens and its anchor; the recurrent
    readout) on ``target``'s features, on the head's draft vocabulary, saved where
    :func:`drafter_arg` reads it."""
    config = block_model.BlockConfig.for_target(
        target.config, draft_vocab_size=len(HEAD_VOCAB), block_size=3, readout="recurrent"
    )
    embed = target.params["embed"]
    params = block_model.init_params(config, jax.random.key(6), embed, HEAD_VOCAB, 0.5)
    block_model.save(root / "block", config, params)


def drafter_runs(root, target, draft) -> dict:
    """Each :data:`DRAFTERS` case's tokens on one device."""
    return {
        name: np.asarray(
            asps_jax.sample(
                target, drafter_arg(name, root, draft), PROMPTS, **drafter_kwargs(name)
            ).tokens
        ).tolist()
        for name in DRAFTERS
    }


# The per-chip memory plan against the compiler's per-chip peak of whole sampling programs:
# (mesh, method, batch). On model=8 the 4 KV heads are not split: each chip holds its rows' whole
# cache, which an even split of the one-device total (the plan before) undercounts.
MEMORY_CASES = (("data=2,model=4", "asps", 16), ("data=1,model=8", "ar", 16))


def memory_models():
    """A target and a draft large enough that their buffers outweigh a program's fixed costs
    (random float32 weights: 2.4 MB and 0.8 MB)."""

    def model(name, seed, *sizes):
        config = LlamaConfig(*sizes, max_position_embeddings=128)
        return asps_jax.Model(name, "", config, llama.init_params(config, jax.random.key(seed)))

    return model("big", 0, 1024, 256, 512, 2, 8, 4), model("small", 1, 1024, 128, 256, 1, 4, 4)


def sample_kwargs(method: str) -> dict:
    """Temperature 1 (and a per-row top-p): the test exercises sampling, not only argmax. With
    diagnostics, as every call of test_decode.py: the one-device reference is then the very
    program of its greedy test on these prompts (temperature and top-p are per-row arrays), one
    compile for both files (and test_multihost.py) in a full run."""
    return dict(
        key=jax.random.key(11),
        max_new_tokens=6,
        method=method,
        num_draft_tokens=2,
        num_drafts=CASES[method],
        temperature=1.0,
        top_p=[1.0, 0.95, 1.0],
        eos_token_id=-1,
        diagnostics=True,
    )


def _write_llama(path, seed, noise_from=None):
    # num_key_value_heads 2 is not divisible by model=4: replicated. With noise_from, a draft
    # correlated with the target: some drafts get accepted.
    return write_tiny_llama(path, seed=seed, initializer_range=0.4, noise_from=noise_from)


def single_device_runs(root, cli_args) -> dict:
    """The reference every multi-device run is compared with: each case's tokens and lengths on
    one device, and the CLI's JSON output for ``cli_args``."""
    target = asps_jax.load_model(str(root / "target"))
    draft = asps_jax.load_model(str(root / "draft"))
    local = {}
    for method in CASES:
        out = asps_jax.sample(target, draft, PROMPTS, **sample_kwargs(method))
        local[method] = np.asarray(out.tokens).tolist()
        local[f"{method}/lengths"] = np.asarray(out.lengths).tolist()
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert cli.main(cli_args) == 0
    local["cli"] = json.loads(stdout.getvalue())
    return local


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(single-device tokens and CLI output, the 8-device worker's report)."""
    root = tmp_path_factory.mktemp("ckpt")
    _write_llama(root / "draft", 1, noise_from=_write_llama(root / "target", 0))
    target = asps_jax.load_model(str(root / "target"))
    write_head(root, target)
    write_block(root, target)
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    env["XLA_FLAGS"] = xla_flags("--xla_force_host_platform_device_count=8")
    worker = subprocess.Popen(
        [sys.executable, str(HERE / "sharding_worker.py"), str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        local = single_device_runs(root, CLI_ARGS)
        local["drafters"] = drafter_runs(root, target, asps_jax.load_model(str(root / "draft")))
        out, err = worker.communicate(timeout=600)
    finally:
        worker.kill()
    assert worker.returncode == 0, err[-3000:]
    line = [ln for ln in out.splitlines() if ln.startswith("REPORT ")][-1]
    return local, json.loads(line[len("REPORT ") :])


# --- equality on a mesh -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mesh_spec", MESHES)
@pytest.mark.parametrize("method", list(CASES))
def test_same_tokens_on_one_device_and_on_a_mesh(runs, method, mesh_spec):
    local, report = runs
    assert report["devices"] == 8
    assert report[f"{mesh_spec}/{method}"] == local[method]
    # Sampled, not degenerate: rows differ and use several token ids.
    assert len({tuple(r) for r in local[method]}) == len(PROMPTS)
    assert len({t for r in local[method] for t in r}) >= 4


@pytest.mark.slow
def test_single_prompt_padded_to_the_data_axis_and_explicit_meshes(runs):
    local, report = runs
    assert report["alone/asps"] == local["asps"][:1]
    assert report["explicit/asps"] == local["asps"]


@pytest.mark.slow
def test_parameters_are_split_along_model(runs):
    _, report = runs
    assert report["specs"] == {
        "wq": [None, None, "model", None],
        "wk": [None, None, None, None],  # 2 KV heads on model=4: replicated
        "wo": [None, "model", None, None],
        "w_up": [None, None, "model"],
        "w_down": [None, "model", None],
        "lm_head": [None, "model"],
    }


@pytest.mark.slow
def test_cli_mesh_flag_gives_the_same_tokens(runs):
    local, report = runs
    assert report["cli_code"] == 0
    assert report["cli"]["tokens"] == local["cli"]["tokens"]
    assert report["cli"]["texts"] == local["cli"]["texts"]
    lengths = [len(r) for r in local["cli"]["tokens"]]
    stopped = ["e" in t for t in local["cli"]["texts"]]
    assert all(hit or n == 8 for hit, n in zip(stopped, lengths)) and any(stopped), lengths


@pytest.mark.slow
@pytest.mark.parametrize("name", DRAFTERS)
def test_every_drafter_and_slots_give_the_one_device_tokens_on_a_mesh(runs, name):
    """self:L, quant:int8, a learned head, a block drafter and continuous batching (streamed step
    by step through a Session on the mesh, sampled in one call on one device) on data=2,model=4:
    the greedy row's tokens and the sampled rows' draws for the same keys are the one device's."""
    local, report = runs
    ours = local["drafters"][name]
    assert report[f"drafters/{name}"] == ours
    if name == "slots":
        assert report["drafters/slots/pairs"] >= len(PROMPTS)
    assert len({tuple(r) for r in ours}) == len(PROMPTS) and len({t for r in ours for t in r}) >= 4


@pytest.mark.slow
def test_drafters_parameters_are_split_along_model(runs):
    """On data=2,model=4 the drafters' weights are split like the target's: the self-draft's
    are the target's placed ones (its first layer), a quantized matrix's integer values and
    per-channel scales by the same axes (a scale's input axis of size 1 whole), the head's
    projections by heads / MLP width and its head and embedding by the vocabulary, the block
    drafter's stacked layers the same way (the layer axis whole)."""
    _, report = runs
    assert report["drafter_specs"] == {
        "self/wq": [None, None, "model", None],
        "self/w_down": [None, "model", None],
        "quant/w_up": [None, None, "model"],
        "quant/w_up.scale": [None, None, "model"],
        "quant/w_down": [None, "model", None],
        "quant/w_down.scale": [None, None, None],
        "head/wq": ["model", None],
        "head/w_down": [None, "model"],
        "head/lm_head": ["model", None],
        "head/embed": ["model", None],
        "head/fc": [None, None],
        "block/wq": [None, "model", None],
        "block/w_down": [None, None, "model"],
        "block/lm_head": ["model", None],
    }


@pytest.mark.slow
def test_per_chip_weights_are_what_each_chip_holds(runs):
    """sharding.chip_bytes (the plan's weights per chip) is what device 0 holds once the target
    and a quantized copy are placed on data=2,model=4: split arrays' shares, replicated ones
    (2 KV heads on model=4, norms, a scale's size-1 axis) whole."""
    _, report = runs
    for name in ("target", "quant"):
        held, planned = report[f"chip_bytes/{name}"]
        assert held == planned, name


@pytest.mark.slow
@pytest.mark.parametrize("case", MEMORY_CASES, ids=lambda c: f"{c[0]}/{c[1]}")
def test_per_chip_plan_bounds_the_compiled_per_chip_peak(runs, case):
    """The plan's per-chip estimate (weights per chip plus one chip's share of the buffers) is an
    upper bound of XLA's per-chip peak of the compiled sampling program (``memory_analysis``),
    within a factor 5; on model=8, whose 4 KV heads stay whole on every chip, the even split
    of the one-device estimate that the plan used before falls below the compiled peak."""
    _, report = runs
    peak, estimate, even = report[f"memory/{case[0]}/{case[1]}"]
    assert peak <= estimate <= 5 * peak, (peak, estimate)
    if case[0] == "data=1,model=8":
        assert even < peak, (even, peak)


def test_per_chip_memory_check_names_the_mesh(monkeypatch):
    """An 8B Llama shape (abstract weights, bf16) on model=4 chips of 16 GiB: a call that fits the
    four chips' sum, evenly split, is refused per chip in one line that names --mesh."""
    config = LlamaConfig(128256, 4096, 14336, 32, 32, 8, max_position_embeddings=8192)
    shapes = jax.eval_shape(lambda: llama.init_params(config, jax.random.key(0), jnp.bfloat16))
    model = asps_jax.Model("llama-8b-shape", "", config, shapes)
    mesh = AbstractMesh((1, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    monkeypatch.setattr(asps_jax.plan, "_device_memory_bytes", lambda mesh: 16 << 30)
    shape = dict(prompt_len=512, max_new_tokens=512, num_draft_tokens=1, num_drafts=1)
    weights = asps_jax.plan.weights(mesh, model)
    norms = 2 * (2 * 32 * 4096 + 4096)  # bf16 norm scales: whole on every chip
    assert weights == (footprint.weight_bytes(model) - norms) // 4 + norms  # 3.7 of 15 GiB
    parts = asps_jax.plan.check_memory(model, None, batch=32, method="ar", mesh=mesh, **shape)
    assert sum(parts.values()) + weights < 16 << 30
    one_device = footprint.estimate(config, None, method="ar", batch=64, target_itemsize=2, **shape)
    even = (sum(one_device.values()) + footprint.weight_bytes(model)) / 4
    assert even < 16 << 30  # the even split of the one-device total would let it through
    with pytest.raises(ValueError, match="per chip on mesh data=1,model=4") as err:
        asps_jax.plan.check_memory(model, None, batch=64, method="ar", mesh=mesh, **shape)
    message = str(err.value)
    assert (
        "\n" not in message and "(mesh, --mesh)" in message and "one chip has 16.0 GiB" in message
    )


# --- rules ------------------------------------------------------------------------------------

MESH_2x4 = {"data": 2, "model": 4}


@pytest.mark.parametrize(
    "axes, shape, expected",
    [
        (("layers", "embed", "heads", "head_dim"), (2, 16, 8, 4), P(None, None, "model", None)),
        (("layers", "embed", "kv_heads", "head_dim"), (2, 16, 2, 4), P(None, None, None, None)),
        (("layers", "embed", "mlp"), (2, 16, 32), P(None, None, "model")),
        (("vocab", "embed"), (12, 16), P("model", None)),
        (("vocab", "embed"), (10, 16), P(None, None)),  # 10 % 4 != 0: replicated
        (("batch", "cache_seq", "kv_heads"), (8, 64, 4), P("data", None, "model")),
        (("batch",), (3,), P(None)),
    ],
)
def test_default_rules(axes, shape, expected):
    assert sharding.ShardingRules().partition_spec(axes, shape, MESH_2x4) == expected


def test_rules_use_a_mesh_axis_once_and_skip_size_one_axes():
    rules = sharding.ShardingRules(embed="model")
    assert rules.partition_spec(("embed", "heads"), (16, 4), MESH_2x4) == P("model", None)
    assert rules.partition_spec(("batch", "mlp"), (8, 32), {"data": 1, "model": 1}) == P(None, None)
    with pytest.raises(ValueError, match="logical axis 'experts'"):
        rules.partition_spec(("experts",), (4,), MESH_2x4)
    with pytest.raises(ValueError, match="do not match"):
        rules.partition_spec(("batch",), (4, 2), MESH_2x4)


def test_state_layout_splits_rows_and_kv_heads():
    mesh = AbstractMesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    def sds(*shape):
        return jax.ShapeDtypeStruct(shape, np.float32)

    state = {
        "target_cache": KVCache(k=sds(2, 8, 2, 64, 4), v=sds(2, 8, 2, 64, 4), lengths=sds(8)),
        "draft_cache": KVCache(k=sds(2, 16, 4, 64, 4), v=sds(2, 16, 4, 64, 4), lengths=sds(16)),
        "tokens": sds(8, 9),
        "odd_rows": sds(3),
        "stop": StopStrings(sds(12, 8), sds(12), sds(4, 8), sds(4), sds(8, 7)),
    }
    shapes = sharding.sharded_shapes(state, mesh)
    specs = jax.tree.map(lambda s: s.sharding.spec, shapes)
    assert specs["target_cache"].k == P(None, "data", None, None, None)  # 2 KV heads: whole
    assert specs["draft_cache"].v == P(None, "data", "model", None, None)
    assert specs["draft_cache"].lengths == P("data") and specs["tokens"] == P("data", None)
    assert specs["odd_rows"] == P(None)
    # The stop strings' tables whole on every device (12 token rows would split), tails by rows.
    assert specs["stop"].token_bytes == P() and specs["stop"].strings == P()
    assert specs["stop"].tail == P("data", None)
    assert shapes["tokens"].shape == (8, 9)


def _decode_inputs(rows: int):
    """A call's inputs without parameters (placed by param_axes, tested above): every other
    field filled, stop strings included."""
    table = (np.zeros((12, 8), np.uint8), np.ones(12, np.int32))
    return sampler.DecodeInputs(
        target_params=None,
        draft_params=None,
        sampling=SamplingParams.make(rows, top_p=0.9, eos_ids=(3,)),
        prompts_BP=jnp.zeros((rows, 4), jnp.int32),
        prompt_lengths_B=jnp.ones(rows, jnp.int32),
        row_keys_B=jax.random.split(jax.random.key(0), rows),
        stop=stopping.stop_strings(table, (b"ab",), rows),
    )


def test_every_input_field_is_placed_as_it_declares():
    """Every array field of the loop's inputs (DecodeInputs, SamplingParams, StopStrings) declares
    a layout, and gets it: per-row fields split along data, the others whole. Derived from the
    dataclass fields, so a new field without a layout fails here (and in shard_inputs)."""
    for cls in (sampler.DecodeInputs, SamplingParams, StopStrings):
        for field in dataclasses.fields(cls):
            if not field.metadata.get("static"):
                assert sharding.layout(cls, field.name) in sharding.LAYOUTS, field.name
    mesh = AbstractMesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    inputs = _decode_inputs(8)
    specs = sharding.field_shardings(inputs, mesh)
    row_fields = set(SamplingParams.row_fields())
    assert row_fields and set(SamplingParams.array_fields()) - row_fields == {
        "eos_ids", "dfa_classes", "dfa_next", "dfa_final"
    }  # fmt: skip
    for name in SamplingParams.array_fields():
        spec, value = getattr(specs.sampling, name).spec, getattr(inputs.sampling, name)
        expected = ("data",) + (None,) * (value.ndim - 1) if name in row_fields else ()
        assert spec == P(*expected), name
    for name in ("prompts_BP", "prompt_lengths_B", "row_keys_B"):
        assert getattr(specs, name).spec[0] == "data", name
    assert specs.stop.tail.spec == P("data", None) and specs.stop.token_bytes.spec == P()
    # Every array leaf of the inputs has a sharding (nothing skipped).
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, NamedSharding))
    assert len(leaves) == len(jax.tree.leaves(inputs))
    assert all(isinstance(s, NamedSharding) for s in leaves)


def test_shard_inputs_places_every_array_on_the_mesh():
    """On a real (1-device) mesh every array of the placed inputs lives there, values unchanged;
    a field that declares no layout is refused with its name."""
    mesh = sharding.make_mesh("data=1,model=1")
    inputs = _decode_inputs(2)
    placed = sharding.shard_inputs(inputs, mesh, {})
    for before, after in zip(jax.tree.leaves(inputs), jax.tree.leaves(placed), strict=True):
        assert isinstance(after.sharding, NamedSharding) and after.sharding.mesh == mesh
        if not jax.dtypes.issubdtype(after.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(np.asarray(before), np.asarray(after))

    @dataclasses.dataclass(frozen=True)
    class Unplaced:
        rows: jax.Array = dataclasses.field(metadata=dict(sharding="rows"))
        extra: jax.Array = None

    with pytest.raises(TypeError, match=r"Unplaced\.extra declares no layout"):
        sharding.shard_inputs(Unplaced(jnp.zeros(2), jnp.zeros(2)), mesh, {})


def test_batch_padding():
    prompts, lengths = sharding.pad_batch(np.ones((3, 4), np.int32), np.array([4, 1, 2]), 4)
    assert prompts.shape == (4, 4) and prompts[3].tolist() == [0] * 4
    assert lengths.tolist() == [4, 1, 2, 0]
    same, _ = sharding.pad_batch(np.ones((8, 4), np.int32), np.ones(8, np.int32), 2)
    assert same.shape == (8, 4)
    # To the mesh's data axis (data=2 here), or unchanged without a mesh.
    mesh = AbstractMesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    odd = np.ones((3, 4), np.int32), np.array([4, 1, 2])
    prompts, lengths = sharding.pad_to_mesh(*odd, mesh)
    assert prompts.shape == (4, 4) and lengths.tolist() == [4, 1, 2, 0]
    assert sharding.pad_to_mesh(*odd, None)[0] is odd[0]


# --- mesh specs and bad input -----------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("data=2,model=4", {"data": 2, "model": 4}),
        (" model = 4 ", {"data": 1, "model": 4}),
        ("data=8", {"data": 8, "model": 1}),
        ({"model": 2}, {"data": 1, "model": 2}),
    ],
)
def test_parse_mesh_spec(spec, expected):
    assert sharding.parse_mesh_spec(spec) == expected


@pytest.mark.parametrize(
    "spec, match",
    [
        ("", "form data=D,model=M"),
        ("data", "form data=D,model=M"),
        ("data=2;model=4", "positive integer"),
        ("data=0", "positive integer"),
        ("data=-2", "positive integer"),
        ("data=2.5", "positive integer"),
        ("data=x", "positive integer"),
        ("pipe=2", "unknown axis 'pipe'"),
        ("data=2,data=2", "given twice"),
        ({"data": True}, "positive integer"),
        (8, "expected a string"),
    ],
)
def test_bad_mesh_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        sharding.make_mesh(spec)


def test_mesh_larger_than_the_devices_says_how_many_exist():
    with pytest.raises(ValueError, match=r"needs 8 devices but only 1 is available"):
        sharding.make_mesh("data=2,model=4")
    mesh = sharding.make_mesh("data=1,model=1")
    assert mesh.axis_names == ("data", "model") and mesh.axis_types == (AxisType.Auto,) * 2


def test_sample_refuses_a_bad_mesh():
    config = LlamaConfig(12, 16, 32, 1, 2, 2, max_position_embeddings=32)
    params = llama.init_params(config, jax.random.key(0))
    model = asps_jax.Model("tiny", "", config, params)
    kw = dict(key=jax.random.key(0), max_new_tokens=2, method="ar")
    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh"):
        asps_jax.sample(model, None, [[1]], mesh="data=1", **kw)
    wrong = Mesh(np.asarray(jax.devices()[:1]), ("x",))
    with pytest.raises(ValueError, match="axes must be named"):
        asps_jax.sample(model, None, [[1]], mesh=wrong, **kw)


@pytest.mark.parametrize(
    "mesh, needle", [("data=2,model=4", "only 1 is available"), ("data=two", "positive integer")]
)
def test_cli_bad_mesh_exits_with_one_line(capsys, mesh, needle):
    assert cli.main(["--mesh", mesh, "--max-new-tokens", "4"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err
