"""Compile the real decoding programs for a TPU topology from this CPU process (no TPU needed) and
cost them: the TPU compiler as a second judge of every program the library builds.

    pip install -e ".[tpu]"      # libtpu: compiles for TPU topologies without a TPU
    python benchmarks/bench_tpu.py --target llama7b --draft llama68m --method asps \\
        --num-draft-tokens 4 --batch-size 8 --topology v5e:2x2 --mesh model=4

It takes the call ``scripts/sample.py`` takes (method, drafter, n, K, tree, batch, sampling
controls; one parser), plus ``--topology`` (``v5e:2x2``, ``v6e:2x2``, ``v5p:2x2x1``, ...: the chips
lowered onto; one chip without ``--mesh``, ``v5e:1x1`` being refused by libtpu) and the model
shapes: ``--target`` / ``--draft`` name a card in ``models/`` (its architecture numbers, or its
bundled checkpoint's config) and the weights are abstract (``jax.ShapeDtypeStruct`` with their
shardings on the topology's chips), so a 70B shape needs no memory.

For the decode step of the call and for the AR step at the same batch, lowered with the decode
state that ``prefill`` makes (``Decoder.step``, the program a streaming loop runs), it prints:
whether it compiles (else the one-line reason); the modelled HBM bytes one step moves per chip
(``asps_jax.hlo_census``: a per-instruction traffic count over the optimized HLO; XLA's
``cost_analysis()`` is wrong for ``while`` bodies and async slices) against the target's weights
per chip (every parameter but the embedding table: the one-step roofline); the collectives per
step by kind and size; ``while`` loops by trip count; 64-bit types and host transfers (none
belong in an accelerator program); the per-chip peak memory of the compiled program
(``memory_analysis()``: arguments + outputs + temporaries - aliased) against the chip's HBM; the
optimized HLO's size (lines, fusions); and the compile's CPU-seconds.

Drafters: a draft model's card, ``lookup`` and ``quant:`` (its shapes from the abstract
weights) lower; ``self:L`` and ``eagle3:`` read the weights' values and do not (a one-line "does
not compile"; ``tests/test_tpu.py`` compiles them from the bundled weights). On a mesh only a draft
model is placed.

The figures are compiler estimates for a TPU nobody ran here: they compare programs (before and
after a change) and bound them in tests; step times need a TPU.
"""

from __future__ import annotations

import os

# Before JAX starts: the host process runs on the CPU (the TPU is a compile target only), libtpu
# finds no TPU metadata server without these, and several compiling processes share its lock.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("ASPS_JAX_NO_CACHE", "1")  # TPU executables stay out of the CPU cache

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from harness import machine  # noqa: E402
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from asps_jax import decode, hlo_census, sampler, sharding  # noqa: E402
from asps_jax.cli.args import DTYPES, build_parser, check, sampling_kwargs  # noqa: E402
from asps_jax.models import base, cards, layers, loader  # noqa: E402

GIB = 1 << 30
HBM_GIB = {"v4": 32, "v5e": 16, "v5litepod": 16, "v5p": 95, "v6e": 32}  # per chip
DRAFTERS = ("lookup", "self:", "quant:", "eagle3:")  # drafters that are not a checkpoint


def build_bench_parser() -> argparse.ArgumentParser:
    p = build_parser()
    p.prog = "bench_tpu.py"
    p.description = __doc__.split("\n\n")[0]
    g = p.add_argument_group("TPU compile")
    g.add_argument(
        "--topology",
        default="v5e:2x2",
        help="TPU topology to compile for, e.g. v5e:2x2, v6e:2x2, v5p:2x2x1 (default v5e:2x2); "
        "its first chip without --mesh",
    )
    g.add_argument(
        "--prompt-tokens",
        type=int,
        default=32,
        metavar="P",
        help="prompt length of every row (default 32); the cache holds P + --max-new-tokens",
    )
    g.add_argument(
        "--programs",
        default="step,ar",
        help="programs compiled: step (the call's decode step), ar (the AR step at the same "
        "batch); comma-separated (default step,ar)",
    )
    g.add_argument("--json-out", default=None, metavar="PATH", help="also write rows as JSON lines")
    g.add_argument(
        "--hlo-dir", default=None, metavar="DIR", help="write each optimized HLO text here"
    )
    p.set_defaults(dtype="bf16", max_new_tokens=200)
    return p


def abstract_model(name: str, dtype: str) -> base.Model:
    """A model of a card's shape whose parameters are ``ShapeDtypeStruct``\\ s (no weights read):
    the bundled checkpoint's config (and tokenizer) when the card has one, else its architecture
    numbers."""
    path = cards.MODELS_DIR / name
    tokenizer = None
    if (path / "config.json").is_file():
        family, config = loader.read_config(path, base.family_for_type)
        tokenizer = loader.load_tokenizer(path)
    else:
        card = cards.read_card(name)
        if card is None or "architecture" not in card:
            known = ", ".join(cards.known_aliases())
            raise ValueError(f"--target/--draft {name!r}: no model card of that name ({known})")
        arch = {"max_position_embeddings": 4096, **card["architecture"]}
        family = base.family_for_type(arch["model_type"])
        config = family.config_from_hf(arch)
    params = abstract_params(config, dtype)
    return base.Model(name=name, path=str(path), config=config, params=params, tokenizer=tokenizer)


def abstract_params(config, dtype: str = "bf16"):
    """A model's stored parameters (``param_shapes``) as ``ShapeDtypeStruct`` in ``dtype``."""
    dt = jax.numpy.dtype(DTYPES[dtype])

    def is_leaf(x):
        return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], tuple)

    shapes = base.family_for_config(config).param_shapes(config)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s[0], dt), shapes, is_leaf=is_leaf)


def _with(shapes, shardings):
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )


def _run_shardings(model, mesh, wide: bool):
    """The shardings of ``model``'s run-layout parameters on ``mesh``: those XLA gives the
    stored parameters' run-layout copy (``base.prepare_params``), as a placed call makes it."""
    stored = sharding.param_specs(model.config, mesh)
    stored = jax.tree.map(lambda s: NamedSharding(mesh, s), stored)
    fn = jax.jit(functools.partial(base.prepare_params, model.config, wide=wide))
    return fn.lower(_with(model.params, stored)).compile().output_shardings


def abstract_call(
    target, draft, kwargs, devices, mesh, *, rows, prompt_tokens, max_new_tokens, n=1
):
    """The static decoder and its step's abstract arguments (parameters, sampling, the state
    after ``prefill``) with their shardings on the topology's chips.

    The call is prepared on the host as on one device (``sampler.prepare`` with the abstract
    parameters: every check, the drafter, the run layout's shapes); on a mesh the decoder gets the
    topology's mesh and every input the layout a placed call gives it (parameters: the shardings
    XLA gives their run-layout copy; rows along ``data``; the state by ``state_shardings``)."""
    rng = np.random.default_rng(0)
    data = dict(mesh.shape).get("data", 1) if mesh is not None else 1
    if rows % data:
        raise ValueError(f"--batch-size {rows} does not split over data={data}")
    prompts = rng.integers(1, target.vocab_size, (rows, prompt_tokens)).tolist()
    target = placed_on(target, devices, mesh)
    if isinstance(draft, base.Model):
        draft = placed_on(draft, devices, mesh)
    call = sampler.prepare(
        target, draft, prompts, key=jax.random.key(0), max_new_tokens=max_new_tokens, n=n,
        **kwargs,
    )  # fmt: skip
    inputs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), call.inputs)
    decoder = call.decoder
    state = jax.eval_shape(
        functools.partial(decode.prefill, decoder),
        inputs.target_params, inputs.draft_params, inputs.prompts_BP, inputs.prompt_lengths_B,
        inputs.row_keys_B, inputs.stop, inputs.budget_B,
    )  # fmt: skip
    step_args = (inputs.target_params, inputs.draft_params, inputs.sampling, state)
    if mesh is None:  # one chip: every array whole on it
        one = NamedSharding(Mesh(np.asarray(devices[:1]), ("model",)), P())
        return decoder, _with(step_args, jax.tree.map(lambda _: one, step_args))
    decoder = dataclasses.replace(decoder, mesh=mesh)
    wide = sampler.wide_layouts(decoder.spec, inputs.prompts_BP.shape[0])
    placed = sharding.field_shardings(inputs, mesh)
    tp = _run_shardings(target, mesh, wide["target_params"])
    dps = None
    if inputs.draft_params is not None:
        if not isinstance(draft, base.Model):
            raise ValueError(f"--draft {draft}: this bench places only a draft model on a mesh")
        dps = _run_shardings(draft, mesh, wide["draft_params"])
    shardings = (tp, dps, placed.sampling, sharding.state_shardings(state, mesh))
    return decoder, _with(step_args, shardings)


def weight_bytes(params, shardings=None) -> float:
    """Bytes per chip of every parameter but the embedding table (read a row per token)."""
    total = 0.0
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in flat:
        if "embed" in jax.tree_util.keystr(path):
            continue
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding else leaf.shape
        total += np.prod(shape) * leaf.dtype.itemsize
    return float(total)


def compile_step(decoder, step_args, options=None):
    """``(compiled Decoder.step, compile CPU-seconds)`` for the devices ``step_args`` are on."""
    lowered = decode.spec_step.lower(decoder, *step_args)
    cpu = time.process_time()
    compiled = lowered.compile(options) if options else lowered.compile()
    return compiled, time.process_time() - cpu


def cache_blocks_read(prompt_tokens: int, max_new_tokens: int) -> int:
    """Cache blocks a step's length-aware attention reads (``layers.attention``'s
    ``cache_blocks`` loop, whose trip count is data-dependent), for the census: the mean over the
    cache lengths of a generation (prompt to prompt + new tokens) of ``ceil(length / block)``,
    rounded up."""
    lengths = np.arange(prompt_tokens, prompt_tokens + max(max_new_tokens, 1))
    return int(np.ceil(np.mean(-(-lengths // layers.CACHE_BLOCK))))


def compile_program(name, decoder, step_args, hbm_bytes, hlo_dir=None, blocks=1) -> dict:
    """Lower and compile ``Decoder.step`` for the topology; the row of figures."""
    row = {"program": name, "decoder": decoder.spec.name}
    wall = time.perf_counter()
    try:
        compiled, cpu_s = compile_step(decoder, step_args)
    except Exception as err:  # noqa: BLE001 - the figure is "does not compile", and why
        row.update(compiles=False, error=" ".join(str(err).split())[:300])
        return row
    row.update(compile_cpu_s=cpu_s, compile_wall_s=time.perf_counter() - wall)
    text = compiled.as_text()
    if hlo_dir:
        Path(hlo_dir).mkdir(parents=True, exist_ok=True)
        (Path(hlo_dir) / f"{name}.hlo").write_text(text)
    c = hlo_census.census(text, trips={"cache_blocks": blocks})
    mem = compiled.memory_analysis()
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
    peak -= mem.alias_size_in_bytes
    weights = weight_bytes(step_args[0])
    row.update(
        compiles=True,
        traffic_bytes=c.traffic_bytes,
        weight_bytes=weights,
        traffic_over_weights=c.traffic_bytes / weights,
        collectives={f"{k} {s}": n for (k, s), n in sorted(c.collectives.items())},
        collective_bytes=dict(c.collective_bytes),
        loops={f"{name} x{trips}": n for (trips, name), n in c.loops.items()},
        wide_types=c.wide_types,
        host_transfers=c.host_transfers,
        peak_bytes=peak,
        hbm_bytes=hbm_bytes,
        hlo_lines=c.lines,
        fusions=c.fusions,
    )
    return row


def print_row(row: dict) -> None:
    if not row["compiles"]:
        print(f"{row['program']:>5}: does not compile: {row['error']}")
        return
    coll = ", ".join(f"{n} x {k}" for k, n in row["collectives"].items()) or "none"
    print(
        f"{row['program']:>5}: compiles; {row['traffic_bytes'] / GIB:.3f} GiB/step = "
        f"{row['traffic_over_weights']:.3f} x weights ({row['weight_bytes'] / GIB:.3f} GiB/chip); "
        f"peak {row['peak_bytes'] / GIB:.2f} of {row['hbm_bytes'] / GIB:.0f} GiB HBM; "
        f"HLO {row['hlo_lines']} lines, {row['fusions']} fusions; compile "
        f"{row['compile_cpu_s']:.1f} CPU-s ({row['compile_wall_s']:.1f} s)\n"
        f"       collectives: {coll}\n"
        f"       while loops (op x trips: runs): {row['loops'] or 'none'}; 64-bit types: "
        f"{row['wide_types'] or 'none'}; host transfers: {row['host_transfers'] or 'none'}"
    )


def topology_devices(name: str):
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(topology_name=name, platform="tpu")
    except Exception as err:  # noqa: BLE001 - libtpu absent, or a name it refuses
        raise ValueError(f"--topology {name}: {' '.join(str(err).split())[:200]}") from None
    return list(topo.devices)


def placed_on(model: base.Model, devices, mesh) -> base.Model:
    """``model`` with its abstract parameters placed on the topology's chips (the first chip, or
    ``mesh`` by the sharding rules), so every choice made from the devices a call runs on (the
    layer layout, the commit) is the TPU's while the call is prepared on this CPU process.
    A model with real weights (a drafter that reads their values) is left as it is."""
    if not all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(model.params)):
        return model
    if mesh is None:
        where = jax.tree.map(lambda _: SingleDeviceSharding(devices[0]), model.params)
    else:
        specs = sharding.param_specs(model.config, mesh)
        where = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    return dataclasses.replace(model, params=_with(model.params, where))


def run(args, parser) -> list[dict]:
    devices = topology_devices(args.topology)
    hbm = HBM_GIB.get(args.topology.split(":")[0], 16) * GIB
    mesh = None if args.mesh is None else sharding.make_mesh(args.mesh, devices)
    target = abstract_model(args.target, args.dtype)
    draft = None if args.method == "ar" else args.draft
    if draft is not None and not draft.startswith(DRAFTERS):
        draft = abstract_model(args.draft, args.dtype)
    kwargs = sampling_kwargs(args)
    where = f"{args.topology}" + (f" mesh {args.mesh}" if args.mesh else " one chip")
    print(f"# {args.target} ({args.dtype}) on {where}; batch {args.batch_size}, prompt "
          f"{args.prompt_tokens} + {args.max_new_tokens} new; jax {jax.__version__}")  # fmt: skip
    rows = []
    for program in args.programs.split(","):
        call = kwargs if program == "step" else {**kwargs, **_ar(kwargs)}
        try:
            decoder, step_args = abstract_call(
                target, None if program == "ar" else draft, call, devices, mesh,
                rows=args.batch_size, prompt_tokens=args.prompt_tokens,
                max_new_tokens=args.max_new_tokens, n=args.n,
            )  # fmt: skip
        except ValueError as err:
            rows.append(dict(program=program, compiles=False, error=" ".join(str(err).split())))
        else:
            blocks = cache_blocks_read(args.prompt_tokens, args.max_new_tokens)
            rows.append(compile_program(program, decoder, step_args, hbm, args.hlo_dir, blocks))
        rows[-1].update(target=args.target, topology=args.topology, mesh=args.mesh,
                        batch=args.batch_size, method=call["method"])  # fmt: skip
        print_row(rows[-1])
    return rows


def _ar(kwargs) -> dict:
    """The AR call at the same batch and controls: no draft, no draft shape."""
    drop = ("num_draft_tokens", "num_drafts", "tree", "lookup_ngram", "lookup_max", "draft_stop")
    return {"method": "ar", **{k: None for k in drop if k in kwargs}}


def main(argv=None) -> int:
    parser = build_bench_parser()
    args = parser.parse_args(argv)
    check(parser, args)
    args.batch_size = args.batch_size or len(args.prompt or [None])
    if args.prompts is not None or args.quantize or args.draft_quantize:
        parser.error("--prompts, --quantize and --draft-quantize are not compiled by this bench")
    bad = [p for p in args.programs.split(",") if p not in ("step", "ar")]
    if bad:
        parser.error(f"--programs: unknown program {bad[0]!r} (step, ar)")
    try:
        rows = run(args, parser)
    except ValueError as err:
        print(f"bench_tpu.py: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    if args.json_out:
        where = machine()  # the compiling machine and its load (the figures are estimates)
        lines = (json.dumps(dict(r, machine=where), default=str) + "\n" for r in rows)
        Path(args.json_out).write_text("".join(lines))
    return 0 if all(r["compiles"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
