"""One of the 2 processes of test_multihost.py: 2 fake CPU devices each, a 4-device global mesh.

    python tests/multihost_worker.py CKPT_DIR PORT PROCESS_ID

Joins the other process through ``jax.distributed.initialize`` (gloo collectives on CPU), runs
the sampling calls of ``test_multihost`` and the command line on the global mesh, and prints one
line ``REPORT {json}``. Every call mirrors what the test runs in one process on one device.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

import asps_jax  # noqa: E402
from asps_jax import sharding  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_multihost import CLI_ARGS, MESH  # noqa: E402
from test_sharding import CASES, PROMPTS, sample_kwargs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _error(call) -> str:
    try:
        call()
    except ValueError as err:
        return str(err)
    return ""


def main(ckpt: str, port: str, process_id: int) -> dict:
    index, count = sharding.init_distributed(f"127.0.0.1:{port}", 2, process_id, timeout_s=60)
    report: dict = {
        "process": index,
        "processes": count,
        "devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
    }
    target = asps_jax.load_model(str(Path(ckpt) / "target"))
    draft = asps_jax.load_model(str(Path(ckpt) / "draft"))
    mesh = sharding.make_mesh(MESH)
    report["mesh_processes"] = [[d.process_index for d in row] for row in mesh.devices]
    for method in CASES:
        out = asps_jax.sample(target, draft, PROMPTS, mesh=mesh, **sample_kwargs(method))
        report[method] = np.asarray(out.tokens).tolist()
        report[f"{method}/lengths"] = np.asarray(out.lengths).tolist()
        report[f"{method}/local"] = out.tokens.is_fully_addressable
    # Process 1 passes other prompts: both processes refuse before compiling anything.
    prompts = PROMPTS if index == 0 else PROMPTS[::-1]
    report["mismatch"] = _error(
        lambda: asps_jax.sample(target, draft, prompts, mesh=mesh, **sample_kwargs("asps"))
    )
    report["too_small"] = _error(lambda: sharding.make_mesh("data=2"))
    # The command line (Session: one compiled step at a time), default mesh data=<all devices>.
    sys.path.insert(0, str(ROOT / "scripts"))
    import sample as cli

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        report["cli_code"] = cli.main(
            CLI_ARGS + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
            + ["--process-id", str(process_id)]
        )  # fmt: skip
    report["cli_stdout"] = stdout.getvalue()
    return report


if __name__ == "__main__":
    print("REPORT " + json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))), flush=True)
