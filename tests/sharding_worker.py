"""Run asps_jax.sample on 8 fake CPU devices; print one JSON object (used by test_sharding.py).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_worker.py CKPT_DIR

The device count must be set before JAX initialises, hence a separate process. Every sampling
call mirrors ``test_sharding.CASES`` so that the test can compare the tokens with its in-process
single-device run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

import asps_jax  # noqa: E402
from asps_jax import sharding  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_sharding import (  # noqa: E402
    CASES,
    CLI_ARGS,
    DRAFTER_MESH,
    DRAFTERS,
    MEMORY_CASES,
    MESHES,
    PROMPTS,
    drafter_arg,
    drafter_kwargs,
    memory_models,
    sample_kwargs,
)

ROOT = Path(__file__).resolve().parents[1]


def _spec(x) -> list:
    return [None if a is None else str(a) for a in x.sharding.spec]


def main(ckpt: str) -> dict:
    report: dict = {"devices": len(jax.devices())}
    target = asps_jax.load_model(str(Path(ckpt) / "target"))
    draft = asps_jax.load_model(str(Path(ckpt) / "draft"))
    for mesh_spec in MESHES:
        mesh = sharding.make_mesh(mesh_spec)
        for method in CASES:
            out = asps_jax.sample(target, draft, PROMPTS, mesh=mesh, **sample_kwargs(method))
            report[f"{mesh_spec}/{method}"] = np.asarray(out.tokens).tolist()
    # The parameters as placed on data=2,model=4 (4 heads split, 2 KV heads replicated).
    mesh = sharding.make_mesh("data=2,model=4")
    placed = sharding.place_model_params(target, mesh)
    report["specs"] = {
        name: _spec(placed["layers"][name]) for name in ("wq", "wk", "wo", "w_up", "w_down")
    }
    report["specs"]["lm_head"] = _spec(placed["lm_head"])
    # A single prompt on data=8 is padded to 8 rows: same shapes, same compiled loop.
    mesh8 = sharding.make_mesh("data=8,model=1")
    kwargs = dict(sample_kwargs("asps"), top_p=1.0)  # row 0's top-p
    alone = asps_jax.sample(target, draft, PROMPTS[:1], mesh=mesh8, **kwargs)
    report["alone/asps"] = np.asarray(alone.tokens).tolist()
    # jax.make_mesh gives Explicit axes by default; sample() must accept that mesh too.
    explicit = jax.make_mesh((8, 1), ("data", "model"))
    out = asps_jax.sample(target, draft, PROMPTS, mesh=explicit, **sample_kwargs("asps"))
    report["explicit/asps"] = np.asarray(out.tokens).tolist()
    report.update(drafter_report(Path(ckpt), target, draft))
    report.update(chip_report(Path(ckpt), target, draft))
    # The command line on the bundled checkpoints, streaming through Session.
    sys.path.insert(0, str(ROOT / "scripts"))
    import sample as cli

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        report["cli_code"] = cli.main(CLI_ARGS + ["--mesh", "data=2,model=4"])
    report["cli"] = json.loads(stdout.getvalue())
    return report


def drafter_report(root: Path, target, draft) -> dict:
    """Every other drafter and continuous batching on ``DRAFTER_MESH``: tokens, and how their
    parameters were placed."""
    from asps_jax.drafters import draft_model

    report = {}
    mesh = sharding.make_mesh(DRAFTER_MESH)
    for name in DRAFTERS:
        drafter, kwargs = drafter_arg(name, root, draft), drafter_kwargs(name)
        if name == "slots":  # step by step (the slots' state placed between compiled steps)
            session = asps_jax.Session(target, drafter, PROMPTS, mesh=mesh, **kwargs)
            session.compile()
            pairs = list(session.steps())
            out = session.result()
            report["drafters/slots/pairs"] = len(pairs)
        else:
            out = asps_jax.sample(target, drafter, PROMPTS, mesh=mesh, **kwargs)
        report[f"drafters/{name}"] = np.asarray(out.tokens).tolist()

    def placed(name):
        model = draft_model(target, drafter_arg(name, root, draft))
        return sharding.place_model_params(model, mesh)

    mine, quantized, learned, blocked = map(placed, ("self:1", "quant:int8", "eagle3", "block"))
    up, down = quantized["layers"]["w_up"], quantized["layers"]["w_down"]
    report["drafter_specs"] = {
        "self/wq": _spec(mine["layers"]["wq"]),
        "self/w_down": _spec(mine["layers"]["w_down"]),
        "quant/w_up": _spec(up.qvalue),
        "quant/w_up.scale": _spec(up.scale),
        "quant/w_down": _spec(down.qvalue),
        "quant/w_down.scale": _spec(down.scale),
        **{f"head/{w}": _spec(learned[w]) for w in ("wq", "w_down", "lm_head", "embed", "fc")},
        **{f"block/{w}": _spec(blocked[w]) for w in ("wq", "w_down", "lm_head")},
    }
    return report


def chip_report(root: Path, target, draft) -> dict:
    """Per chip: the weights each chip holds (placed, against ``sharding.chip_bytes``) and the
    compiled per-chip peak of a whole sampling program (``memory_analysis``) against the plan's
    per-chip estimate, on the meshes of ``test_sharding.MEMORY_CASES``."""
    from asps_jax import decode, plan, sampler
    from asps_jax.drafters import draft_model

    report = {}
    mesh = sharding.make_mesh(DRAFTER_MESH)
    for name, model in (("target", target), ("quant", draft_model(target, "quant:int8"))):
        placed = sharding.place_model_params(model, mesh)
        held = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(placed))
        expected = sharding.chip_bytes(model.params, model.config, dict(mesh.shape))
        report[f"chip_bytes/{name}"] = [held, expected]
    big, small = memory_models()
    for spec, method, batch in MEMORY_CASES:
        mesh = sharding.make_mesh(spec)
        drafter = small if method != "ar" else None
        kwargs = dict(max_new_tokens=16, method=method, num_draft_tokens=2 if drafter else None)
        call = sampler.prepare(
            big, drafter, [[1] * 9] * batch, key=jax.random.key(0), mesh=mesh, **kwargs
        )
        compiled = decode.generate.lower(call.decoder, **call.inputs.kwargs()).compile()
        shape = dict(batch=batch, prompt_len=9, max_new_tokens=16, num_drafts=1)
        shape["num_draft_tokens"] = call.decoder.spec.num_draft_tokens
        parts = plan.check_memory(big, drafter, method=method, mesh=mesh, **shape)
        weights = plan.weights(mesh, big, drafter)
        even = sum(plan.check_memory(big, drafter, method=method, **shape).values())
        even = (even + plan.weights(None, big, drafter)) // mesh.size
        peak = compiled.memory_analysis().peak_memory_in_bytes
        report[f"memory/{spec}/{method}"] = [peak, sum(parts.values()) + weights, even]
    return report


if __name__ == "__main__":
    print("REPORT " + json.dumps(main(sys.argv[1])))
