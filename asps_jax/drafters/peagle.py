"""P-EAGLE (parallel EAGLE) under ``draft="block:PATH"``: an EAGLE-3 head that drafts all n
positions in one forward, read from and written to its published layout.

The layout (vLLM's ``parallel_drafting``, read in its P-EAGLE speculator and its EAGLE proposer):
an EAGLE-3 head folder (:mod:`asps_jax.models.eagle3`: ``LlamaForCausalLMEagle3``, ``fc``,
``midlayer.*``, ``norm``, ``lm_head``, ``d2t`` / ``t2d``) whose ``config.json`` says
``"parallel_drafting": true`` with the *pard token* (``pard_token`` or ``ptd_token_id``, a token of
the target's vocabulary), and whose weights add ``mask_hidden`` (a learned feature vector of the
target's concatenated width, ``[1, 1, F]`` or ``[F]``). The head's KV cache over the committed text
is EAGLE-3's (entry t: the fused features at t with the token after t). One forward of a step feeds
the pending entries (the last: the features of position p - 1 with the bonus token x_p) and then
n - 1 *pard* entries (the pard token's embedding with ``fc(mask_hidden)`` as their features) at the
next positions, all causally; the last pending entry's output gives the law of x_{p+1}, pard entry
j's the law of x_{p+1+j}. No entry depends on a drafted token, so the n laws are position-wise and
drawn through the same rollout as the block drafter's (docs/algorithms.md §12 says why every
verifier stays exact). ``block_size`` (``num_speculative_tokens`` in the config, else 8) is only
the default n.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from asps_jax.drafters.base import Proposal
from asps_jax.drafters.head import EagleHead, _chain
from asps_jax.drafters.model import rollout_proposal
from asps_jax.models import eagle3, eagle3_checks, loader
from asps_jax.models.eagle3 import AXES, HeadConfig, drafter_family, fuse, param_shapes

TOKEN_FIELDS = ("pard_token", "ptd_token_id")


@dataclasses.dataclass(frozen=True)
class PEagleConfig(HeadConfig):
    """An EAGLE-3 head's sizes plus P-EAGLE's pard token and default draft length."""

    pard_token: int = 0
    block_size: int = 8

    def to_hf(self) -> dict:
        return dict(
            super().to_hf(),
            parallel_drafting=True,
            pard_token=self.pard_token,
            num_speculative_tokens=self.block_size,
        )


def peagle_shapes(c: PEagleConfig) -> dict[str, tuple[int, ...]]:
    """The head's learned parameters and ``mask_hidden`` ``[F]``."""
    width = len(c.feature_layers) * c.target_hidden_size
    return dict(param_shapes(c), mask_hidden=(width,))


PEagleConfig.FAMILY = drafter_family(
    eagle3.forward, peagle_shapes, {**AXES, "mask_hidden": (None,)}
)


@dataclasses.dataclass(frozen=True)
class PEagleDrafter(EagleHead):
    """The drafter of a P-EAGLE head; see the module docstring (the head's state, prefill and
    cache replicas, one forward per step)."""

    @property
    def name(self) -> str:
        return "p-eagle"

    def default_draft_len(self) -> int | None:
        return self.config.block_size

    def propose(self, dec, params, sampling, state):
        c, k, n = self.config, dec.spec.tree.num_chains, dec.spec.num_draft_tokens
        own = state.draft
        rep = lambda a: jnp.repeat(a, k, axis=0)  # noqa: E731
        cache, logits_RTD, _ = _chain(
            c, params, own.cache, fuse(params, rep(own.features)), rep(own.tokens), rep(own.count)
        )
        rows = cache.lengths.shape[0]
        last_R = jnp.maximum(rep(own.count) - 1, 0)[:, None, None]
        laws_RnD = jnp.take_along_axis(logits_RTD, last_R, axis=1)
        if n > 1:  # the pard entries after the pending ones, in the same causal cache
            mask_E = fuse(params, params["mask_hidden"][None, None])[0, 0]
            hidden = jnp.broadcast_to(mask_E, (rows, n - 1, mask_E.shape[-1]))
            pards = jnp.full((rows, n - 1), c.pard_token, jnp.int32)
            count = jnp.full((rows,), n - 1, jnp.int32)
            _, pard_logits, _ = _chain(c, params, cache, hidden, pards, count)
            laws_RnD = jnp.concatenate([laws_RnD, pard_logits], axis=1)
        laws_RnV = eagle3.target_logits(params, laws_RnD, c.vocab_size)

        def feed(carry, token_R, depth):  # no forward: depth's law of the one pass
            del token_R
            return carry, jax.lax.dynamic_slice_in_dim(laws_RnV, depth, 1, axis=1)

        _, drawn = rollout_proposal(dec, sampling, state, feed, None, store_last=False)
        lp = drawn["logprobs_BKDV"]  # an empty law ends the chain before it, as for the head
        empty = ~jnp.any(lp > -jnp.inf, axis=-1) & drawn["finite_BKD"]
        first_empty = jnp.where(jnp.any(empty, -1), jnp.argmax(empty, -1), empty.shape[-1])
        drawn["usable_BK"] = jnp.minimum(drawn["usable_BK"], first_empty.astype(jnp.int32))
        drawn["ok_BKD"] = drawn["ok_BKD"] | empty
        base_R = cache.lengths - rep(own.placeholder).astype(jnp.int32)
        after = dataclasses.replace(own, cache=dataclasses.replace(cache, lengths=base_R))
        return Proposal(**drawn, state=after)


def pard_token(raw: dict, vocab: int, where: str) -> int:
    """The pard token of a P-EAGLE ``config.json`` (checked to be a target token)."""
    token = next((raw[f] for f in TOKEN_FIELDS if raw.get(f) is not None), None)
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
        raise ValueError(
            f"{where}: a P-EAGLE config needs 'pard_token' (or 'ptd_token_id'): a token id in "
            f"[0, {vocab}), got {token!r}"
        )
    return token


def read(folder: Path, raw: dict, target, dtype, where: str) -> tuple[PEagleConfig, dict]:
    """``(config, params)`` of a P-EAGLE folder in the EAGLE-3 layout for ``target``."""
    conf = f"{where}: {eagle3.CONFIG_FILE}"
    if raw.get("speculators_model_type") == "peagle":
        raise ValueError(
            f"{conf}: the speculators' P-EAGLE config (transformer_layer_config) is not read; "
            'give the EAGLE-3 layout with "parallel_drafting": true'
        )
    head = HeadConfig.from_hf(raw, target.config, where=conf)
    steps = raw.get("num_speculative_tokens") or 8
    c = PEagleConfig(
        **{f.name: getattr(head, f.name) for f in dataclasses.fields(head)},
        pard_token=pard_token(raw, head.vocab_size, conf),
        block_size=int(steps),
    )
    eagle3.check_matches(c, target, where, noun="drafter", kind="a P-EAGLE head")
    try:
        tensors = {n.removeprefix("model."): a for n, a in loader.iter_tensors(folder)}
    except loader.CheckpointError as e:
        raise ValueError(f"{where}: {e}") from None
    names = dict(eagle3.TENSORS, mask_hidden="mask_hidden")
    params = {}
    for name, shape in peagle_shapes(c).items():
        a = tensors.get(names[name])
        if a is not None and name == "mask_hidden" and a.size == shape[0]:
            a = a.reshape(shape)
        if a is None or tuple(a.shape) != shape:
            got = "missing" if a is None else f"of shape {list(a.shape)}"
            raise ValueError(
                f"{where}: tensor {names[name]!r} is {got}, the config says {list(shape)}"
            )
        eagle3_checks.check_weight(names[name], a, where)
        params[name] = jnp.asarray(np.asarray(a, np.float32), dtype)
    ids = eagle3_checks.target_ids(tensors, c.draft_vocab_size, c.vocab_size, where)
    params["embed"] = jnp.asarray(np.asarray(target.params["embed"], np.float32), dtype)
    params["d2t"] = jnp.asarray(ids, jnp.int32)
    return c, params


def save(path, config: PEagleConfig, params: dict) -> Path:
    """Write a P-EAGLE head in its layout: the EAGLE-3 files (as :func:`eagle3.save_head` writes
    them) with ``parallel_drafting``, the pard token and ``mask_hidden``; both files replaced only
    once both are written."""
    folder = Path(path)
    host = {k: np.asarray(jax.device_get(v)) for k, v in params.items()}
    tensors = {eagle3.TENSORS[n]: host[n].astype(np.float32) for n in param_shapes(config)}
    ids = host["d2t"].astype(np.int64)
    tensors["d2t"] = ids - np.arange(config.draft_vocab_size, dtype=np.int64)
    t2d = np.zeros(config.vocab_size, bool)
    t2d[ids] = True
    tensors |= {"t2d": t2d, "mask_hidden": host["mask_hidden"].astype(np.float32)}
    return loader.write_checkpoint(
        folder, list(tensors.items()), config.to_hf(), eagle3.WEIGHTS_FILE, eagle3.CONFIG_FILE
    )


__all__ = ["PEagleConfig", "PEagleDrafter", "peagle_shapes", "pard_token", "read", "save"]
