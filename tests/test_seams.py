"""The seams between the decoding loop and its neighbours, read from the source (cheap: no JAX
program is built): continuous batching calls the decoder's public methods only, the loop reads a
forward's output by field (no arity test), and the docstrings that name these seams stay true."""

from __future__ import annotations

import ast
from pathlib import Path

import asps_jax
from asps_jax.models import base

PACKAGE = Path(asps_jax.__file__).parent


def _tree(module: str) -> ast.Module:
    return ast.parse((PACKAGE / module).read_text())


def test_slots_calls_no_private_decode_function():
    used = {
        node.attr
        for node in ast.walk(_tree("slots.py"))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "decode"
    }
    assert not {name for name in used if name.startswith("_")}
    doc = ast.get_docstring(_tree("slots.py"))
    assert "decode._" not in doc and "Decoder.insert" in doc


def test_decode_has_no_arity_test_on_forward_outputs():
    for module in ("decode.py", "decode_state.py"):
        for node in ast.walk(_tree(module)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id == "len":
                    raise AssertionError(f"{module}:{node.lineno}: len() of a value")
                if node.func.id == "isinstance" and "tuple" in ast.unparse(node.args[1]):
                    raise AssertionError(f"{module}:{node.lineno}: isinstance(..., tuple)")


def test_the_slot_seam_is_public_and_jitted():
    from asps_jax.decode import Decoder

    for name in ("prefill", "empty", "insert", "step", "generate"):
        assert hasattr(getattr(Decoder, name), "lower"), name  # a jitted function


def test_base_docstring_names_every_registered_family():
    doc = base.__doc__
    missing = [name for name in base.FAMILY_MODULES if f"``{name}``" not in doc]
    assert not missing, f"models/base.py's docstring does not name {missing}"


def test_the_drafter_protocol_docstring_counts_its_device_methods():
    from asps_jax.drafters import base as drafter_base

    device = ("init", "prefill", "refill", "propose", "commit", "take")
    words = {4: "four", 5: "five", 6: "six", 7: "seven"}
    doc = drafter_base.__doc__
    assert f"through {words[len(device)]} device methods" in doc
    assert all(f":meth:`Drafter.{name}`" in doc for name in device)
    defined = {name for name in vars(drafter_base.Drafter) if not name.startswith("_")}
    host = {"check", "context", "context_source", "default_draft_len", "cache_slots", "footprint"}
    attributes = {"one_root_law", "replicated", "feature_layers", "name"}
    assert defined == set(device) | host | attributes
