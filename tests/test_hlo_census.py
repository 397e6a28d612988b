"""asps_jax/hlo_census.py on a hand-written optimized-HLO module (the figures by hand, below), and
asps_jax/platforms.py: the platform a call runs on, and the CLI's choice of JAX backends."""

# ruff: noqa: E501  (HLO lines are as long as XLA prints them)

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from asps_jax import hlo_census, kv_cache, platforms

# A loop of 4 trips (its count only in the condition: i < 4 from i = 0) whose body prefetches a
# 64x128 bf16 slice of a 4x64x128 weight (slice-start: 16 KiB read from HBM into VMEM, S(1)),
# multiplies it in a fusion that reads the VMEM slice (free) and an f32[8,64] activation in HBM
# (2 KiB) and writes f32[8,128] (4 KiB), and all-reduces the result (4 KiB read + 4 KiB written).
# After it: a fusion that only dynamic-slices row 0 of the weight (16 KiB read, 16 KiB written),
# an in-place update of 128 s32 into an s32[1024,128] buffer (512 B read + 512 B written), an
# async all-gather (f32[8,128] in, f32[16,128] out), an s64 constant and an outfeed.
HLO = """HloModule jit_f, is_scheduled=true

%fused_mul (param_0.1: bf16[64,128], param_1.1: f32[8,64]) -> f32[8,128] {
  %param_0.1 = bf16[64,128]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %param_1.1 = f32[8,64]{1,0} parameter(1)
  %convert.1 = f32[64,128]{1,0} convert(%param_0.1)
  ROOT %dot.1 = f32[8,128]{1,0} dot(%param_1.1, %convert.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.9 = f32[] add(%a, %b)
}

%body (p: (s32[], bf16[4,64,128], f32[8,64], f32[8,128])) -> (s32[], bf16[4,64,128], f32[8,64], f32[8,128]) {
  %p = (s32[], bf16[4,64,128]{2,1,0}, f32[8,64]{1,0}, f32[8,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = bf16[4,64,128]{2,1,0} get-tuple-element(%p), index=1
  %x = f32[8,64]{1,0} get-tuple-element(%p), index=2
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %slice-start.1 = ((bf16[4,64,128]{2,1,0}), bf16[64,128]{1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) slice-start(%w), slice={[0:1], [0:64], [0:128]}
  %slice-done.1 = bf16[64,128]{1,0:T(8,128)(2,1)S(1)} slice-done(%slice-start.1)
  %fusion.1 = f32[8,128]{1,0} fusion(%slice-done.1, %x), kind=kOutput, calls=%fused_mul
  %all-reduce.1 = f32[8,128]{1,0} all-reduce(%fusion.1), channel_id=1, replica_groups={{0,1}}, to_apply=%sum, metadata={op_name="jit(f)/while/body/psum"}
  ROOT %t = (s32[], bf16[4,64,128]{2,1,0}, f32[8,64]{1,0}, f32[8,128]{1,0}) tuple(%next, %w, %x, %all-reduce.1)
}

%cond (q: (s32[], bf16[4,64,128], f32[8,64], f32[8,128])) -> pred[] {
  %q = (s32[], bf16[4,64,128]{2,1,0}, f32[8,64]{1,0}, f32[8,128]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %four = s32[] constant(4)
  ROOT %lt = pred[] compare(%j, %four), direction=LT
}

%fused_row (param_0.2: bf16[4,64,128], param_1.2: s32[]) -> bf16[64,128] {
  %param_0.2 = bf16[4,64,128]{2,1,0} parameter(0)
  %param_1.2 = s32[] parameter(1)
  %zero.2 = s32[] constant(0)
  %ds = bf16[1,64,128]{2,1,0} dynamic-slice(%param_0.2, %param_1.2, %zero.2, %zero.2), dynamic_slice_sizes={1,64,128}
  ROOT %bc = bf16[64,128]{1,0} bitcast(%ds)
}

%fused_update (param_0.3: s32[1024,128], param_1.3: s32[1,128], param_2.3: s32[]) -> s32[1024,128] {
  %param_0.3 = s32[1024,128]{1,0} parameter(0)
  %param_1.3 = s32[1,128]{1,0} parameter(1)
  %param_2.3 = s32[] parameter(2)
  %zero.3 = s32[] constant(0)
  ROOT %dus = s32[1024,128]{1,0} dynamic-update-slice(%param_0.3, %param_1.3, %param_2.3, %zero.3)
}

ENTRY %main (w0: bf16[4,64,128], x0: f32[8,64], buf: s32[1024,128], upd: s32[1,128]) -> (f32[8,128], bf16[64,128], s32[1024,128], f32[16,128]) {
  %w0 = bf16[4,64,128]{2,1,0} parameter(0)
  %x0 = f32[8,64]{1,0} parameter(1)
  %buf = s32[1024,128]{1,0} parameter(2)
  %upd = s32[1,128]{1,0} parameter(3)
  %zero = s32[] constant(0)
  %copy.0 = s32[] copy(%zero)
  %init = f32[8,128]{1,0} broadcast(f32[] constant(0)), dimensions={}
  %tuple.0 = (s32[], bf16[4,64,128]{2,1,0}, f32[8,64]{1,0}, f32[8,128]{1,0}) tuple(%copy.0, %w0, %x0, %init)
  %loop = (s32[], bf16[4,64,128]{2,1,0}, f32[8,64]{1,0}, f32[8,128]{1,0}) while(%tuple.0), condition=%cond, body=%body, metadata={op_name="jit(f)/while"}
  %out = f32[8,128]{1,0} get-tuple-element(%loop), index=3
  %row = bf16[64,128]{1,0} fusion(%w0, %zero), kind=kLoop, calls=%fused_row
  %upd.1 = s32[1024,128]{1,0} fusion(%buf, %upd, %zero), kind=kLoop, calls=%fused_update
  %ag-start = (f32[8,128]{1,0}, f32[16,128]{1,0}) all-gather-start(%out), channel_id=2, replica_groups={{0,1}}, dimensions={0}
  %ag-done = f32[16,128]{1,0} all-gather-done(%ag-start)
  %wide = s64[] constant(7)
  %feed = token[] outfeed(%wide, token[] after-all()), outfeed_shape=s64[]
  ROOT %res = (f32[8,128]{1,0}, bf16[64,128]{1,0}, s32[1024,128]{1,0}, f32[16,128]{1,0}) tuple(%out, %row, %upd.1, %ag-done)
}
"""

KIB = 1024


def test_census_of_a_hand_written_module():
    c = hlo_census.census(HLO)
    per_trip = 16 * KIB + (2 + 4) * KIB + (4 + 4) * KIB  # slice-start, fusion, all-reduce
    init = 4 * KIB  # the broadcast writes f32[8,128]
    after = 2 * 16 * KIB + 2 * 512 + (4 + 8) * KIB  # the row, the update, the all-gather
    outfeed = 8  # reads the s64
    scalars = 8 + 4 * 12 + 2 * 4  # the counter's copy and adds, the index read by two fusions
    assert c.traffic_bytes == 4 * per_trip + init + after + outfeed + scalars
    assert c.collectives == {("all-reduce", "f32[8,128]"): 4, ("all-gather", "f32[16,128]"): 1}
    assert c.collectives_of("all-reduce") == 4 and c.collective_bytes["all-gather"] == 8 * KIB
    assert c.loops == {(4, "jit(f)/while"): 1} and c.unknown_trips == 0
    assert hlo_census.source_loops(c) == {(4, "jit(f)/while"): 1}
    assert hlo_census.source_loops(c, "commit") == {}
    assert c.wide_types == ["s64"] and c.host_transfers == ["outfeed feed"]
    assert c.fusions == 3


def test_census_refuses_text_without_an_entry():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        hlo_census.census("not an HLO module")


def test_the_platform_is_the_devices_not_the_host(monkeypatch):
    """``platforms.of``: the mesh's devices, else the arrays' (placed, abstract, or traced with a
    NamedSharding), else the default backend; ``row_loop_for`` follows it."""
    cpu = jax.devices("cpu")[0]
    mesh = jax.sharding.Mesh([cpu], ("model",))
    placed = jax.device_put(1.0, NamedSharding(mesh, P()))
    assert platforms.of(mesh) == platforms.of(None, placed) == platforms.of() == "cpu"
    seen = []
    jax.jit(lambda x: seen.append(platforms.of(None, x)) or x).lower(placed)
    assert seen == ["cpu"] and kv_cache.row_loop_for(None, placed) is None
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")  # a host whose default is a TPU
    assert platforms.of(None, placed) == "cpu" and kv_cache.row_loop_for(None, placed) is None
    assert kv_cache.row_loop_for(None) is False and kv_cache.row_loop_for(mesh, placed) is False


def test_the_cli_starts_the_cpu_alone_where_there_is_no_accelerator(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "")
    assert platforms.default_platforms() is None  # the user's choice, even an empty one
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(platforms, "_tpu_chips", lambda: 0)
    monkeypatch.setattr(platforms.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(platforms.os.path, "exists", lambda path: False)
    assert platforms.default_platforms() == "cpu"
    monkeypatch.setattr(platforms, "_tpu_chips", lambda: 4)
    assert platforms.default_platforms() is None


@pytest.fixture
def bench_tpu(monkeypatch):
    """``benchmarks/bench_tpu.py`` as a module, its environment and path undone after the test."""
    for name in ("TPU_WORKER_HOSTNAMES", "ALLOW_MULTIPLE_LIBTPU_LOAD", "ASPS_JAX_NO_CACHE"):
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    monkeypatch.delitem(sys.modules, "bench_tpu", raising=False)
    return importlib.import_module("bench_tpu")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--programs", "step,loop"], "--programs: unknown program 'loop'"),
        (["--target", "no-such-model"], "--target/--draft 'no-such-model': no model card"),
        (["--quantize", "int8"], "--prompts, --quantize and --draft-quantize are not compiled"),
    ],
)
def test_bench_tpu_refuses_bad_input_in_one_line(bench_tpu, capsys, argv, message):
    try:
        status = bench_tpu.main(argv)
    except SystemExit as stop:
        status = stop.code
    err = capsys.readouterr().err
    assert status == 2 and message in err and err.count("\n") == 1, err
