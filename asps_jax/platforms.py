"""The platform a call runs on (``"cpu"``, ``"tpu"``, ``"gpu"``...), decided from the devices of
the call, never from the host process: a program compiled ahead of time for a TPU from a CPU
process (``jax.jit(...).lower`` on arguments placed on a TPU topology, ``jax.export``, a serving
build step) is the TPU's program. Choices that differ between XLA:CPU and an accelerator (the
KV-cache commit's row loop, ``kv_cache.row_loop_for``) read :func:`of`.

And :func:`default_platforms`: which JAX backends a command line should start where the user chose
none (``JAX_PLATFORMS`` unset).

(Not ``platform.py``: a script run from a folder of the package (``controls/dfa_worker.py`` is
one) would see such a file shadow the standard library's ``platform`` module.)
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import jax

__all__ = ["default_platforms", "of"]

_GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips attach through PCI under Google's vendor id


def _platform_of_sharding(sharding) -> str | None:
    """The platform of a sharding's devices: a concrete sharding's device set, or (inside a
    trace) the abstract mesh's device kind that a ``NamedSharding`` carries."""
    try:
        devices = sharding.device_set
    except (AttributeError, ValueError, RuntimeError):
        devices = None
    if devices:
        return next(iter(devices)).platform
    device = getattr(getattr(sharding, "mesh", None), "abstract_device", None)
    return getattr(device, "platform", None)


def _platform_of_array(x) -> str | None:
    sharding = getattr(x, "sharding", None)  # a placed array or a ShapeDtypeStruct
    if sharding is None and isinstance(x, jax.core.Tracer):
        sharding = getattr(jax.typeof(x), "sharding", None)  # a traced argument's aval
    return None if sharding is None else _platform_of_sharding(sharding)


def of(mesh=None, *arrays) -> str:
    """The platform the call runs on: the mesh's devices when there is a mesh, else the first of
    ``arrays`` (placed arrays, ``ShapeDtypeStruct``\\ s, or tracers of a call's arguments, whose
    ``NamedSharding`` names the compile target) that tells, else JAX's default backend (where an
    uncommitted call runs). Lowercase, as ``Device.platform``."""
    if mesh is not None:
        return mesh.devices.flat[0].platform
    for leaf in jax.tree.leaves(arrays):
        platform = _platform_of_array(leaf)
        if platform:
            return platform
    return jax.default_backend()


def _tpu_chips() -> int:
    """TPU chips on this machine's PCI bus (what JAX itself checks before suggesting libtpu)."""
    count = 0
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            count += Path(vendor).read_text().strip() == _GOOGLE_PCI_VENDOR
        except OSError:
            continue
    return count


def default_platforms() -> str | None:
    """``"cpu"`` where ``JAX_PLATFORMS`` is unset and this machine has no accelerator (no TPU chip
    on the PCI bus, no NVIDIA or AMD GPU device node); None (JAX chooses) otherwise.

    With libtpu installed (``pip install asps_jax[tpu]``, e.g. to compile for a TPU from a CPU
    machine), JAX's backend discovery initializes libtpu on a machine without a TPU, which prints
    a page of warnings to stderr and waits on it; a command that will run on the CPU anyway skips
    that. Setting ``JAX_PLATFORMS`` (even to ``""``) keeps JAX's own choice."""
    if "JAX_PLATFORMS" in os.environ:
        return None
    gpu = glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd")
    return None if gpu or _tpu_chips() else "cpu"
