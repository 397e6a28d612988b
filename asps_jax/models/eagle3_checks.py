"""The checks of an EAGLE-3 head's files (:mod:`asps_jax.models.eagle3`): ``config.json``'s fields
by type and range, the weights' dtypes, and the vocabulary maps ``d2t`` / ``t2d``.

Each refusal is one :class:`~asps_jax.models.loader.CheckpointError` line (a ``ValueError``) that
starts with ``where`` (the ``draft=eagle3:PATH``
argument and the file) and names the field or tensor at fault. The rules:

* every size (``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
  ``num_key_value_heads``, ``head_dim``, ``vocab_size``, ``draft_vocab_size``,
  ``target_hidden_size``, ``max_position_embeddings``) is an integer >= 1 (an integral float such
  as ``16.0`` is read as one; ``null`` or absent takes the documented default: the head count for
  ``num_key_value_heads``, ``hidden_size / num_attention_heads`` for ``head_dim``, ``vocab_size``
  for ``draft_vocab_size``, ``hidden_size`` for ``target_hidden_size``, 2048 positions);
  ``num_attention_heads`` is a multiple of ``num_key_value_heads`` and ``draft_vocab_size`` at most
  ``vocab_size``; ``rms_norm_eps`` and ``rope_theta`` are numbers > 0; ``rope_scaling`` (or
  ``rope_parameters``) is an object or ``null``; the feature layer ids are integers >= 0;
* the learned weights are floating point (bf16, f16, f32, f64: cast to the run's dtype); an
  integer or bool weight tensor is refused (a quantized or corrupt export, never cast);
* ``d2t`` holds one integer offset per draft id (target id = draft id + offset), each target id
  in range and none twice; ``t2d``, when present (vLLM and SGLang read it), is ``vocab_size``
  booleans (or 0 / 1) true exactly at the target ids ``d2t`` gives.
"""

from __future__ import annotations

import math

import numpy as np

from asps_jax.models.loader import CheckpointError
from asps_jax.models.rope import RopeScaling

SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
    "max_position_embeddings",
)
DEFAULT_CONTEXT = 2048


def _integer(value, field: str, where: str, low: int) -> int:
    ok = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not ok or value < low:
        raise CheckpointError(
            f"{where}: field {field!r} must be an integer >= {low}, got {value!r}"
        )
    return int(value)


def _number(d: dict, field: str, where: str, default: float) -> float:
    value = d.get(field, default)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"{where}: field {field!r} must be a number > 0, got {value!r}")
    return float(value)


def _sizes(d: dict, where: str) -> dict[str, int]:
    """The size fields, defaults applied (see the module docstring)."""
    for field in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if d.get(field) is None:
            raise CheckpointError(
                f"{where}: not a valid EAGLE-3 head config (field {field!r} is missing)"
            )
    got = {f: _integer(d[f], f, where, 1) for f in SIZES if d.get(f) is not None}
    heads, hidden = got["num_attention_heads"], got["hidden_size"]
    got.setdefault("num_key_value_heads", heads)
    got.setdefault("draft_vocab_size", got["vocab_size"])
    got.setdefault("target_hidden_size", hidden)
    got.setdefault("max_position_embeddings", DEFAULT_CONTEXT)
    if "head_dim" not in got:
        if hidden % heads:
            raise CheckpointError(
                f"{where}: field 'head_dim' is missing and hidden_size {hidden} is not a multiple "
                f"of num_attention_heads {heads}"
            )
        got["head_dim"] = hidden // heads
    if heads % got["num_key_value_heads"]:
        raise CheckpointError(
            f"{where}: field 'num_attention_heads' ({heads}) must be a multiple of "
            f"'num_key_value_heads' ({got['num_key_value_heads']})"
        )
    if got["draft_vocab_size"] > got["vocab_size"]:
        raise CheckpointError(
            f"{where}: field 'draft_vocab_size' ({got['draft_vocab_size']}) must be at most "
            f"'vocab_size' ({got['vocab_size']})"
        )
    return got


def _rope(d: dict, where: str, max_pos: int) -> tuple[RopeScaling | None, dict]:
    field = "rope_scaling" if d.get("rope_scaling") is not None else "rope_parameters"
    rope = d.get(field)
    if rope is None:
        return None, {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{where}: field {field!r} must be an object or null, got {rope!r}")
    try:
        return RopeScaling.from_hf(rope, max_pos), rope
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: field {field!r}: {e}") from None


def _layers(d: dict, where: str) -> tuple[int, ...] | None:
    eagle = d.get("eagle_config")
    if eagle is None:
        return None
    if not isinstance(eagle, dict):
        raise CheckpointError(f"{where}: field 'eagle_config' must be an object, got {eagle!r}")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return None
    field = "eagle_config.eagle_aux_hidden_state_layer_ids"
    if not isinstance(ids, list) or not ids:
        raise CheckpointError(f"{where}: field {field!r} must be a list of layer ids, got {ids!r}")
    return tuple(_integer(i, field, where, 0) for i in ids)


def config_fields(d: dict, where: str) -> dict:
    """The :class:`~asps_jax.models.eagle3.HeadConfig` fields of an EAGLE-3 ``config.json``
    ``d`` (``feature_layers`` None: the target's defaults), checked as the module docstring
    says."""
    arch = d.get("architectures") or []
    if not isinstance(arch, list) or not any("Eagle3" in str(a) for a in arch):
        raise CheckpointError(
            f"{where}: not an EAGLE-3 head (architectures {arch}); expected "
            "'LlamaForCausalLMEagle3'"
        )
    layers = d.get("num_hidden_layers", 1)
    if layers != 1:
        raise CheckpointError(f"{where}: an EAGLE-3 head has one layer, got {layers}")
    sizes = _sizes(d, where)
    scaling, rope = _rope(d, where, sizes["max_position_embeddings"])
    theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
    return dict(
        sizes,
        feature_layers=_layers(d, where),
        rms_norm_eps=_number(d, "rms_norm_eps", where, 1e-6),
        rope_theta=_number({"rope_theta": theta}, "rope_theta", where, 10000.0),
        rope_scaling=scaling,
    )


def check_weight(name: str, a: np.ndarray, where: str) -> None:
    """A learned weight's dtype: floating point (see the module docstring)."""
    if a.dtype.kind != "f" and str(a.dtype) != "bfloat16":
        raise CheckpointError(
            f"{where}: tensor {name!r} is {a.dtype}; a head's weights must be floating point "
            "(bf16, f16, f32; a quantized or integer export is not read)"
        )


def target_ids(tensors: dict, draft_vocab: int, vocab: int, where: str) -> np.ndarray:
    """int64[V_d]: the target id of each draft id, from ``d2t`` (absent: the identity, when
    ``V_d = V``), checked against ``t2d`` when present."""
    d2t = tensors.get("d2t")
    if d2t is None:
        if draft_vocab != vocab:
            raise CheckpointError(f"{where}: the weights lack 'd2t' (the draft-to-target map)")
        d2t = np.zeros(vocab, np.int64)
    if d2t.shape != (draft_vocab,) or d2t.dtype.kind not in "iu":
        raise CheckpointError(
            f"{where}: 'd2t' must be {draft_vocab} integer offsets (one per draft id), "
            f"got {d2t.dtype} of shape {list(d2t.shape)}"
        )
    ids = np.arange(draft_vocab) + d2t.astype(np.int64)
    if ids.min() < 0 or ids.max() >= vocab:
        raise CheckpointError(
            f"{where}: 'd2t' must map each of the {draft_vocab} draft ids to a target id in "
            f"[0, {vocab})"
        )
    if len(np.unique(ids)) != len(ids):
        raise CheckpointError(f"{where}: 'd2t' maps two draft ids to one target id")
    t2d = tensors.get("t2d")
    if t2d is not None:
        if t2d.shape != (vocab,) or not (t2d.dtype == bool or np.isin(t2d, (0, 1)).all()):
            raise CheckpointError(
                f"{where}: 't2d' must be {vocab} booleans (one per target id), got {t2d.dtype} "
                f"of shape {list(t2d.shape)}"
            )
        want = np.zeros(vocab, bool)
        want[ids] = True
        if not np.array_equal(t2d.astype(bool), want):
            wrong = int(np.flatnonzero(t2d.astype(bool) != want)[0])
            raise CheckpointError(
                f"{where}: 't2d' contradicts 'd2t' at target id {wrong} ('t2d' says "
                f"{bool(t2d[wrong])}, 'd2t' {'maps' if want[wrong] else 'does not map'} a draft "
                "id to it)"
            )
    return ids
