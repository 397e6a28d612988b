"""The logical axes of a learned head's parameters (``draft="eagle3:PATH"`` on a mesh).

A head is one Llama decoder layer (``asps_jax.drafters.head``); on a mesh its parameters follow
the target's rules (``asps_jax.sharding.ShardingRules``): the attention projections split by
heads, the MLP by its width, ``lm_head`` and the target's embedding by the vocabulary, everything
else (``fc`` over the target's features, the norms, the draft -> target id map) whole on every
chip. A rule falls back to whole where the mesh axis does not divide the size, as for the target.
The features the head reads come from the target's scoring pass, laid out as the target's
activations; the head's cache and pending entries are a decode state's (split by rows).
"""

from __future__ import annotations

import types

AXES = {
    "fc": (None, "embed"),
    "input_norm": ("embed",),
    "hidden_norm": ("embed",),
    "wq": ("heads", None),
    "wk": ("kv_heads", None),
    "wv": ("kv_heads", None),
    "wo": (None, "heads"),
    "post_norm": ("embed",),
    "w_gate": ("mlp", None),
    "w_up": ("mlp", None),
    "w_down": (None, "mlp"),
    "norm": ("embed",),
    "lm_head": ("vocab", "embed"),
    "embed": ("vocab", "embed"),
    "d2t": (None,),
}


def family(forward, shapes_of):
    """The namespace ``models.base.family_for_config`` finds for a head's config: its
    ``forward``, and ``param_shapes(c)``, ``{name: (shape, logical axes)}`` of every parameter
    (``shapes_of(c)``: the learned ones' shapes) with the embedding and the vocabulary map, which
    ``sharding.shard_params`` reads. No run layout (no ``prepare_params``)."""

    def param_shapes(c) -> dict:
        shapes = dict(
            shapes_of(c), embed=(c.vocab_size, c.target_hidden_size), d2t=(c.draft_vocab_size,)
        )
        return {name: (shape, AXES[name]) for name, shape in shapes.items()}

    return types.SimpleNamespace(forward=forward, param_shapes=param_shapes)
