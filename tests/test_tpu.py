"""The TPU compiler as a second judge (issue 62): the library's decode steps compiled for a TPU v5e
from this CPU process with libtpu (``benchmarks/bench_tpu.py``'s machinery: abstract weights placed
on the chips of ``v5e:2x2``), and held there: every method, drafter and feature family compiles;
no 64-bit type, no host transfer, no per-row loop in the commit; on a small Llama shape split over
``model=2`` the step's collectives and modelled traffic (``asps_jax.hlo_census``) stay within
bounds. Skipped where libtpu is absent (``pip install -e ".[tpu]"``); CI installs it."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import jax
import pytest

pytest.importorskip("libtpu", reason="libtpu absent (pip install -e '.[tpu]'): no TPU compile")

import asps_jax  # noqa: E402
from asps_jax import hlo_census, sharding  # noqa: E402
from asps_jax.models import LlamaConfig, base  # noqa: E402

SCRIPTS = Path(__file__).resolve().parents[1] / "benchmarks"
# libtpu finds no TPU metadata server without the first; several test processes share its lock.
ENV = {"TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
FAST = {"exec_time_optimization_effort": -1.0}  # the compile proves the program; speed it up


@pytest.fixture(scope="module")
def bench():
    """``benchmarks/bench_tpu.py`` as a module and the chips of a v5e 2x2 (the environment, the path
    and the module itself restored after this file's tests)."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {**ENV, "ASPS_JAX_NO_CACHE": "1"}.items():
            mp.setenv(name, value)
        mp.syspath_prepend(str(SCRIPTS))
        mp.delitem(sys.modules, "bench_tpu", raising=False)
        import bench_tpu

        cache = jax.config.jax_enable_compilation_cache  # no TPU executable in the run's cache
        jax.config.update("jax_enable_compilation_cache", False)
        try:
            yield bench_tpu, bench_tpu.topology_devices("v5e:2x2")
        finally:
            jax.config.update("jax_enable_compilation_cache", cache)
            mp.delitem(sys.modules, "bench_tpu", raising=False)


def _census(bench, target, draft, call, mesh=None, rows=2):
    module, devices = bench
    decoder, args = module.abstract_call(
        target, draft, call, devices, mesh, rows=rows, prompt_tokens=6, max_new_tokens=8
    )
    compiled, _ = module.compile_step(decoder, args, FAST)
    return hlo_census.census(compiled.as_text()), args


def _check_accelerator_program(c: hlo_census.Census, what: str) -> None:
    assert not c.wide_types, f"{what}: 64-bit types {c.wide_types}"
    assert not c.host_transfers, f"{what}: host transfers {c.host_transfers}"
    assert not hlo_census.source_loops(c, "commit"), f"{what}: a per-row loop in the commit"


# Every method, every drafter and every feature family at least once (a compile costs ~10 CPU-s:
# one call per method, the drafters and families spread over them).
FAMILIES = dict(
    top_k=3, top_p=0.9, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5,
    frequency_penalty=0.25, logit_bias={2: 1.0}, no_repeat_ngram_size=2, min_tokens=2,
    bad_words=[[1, 2], [3]], stop=["ab", "c"], regex="[a-e]+k",
)  # fmt: skip
CALLS = [
    ("ar", None, dict(method="ar", **FAMILIES)),
    (
        "sps",
        "model",
        dict(method="sps", num_draft_tokens=2, draft_stop="confidence:0.3", **FAMILIES),
    ),
    ("asps", "lookup", dict(method="asps", num_draft_tokens=2, batch_size=2)),
    ("specinfer", "self:2", dict(method="specinfer", num_drafts=2, num_draft_tokens=2)),
    ("spectr", "quant:int8", dict(method="spectr", num_drafts=2, num_draft_tokens=2)),
    ("is", "model", dict(method="is", num_drafts=2, num_draft_tokens=2, diagnostics=True)),
    ("tv", "eagle3:tinyshakespeare-eagle3", dict(method="tv", tree=(2, 1))),
    ("tv_wr", "model", dict(method="tv_wr", tree=(2, 1), top_logprobs=2, raw_logprobs=True)),
    ("is_bv", "model", dict(method="is_bv", tree=(2, 1))),
]


@pytest.mark.slow
def test_every_method_drafter_and_family_compiles_for_v5e(bench):
    # The bundled weights themselves (small): every drafter derives its draft from them, the
    # quantized copy and the EAGLE-3 head included; the step is lowered on their shapes.
    target = asps_jax.load_model("tinyshakespeare-target", dtype="bfloat16")
    model = asps_jax.load_model("tinyshakespeare-draft", dtype="bfloat16")
    start, failed = time.perf_counter(), []
    for method, draft, call in CALLS:
        what = f"{method} / {draft}"
        try:
            c, _ = _census(bench, target, model if draft == "model" else draft, call)
        except Exception as err:  # noqa: BLE001 - every failing call named at once
            failed.append(f"{what}: {' '.join(str(err).split())[:200]}")
            continue
        _check_accelerator_program(c, what)
    assert not failed, failed
    print(f"{len(CALLS)} TPU compiles in {time.perf_counter() - start:.0f} s")


# A small Llama shape whose heads, MLP and vocabulary split over 2 chips (vocabulary 1024: the
# draws' blocks split evenly), and a one-layer draft of the same vocabulary.
SMALL = dict(vocab_size=1024, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
TARGET = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, **SMALL)
DRAFT = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1, **SMALL)


def _abstract(bench, config, name):
    params = bench[0].abstract_params(config, "bf16")
    return base.Model(name=name, path=name, config=config, params=params)


@pytest.mark.slow
def test_a_small_llama_step_on_model_2_stays_within_its_bounds(bench):
    """On ``model=2``: a layer adds exactly two all-reduces to the AR step (the attention and MLP
    outputs; the attention's NaN guard adds none), the rest is a bounded few (the embedding, the
    logits' normalizer and checks, the draw); no all-gather of a vocabulary-sized array (the
    exact draws exchange block totals, not tables) in an ASpS step either; and a step moves a
    bounded multiple of the weights."""
    mesh = sharding.make_mesh("model=2", bench[1])
    draft = _abstract(bench, DRAFT, "small-draft")
    counts = []
    for layers in (2, 3):
        config = dataclasses.replace(TARGET, num_hidden_layers=layers)
        c, args = _census(bench, _abstract(bench, config, "small"), None, dict(method="ar"), mesh)
        _check_accelerator_program(c, f"ar, {layers} layers, on model=2")
        counts.append(c.collectives_of("all-reduce"))
    assert counts[1] - counts[0] == 2, counts
    # 11 others with libtpu 0.0.42.1 (13 before the logits' checks became one max; the 8B shape
    # of docs/benchmarks.md has 8): one of slack for another compiler's combining.
    assert counts[0] <= 2 * TARGET.num_hidden_layers + 12, dict(c.collectives)
    target = _abstract(bench, TARGET, "small")
    c, args = _census(bench, target, draft, dict(method="asps", num_draft_tokens=3), mesh)
    _check_accelerator_program(c, "asps on model=2")
    gathers = {s: n for (k, s), n in c.collectives.items() if k == "all-gather"}
    assert all(max(_dims(s)) < TARGET.vocab_size // 2 for s in gathers), gathers
    weights = bench[0].weight_bytes(args[0]) + bench[0].weight_bytes(args[1])
    assert c.traffic_bytes <= 8 * weights, (c.traffic_bytes, weights)  # 6.0x when written


def _dims(shape: str) -> list[int]:
    return [int(d) for d in shape[shape.index("[") + 1 : -1].split(",") if d]


def test_a_topology_libtpu_refuses_is_a_one_line_error(bench, capsys):
    assert bench[0].main(["--method", "ar", "--topology", "v5e:1x1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench_tpu.py: error: --topology v5e:1x1: ") and err.count("\n") == 1


@pytest.mark.slow
def test_the_ar_step_reads_the_cache_block_by_block_up_to_its_length(bench):
    """The accelerator's attention reads the KV cache in ``layers.CACHE_BLOCK``-slot blocks, a
    ``while`` loop of ``ceil(length / block)`` trips: each counted
    trip adds one block of keys and values of every layer (as the shapes give it) to the step's
    modelled traffic (a loop that read the whole cache per trip would add ``S / block`` times
    that)."""
    from asps_jax.models import layers

    module, devices = bench
    rows = 2
    decoder, args = module.abstract_call(
        _abstract(bench, TARGET, "small"), None, dict(method="ar"), devices, None, rows=rows,
        prompt_tokens=6, max_new_tokens=200,
    )  # fmt: skip
    text = module.compile_step(decoder, args, FAST)[0].as_text()
    c = hlo_census.census(text)
    _check_accelerator_program(c, "ar, one chip")
    assert hlo_census.source_loops(c, "cache_blocks"), dict(c.loops)
    slots = args[3].target_cache.k.shape[-2]
    assert slots % layers.CACHE_BLOCK == 0 and slots > 2 * layers.CACHE_BLOCK, slots
    one, all_ = (
        hlo_census.census(text, trips={"cache_blocks": n}).traffic_bytes
        for n in (1, slots // layers.CACHE_BLOCK)
    )
    batch = args[3].target_cache.k.shape[1]  # the rows' bucket
    per_block = 2 * TARGET.num_hidden_layers * batch * TARGET.num_key_value_heads
    per_block *= layers.CACHE_BLOCK * TARGET.head_dim * 2  # keys and values, bf16
    added = (all_ - one) / (slots // layers.CACHE_BLOCK - 1)
    assert per_block <= added <= 1.25 * per_block, (added, per_block)
