"""Rotary position embeddings in Hugging Face's split-half layout, with its scaling variants.

HF Llama rotates the pair ``(x[i], x[i + H/2])`` (``rotate_half``), not the interleaved pairs
``(x[2i], x[2i+1])`` of the original Meta code; HF's conversion script permuted the q/k projection
rows once so that this layout works. Using the same layout here lets HF weights load unpermuted.

Supported ``rope_type`` values (the names transformers 5.x uses in ``rope_parameters``):
``default``, ``linear`` (positions divided by ``factor``), ``dynamic`` (NTK-aware base growth once
the sequence exceeds ``max_position_embeddings``) and ``llama3`` (Llama 3.1 band-wise scaling).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Hashable RoPE scaling parameters (``None`` on the config means plain RoPE)."""

    rope_type: str  # "linear" | "dynamic" | "llama3"
    factor: float
    low_freq_factor: float | None = None  # llama3 only
    high_freq_factor: float | None = None  # llama3 only
    original_max_position_embeddings: int | None = None  # llama3 only

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES[1:]:
            raise ValueError(
                f"rope_scaling.rope_type must be one of {ROPE_TYPES[1:]}, got {self.rope_type!r}"
            )
        if self.rope_type == "llama3" and None in (
            self.low_freq_factor,
            self.high_freq_factor,
            self.original_max_position_embeddings,
        ):
            raise ValueError(
                "rope_scaling of type 'llama3' needs low_freq_factor, high_freq_factor and "
                "original_max_position_embeddings"
            )

    @classmethod
    def from_hf(cls, d: dict | None, max_position_embeddings: int) -> RopeScaling | None:
        if not d:
            return None
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type == "default":
            return None
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_scaling: unsupported rope_type {rope_type!r}; supported: {ROPE_TYPES}"
            )
        if "factor" not in d:
            raise ValueError(f"rope_scaling of type {rope_type!r} needs a 'factor'")
        extra = {}
        if rope_type == "llama3":
            extra = dict(
                low_freq_factor=float(d["low_freq_factor"]),
                high_freq_factor=float(d["high_freq_factor"]),
                original_max_position_embeddings=int(
                    d.get("original_max_position_embeddings", max_position_embeddings)
                ),
            )
        return cls(rope_type, float(d["factor"]), **extra)

    def to_hf(self) -> dict:
        d = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            d.update(
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
        return d


def _base_inv_freq(theta: float, head_dim: int) -> np.ndarray:
    # float32 like HF: arange(0, H, 2) / H, then theta ** that.
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return (1.0 / (np.float32(theta) ** exponent)).astype(np.float32)


def static_inv_freq(theta: float, head_dim: int, scaling: RopeScaling | None) -> np.ndarray | None:
    """``float32[H/2]`` inverse frequencies, or None for ``dynamic`` (they depend on positions)."""
    inv_freq = _base_inv_freq(theta, head_dim)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    if scaling.rope_type == "dynamic":
        return None
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _dynamic_inv_freq(
    theta: float, head_dim: int, factor: float, max_pos: int, positions_BT: jax.Array
) -> jax.Array:
    """``float32[B, 1, H/2]``: NTK base growth from each row's current length.

    HF takes ``max(position_ids) + 1`` over the whole batch; we take it per row so that a row's
    logits never depend on which other rows share its batch (identical for batch size 1). The
    positions of padded tokens count too, as in HF; this only matters past
    ``max_position_embeddings``.
    """
    seq_len = jnp.maximum(jnp.max(positions_BT, axis=1) + 1, max_pos).astype(jnp.float32)  # [B]
    base = theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (head_dim / (head_dim - 2))
    exponent = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    return (1.0 / (base[:, None] ** exponent[None, :]))[:, None, :]


def rope_tables(
    theta: float,
    head_dim: int,
    scaling: RopeScaling | None,
    max_position_embeddings: int,
    positions_BT: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)``, each ``float32[B, T, H/2]``, for integer positions."""
    inv_freq = static_inv_freq(theta, head_dim, scaling)
    if inv_freq is None:
        inv_freq_B1h = _dynamic_inv_freq(
            theta, head_dim, scaling.factor, max_position_embeddings, positions_BT
        )
    else:
        inv_freq_B1h = jnp.asarray(inv_freq)[None, None, :]
    angles_BTh = positions_BT.astype(jnp.float32)[:, :, None] * inv_freq_B1h
    return jnp.cos(angles_BTh), jnp.sin(angles_BTh)


def apply_rope(x_BTNH: jax.Array, cos_BTh: jax.Array, sin_BTh: jax.Array) -> jax.Array:
    """Rotate ``(x[i], x[i + H/2])`` pairs (HF ``rotate_half``), in float32, back to x's dtype."""
    half = x_BTNH.shape[-1] // 2
    x = x_BTNH.astype(jnp.float32)
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos_BTh[:, :, None, :], sin_BTh[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)
