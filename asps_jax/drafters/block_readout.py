"""The block drafter's readout (:mod:`asps_jax.drafters.block_model`): how the block's n output
states become the n draft laws.

``"position"`` (DFlash's): depth i's logits are ``lm_head(norm(h_i))``, a law that ignores the
tokens drawn at the block's earlier depths. ``"recurrent"`` (after Hydra's sequentially-dependent
heads and ReDrafter's RNN head): a small map run as a rollout over the depths,

    o_i = h_i + W_out silu(W_in [h_i ; rms(emb(x_{i-1})) * readout_norm ; o_{i-1}]),
    logits_i = lm_head(norm(o_i)),

with ``x_0`` the bonus token and ``o_0 = 0``: depth i's law depends on the committed text (through
``h_i``) and on the node's own path ``x_0 .. x_{i-1}`` (through the embedding and ``o_{i-1}``).
Each node's law is a proper distribution given its path, as a draft model's is, so every verifier
stays exact. Its cost per depth is ``4 E R`` multiply-adds (``R`` the readout width), no attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from asps_jax.models.layers import rms_norm

READOUTS = ("position", "recurrent")

TENSORS = {  # ours -> the checkpoint's name (only in a recurrent drafter)
    "readout_norm": "readout.embed_norm.weight",
    "readout_in": "readout.fc_in.weight",
    "readout_out": "readout.fc_out.weight",
}

AXES = {"readout_norm": ("embed",), "readout_in": ("mlp", None), "readout_out": (None, "mlp")}


def shapes(c) -> dict[str, tuple[int, ...]]:
    """The readout's own parameters' shapes (none for the position-wise one)."""
    if c.readout != "recurrent":
        return {}
    E, R = c.hidden_size, c.readout_size
    return {"readout_norm": (E,), "readout_in": (R, 3 * E), "readout_out": (E, R)}


def head(c, params: dict, out_XE) -> jax.Array:
    """``lm_head(norm(out))``: float32 logits over the draft vocabulary."""
    h = rms_norm(out_XE, params["norm"], c.rms_norm_eps)
    return jnp.einsum("...e,ve->...v", h, params["lm_head"], preferred_element_type=jnp.float32)


def step(c, params: dict, h_XE, token_X, prev_XE):
    """One depth of the recurrent readout: ``(o float[..., E], logits float32[..., V_d])`` from
    the block's state ``h``, the parent's token (a target id) and the parent's ``o``."""
    dtype = params["readout_in"].dtype
    a = rms_norm(params["embed"][token_X].astype(dtype), params["readout_norm"], c.rms_norm_eps)
    u = jnp.concatenate([h_XE.astype(dtype), a, prev_XE.astype(dtype)], axis=-1)
    mid = jax.nn.silu(jnp.einsum("...i,ri->...r", u, params["readout_in"]))
    out = h_XE.astype(dtype) + jnp.einsum("...r,er->...e", mid, params["readout_out"])
    return out, head(c, params, out)


def logits(c, params: dict, h_XNE, parents_XN=None) -> jax.Array:
    """The N depths' logits ``float32[..., N, V_d]`` of the block's states ``h [..., N, E]``; a
    recurrent readout is teacher-forced on ``parents [..., N]`` (depth i's parent token: the
    bonus token, then the text's tokens)."""
    if c.readout != "recurrent":
        return head(c, params, h_XNE)
    if parents_XN is None:
        raise ValueError("a recurrent readout needs each depth's parent token")

    def body(prev, xs):
        h, token = xs
        out, lg = step(c, params, h, token, prev)
        return out, lg

    h_NXE, tok_NX = jnp.moveaxis(h_XNE, -2, 0), jnp.moveaxis(parents_XN, -1, 0)
    _, lg_NXV = jax.lax.scan(body, jnp.zeros_like(h_NXE[0]), (h_NXE, tok_NX))
    return jnp.moveaxis(lg_NXV, 0, -2)


def check(readout, size, where: str) -> None:
    """A one-line error for an unknown readout or a bad width."""
    if readout not in READOUTS:
        raise ValueError(
            f"{where}: block_config.readout must be one of {list(READOUTS)}, got {readout!r}"
        )
    if readout == "recurrent" and size < 1:
        raise ValueError(f"{where}: block_config.readout_size must be >= 1, got {size}")
