"""Published block-drafter layouts for ``draft="block:PATH"``: the DFlash layout read and written
as the block drafter's ``"dflash"`` variant, P-EAGLE's as an EAGLE-3 head drafting in parallel
(:mod:`asps_jax.drafters.peagle`); docs/algorithms.md §12, "Checkpoints and the published
layouts".

**DFlash** (z-lab's ``DFlashDraftModel``; vLLM, SGLang and tpu-inference read it): ``config.json``
a Qwen3 config (``"architectures": ["DFlashDraftModel"]``) with ``num_target_layers`` and
``dflash_config``: ``block_size`` B (the bonus token and B - 1 mask slots), ``mask_token_id`` (a
token of the target's vocabulary) and ``target_layer_ids`` (the target layers whose *outputs* it
reads: Hugging Face's ``hidden_states[id + 1]``, our feature layer ``id + 1``); the weights
``fc``, ``hidden_norm``, ``layers.{i}.*`` (Qwen3 layers: ``q_norm`` / ``k_norm`` per head) and
``norm``, nothing else. It is our block drafter with ``variant="dflash"``: N = B - 1 draft
positions; the block entries are the raw embeddings of the bonus token and of the mask token (no
``embed_norm``, no context vector added: the context reaches the block through attention only);
queries and keys (context keys included) get the per-head RMS norms before RoPE; the block is
bidirectional and the context is every committed position, as ours. What the layout does not ship is
taken from the target at load time, as DFlash itself does: the embedding (so the N mask embeddings
are N copies of the mask token's row) and the output head (the target's ``lm_head``, or its tied
embedding, over the whole vocabulary: ``V_d = V``, ``d2t`` the identity).

Refused with a one-line error naming what differs: a causal or sliding-window block (``is_causal``,
``layer_types``), attention biases, another activation, an input-embedding scale, an output
multiplier or logit soft-capping, DFlash2 (``DFlash2DraftModel``: dynamic convolutions and a
candidate selector over the previous draft token), a target layer id whose output is the target's
last (normed) state. :func:`to_dflash` writes a ``"dflash"``-variant drafter back in the layout
(refusing one whose mask embeddings or output head are not the target's, or ours).

**P-EAGLE** (an EAGLE-3 head with ``"parallel_drafting": true``, ``pard_token`` / ``ptd_token_id``
and a learned ``mask_hidden`` feature) is not a block drafter: its layer attends causally over
every committed token's embedding with its features (EAGLE-3's context, not a features-only one).
It is read as what it is, our EAGLE-3 head with one forward per step over the pending entries and
n - 1 pard entries (:mod:`asps_jax.drafters.peagle`), and written back by :func:`save`
(``layout="p-eagle"``); a block drafter is never written as P-EAGLE, nor a P-EAGLE head as DFlash.
The speculators' ``"peagle"`` config (``transformer_layer_config``) and a head of several layers
are refused.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from asps_jax.drafters import block_model as bm
from asps_jax.drafters import peagle
from asps_jax.models import loader
from asps_jax.models.rope import RopeScaling

DFLASH_ARCHITECTURE = "DFlashDraftModel"
LAYOUTS = ("asps", "dflash", "p-eagle")  # what save() writes
# Fields of DFlash checkpoints that change the math in ways the block drafter does not implement.
_DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def layout_of(raw: dict) -> str:
    """The layout of a drafter's ``config.json``: "asps" (ours), "dflash" or "p-eagle"."""
    arch = raw.get("architectures") if isinstance(raw.get("architectures"), list) else []
    arch = [a for a in arch if isinstance(a, str)]
    eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    if (
        raw.get("parallel_drafting") is True
        or eagle.get("parallel_drafting") is True
        or raw.get("speculators_model_type") == "peagle"
        or any("peagle" in a.lower() for a in arch)
    ):
        return "p-eagle"
    if "dflash_config" in raw or any(a.lower().startswith("dflash") for a in arch):
        return "dflash"
    return "asps"


PEAGLE_DIFFERS = (
    "P-EAGLE's layer attends causally over every committed token's embedding with its features "
    "and fills the deeper positions with a learned mask_hidden feature, where the block "
    "drafter's context is the target's features alone, attended bidirectionally"
)


def default_target_layers(num_target_layers: int, num_layers: int) -> list[int]:
    """DFlash's default ``target_layer_ids`` (a config without them): one layer per draft layer,
    evenly spaced from 1 to L - 3 (the middle one for a one-layer drafter)."""
    if num_layers == 1:
        return [num_target_layers // 2]
    step = (num_target_layers - 4) / (num_layers - 1)
    return [round(1 + i * step) for i in range(num_layers)]


def _check_dflash_math(raw: dict, d: dict, where: str) -> None:
    """A one-line error for each DFlash option whose math the block drafter does not have."""
    arch = raw.get("architectures") or []
    if arch != [DFLASH_ARCHITECTURE]:
        raise ValueError(
            f"{where}: unsupported DFlash family (architectures {arch}); the block drafter reads "
            f"{DFLASH_ARCHITECTURE!r} (DFlash2's dynamic convolutions and candidate selector "
            "differ)"
        )
    if any(name in d for name in _DFLASH2_FIELDS):
        raise ValueError(f"{where}: dflash_config has DFlash2's convolution / selector fields")
    types = raw.get("layer_types") or ["full_attention"]
    causal = raw.get("is_causal")
    if causal or (causal is None and any(t != "full_attention" for t in types)):
        raise ValueError(
            f"{where}: a causal block (is_causal / layer_types {sorted(set(types))}); the block "
            "drafter's block is bidirectional"
        )
    if any(t != "full_attention" for t in types):
        raise ValueError(f"{where}: sliding-window layers (layer_types); not supported")
    if raw.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias is true; the block drafter has no biases")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {raw['hidden_act']!r}; the block drafter's is silu")
    for name, neutral in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0)):
        value = d.get(name, raw.get(name, neutral))
        if value is not None and float(value) != neutral:
            raise ValueError(f"{where}: {name} {value}; only {neutral} is supported")
    cap = d.get("final_logit_softcapping", raw.get("final_logit_softcapping"))
    if cap is not None and float(cap) > 0:
        raise ValueError(f"{where}: final_logit_softcapping {cap}; not supported")


def _rope(raw: dict, max_pos: int) -> tuple[float, RopeScaling | None]:
    """``rope_theta`` and the scaling, from the old fields or transformers 5's
    ``rope_parameters``."""
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    return theta, RopeScaling.from_hf(raw.get("rope_scaling") or params or None, max_pos)


def dflash_config(raw: dict, target_config, where: str) -> tuple[bm.BlockConfig, int]:
    """A DFlash ``config.json`` as our :class:`~asps_jax.drafters.block_model.BlockConfig`
    (``variant="dflash"``) and its mask token id; one-line errors for what does not map."""
    d = raw.get("dflash_config") or {}
    if not isinstance(d, dict):
        raise ValueError(f"{where}: dflash_config is not a JSON object")
    try:
        _check_dflash_math(raw, d, where)
        L = int(raw["num_hidden_layers"])
        heads, hidden = int(raw["num_attention_heads"]), int(raw["hidden_size"])
        num_target = int(raw.get("num_target_layers") or target_config.num_hidden_layers)
        ids = d.get("target_layer_ids", raw.get("target_layer_ids"))
        ids = [int(i) for i in (default_target_layers(num_target, L) if ids is None else ids)]
        mask = d.get("mask_token_id", raw.get("mask_token_id"))
        if mask is None:
            raise KeyError("mask_token_id")
        max_pos = int(raw.get("max_position_embeddings", 2048))
        theta, scaling = _rope(raw, max_pos)
        vocab = int(raw["vocab_size"])
        config = bm.BlockConfig(
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            num_hidden_layers=L,
            vocab_size=vocab,
            draft_vocab_size=vocab,
            target_hidden_size=hidden,
            feature_layers=tuple(i + 1 for i in ids),
            block_size=int(d.get("block_size", raw.get("block_size", 16))) - 1,
            variant="dflash",
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
        )
        mask = int(mask)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{where}: not a valid DFlash config ({e!r})") from None
    if config.block_size < 1 or L < 1:
        raise ValueError(f"{where}: dflash_config.block_size must be >= 2, num_hidden_layers >= 1")
    if not 0 <= mask < vocab:
        raise ValueError(f"{where}: dflash_config.mask_token_id {mask} is outside [0, {vocab})")
    last = target_config.num_hidden_layers - 1
    if any(not 0 <= i < last for i in ids):
        raise ValueError(
            f"{where}: dflash_config.target_layer_ids {ids} must be in [0, {last}) for a target "
            f"of {last + 1} layers (the output of its last layer is its normed final state)"
        )
    return config, mask


def target_head(target) -> np.ndarray:
    """The target's output head as rows ``[V, E]`` (its ``lm_head``, or its tied embedding)."""
    t = target.params
    head = t.get("lm_head")
    return np.asarray(t["embed"] if head is None else np.asarray(head).T, np.float32)


def _weights(folder: Path, c: bm.BlockConfig, where: str) -> dict[str, np.ndarray]:
    """The DFlash weights stacked as ours (every tensor but the mask embeddings and the head)."""
    try:
        tensors = {n.removeprefix("model."): a for n, a in loader.iter_tensors(folder)}
    except loader.CheckpointError as e:
        raise ValueError(f"{where}: {e}") from None
    shapes = bm.param_shapes(c)
    parts: dict[str, list] = {}
    for (ours, layer), theirs in bm.tensor_names(c).items():
        if ours in ("mask_embed", "lm_head"):
            continue
        a = tensors.get(theirs)
        want = shapes[ours] if layer is None else shapes[ours][1:]
        if a is None:
            raise ValueError(f"{where}: the weights lack tensor {theirs!r}")
        if tuple(a.shape) != want or (a.dtype.kind != "f" and str(a.dtype) != "bfloat16"):
            raise ValueError(
                f"{where}: tensor {theirs!r} is {a.dtype} of shape {list(a.shape)}, the config "
                f"says floats of shape {list(want)}"
            )
        parts.setdefault(ours, []).append(np.asarray(a, np.float32))
    return {
        name: a[0] if len(shapes[name]) == a[0].ndim else np.stack(a) for name, a in parts.items()
    }


def read(folder, target, dtype, where: str):
    """``(config, params)`` of a published-layout folder for ``target``: a DFlash one (its
    embedding and output head taken from the target) or a P-EAGLE one
    (:func:`asps_jax.drafters.peagle.read`); ``None`` for our own layout. A DFlash folder whose
    architecture differs from ours is a one-line error."""
    folder = Path(folder)
    expected = f"a block drafter folder with {bm.CONFIG_FILE} and {bm.WEIGHTS_FILE}"
    raw = loader.folder_config(folder, where, expected)
    layout = layout_of(raw)
    if layout == "asps":
        return None
    if layout == "p-eagle":  # an EAGLE-3 head drafting in parallel (drafters/peagle.py)
        return peagle.read(folder, raw, target, dtype, where)
    c, mask = dflash_config(raw, target.config, f"{where}: {bm.CONFIG_FILE}")
    bm.check_matches(c, target, where)
    params = _weights(folder, c, where)
    embed = np.asarray(target.params["embed"], np.float32)
    params.update(
        mask_embed=np.tile(embed[mask], (c.block_size, 1)),
        lm_head=target_head(target),
        embed=embed,
    )
    out = {k: jax.numpy.asarray(v, dtype) for k, v in params.items()}
    out["d2t"] = jax.numpy.arange(c.vocab_size, dtype=jax.numpy.int32)
    return c, out


def _mask_token(params: dict, embed: np.ndarray, where: str) -> int:
    """The target token whose embedding every mask embedding is (DFlash's mask token)."""
    masks = np.asarray(jax.device_get(params["mask_embed"]), np.float32)
    hits = np.flatnonzero(np.all(embed == masks[0], axis=1))
    if not np.all(masks == masks[0]) or hits.size == 0:
        raise ValueError(
            f"{where}: the mask embeddings are not N copies of one target token's embedding "
            "(DFlash's block is the mask token's embedding)"
        )
    return int(hits[0])


def dflash_json(c: bm.BlockConfig, mask: int, num_target_layers: int) -> dict:
    """The DFlash ``config.json`` of a ``"dflash"``-variant drafter."""
    block = {
        "block_size": c.block_size + 1,
        "mask_token_id": mask,
        "target_layer_ids": [i - 1 for i in c.feature_layers],
    }
    return {
        "architectures": [DFLASH_ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": c.num_hidden_layers,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None if c.rope_scaling is None else c.rope_scaling.to_hf(),
        "max_position_embeddings": c.max_position_embeddings,
        "layer_types": ["full_attention"] * c.num_hidden_layers,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "num_target_layers": num_target_layers,
        "block_size": c.block_size + 1,
        "dflash_config": block,
    }


def to_dflash(path, config: bm.BlockConfig, params: dict, target) -> Path:
    """Write a ``"dflash"``-variant drafter for ``target`` in the DFlash layout (``config.json`` +
    ``model.safetensors``, both files replaced only once both are written). One-line errors for a
    drafter the layout cannot express: our variant, a recurrent readout, a draft vocabulary, an
    output head other than the target's, mask embeddings other than copies of one target token's,
    feature layer 0."""
    where = f"to_dflash({str(path)!r})"
    c = config
    variant = getattr(c, "variant", "p-eagle")
    if variant != "dflash":
        raise ValueError(
            f"{where}: the drafter's layers are variant {variant!r} (embed_norm "
            "and the context vector on the block, no q/k norms); the DFlash layout holds variant "
            "'dflash' only"
        )
    if c.readout != "position":
        raise ValueError(
            f"{where}: the drafter's readout is {c.readout!r}; DFlash reads each position's law "
            "from its state alone (readout 'position'), with no tensors for another readout"
        )
    embed, head = np.asarray(target.params["embed"], np.float32), target_head(target)
    d2t = np.asarray(jax.device_get(params["d2t"]))
    if c.draft_vocab_size != c.vocab_size or not np.array_equal(d2t, np.arange(c.vocab_size)):
        raise ValueError(f"{where}: DFlash drafts over the target's whole vocabulary (no d2t)")
    if not np.array_equal(np.asarray(jax.device_get(params["lm_head"]), np.float32), head):
        raise ValueError(f"{where}: lm_head is not the target's output head (DFlash uses it)")
    if min(c.feature_layers) < 1:
        raise ValueError(f"{where}: feature layer 0 (the embeddings) has no DFlash layer id")
    mask = _mask_token(params, embed, where)
    host = {k: np.asarray(jax.device_get(v), np.float32) for k, v in params.items()}
    tensors = [
        (theirs, host[ours] if layer is None else host[ours][layer])
        for (ours, layer), theirs in bm.tensor_names(c).items()
        if ours not in ("mask_embed", "lm_head")
    ]
    folder = Path(path)
    config_json = dflash_json(c, mask, target.config.num_hidden_layers)
    return loader.write_checkpoint(folder, tensors, config_json, bm.WEIGHTS_FILE, bm.CONFIG_FILE)


def save(path, config, params: dict, *, layout: str = "asps", target=None) -> Path:
    """Write the drafter in ``layout``: "asps" (ours, :func:`block_model.save`), "dflash"
    (:func:`to_dflash`, needs ``target``) or "p-eagle" (a P-EAGLE head's own layout,
    :func:`asps_jax.drafters.peagle.save`; a block drafter is refused: its architecture is not
    P-EAGLE's)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: one of {list(LAYOUTS)}")
    if isinstance(config, peagle.PEagleConfig) != (layout == "p-eagle"):
        kind = "a P-EAGLE head" if isinstance(config, peagle.PEagleConfig) else "a block drafter"
        raise ValueError(
            f"layout={layout!r}: {kind} cannot be written in it"
            + (f": {PEAGLE_DIFFERS}" if layout == "p-eagle" else "")
        )
    if layout == "p-eagle":
        return peagle.save(path, config, params)
    if layout == "asps":
        return bm.save(path, config, params)
    if target is None:
        raise ValueError("layout='dflash': give target= (DFlash uses its embedding and head)")
    return to_dflash(path, config, params, target)


__all__ = [
    "DFLASH_ARCHITECTURE",
    "LAYOUTS",
    "PEAGLE_DIFFERS",
    "default_target_layers",
    "dflash_config",
    "dflash_json",
    "layout_of",
    "read",
    "save",
    "target_head",
    "to_dflash",
]
