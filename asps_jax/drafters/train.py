"""Training a learned head (:mod:`asps_jax.drafters.head`) against its frozen target, with optax.

The target runs inside the jitted train step (online features: no feature dump on disk). Each
window of ``T`` tokens gives the target's laws and its features at every position; the head is
then trained by *training-time test* (EAGLE-3): step 0 reads the target's features, step j >= 1
its own output hidden vectors of step j - 1 (shifted one position), as when it drafts depth j.
At step j the entry at position p stands for depth j of the chain that left the committed text
at position ``s = p - j``: it attends to step 0's entries at positions ``<= s`` and to step i's
entry at position ``s + i`` (``0 < i <= j``), exactly the keys it sees when drafting. Entry p
reads token ``x[p + 1]`` and is trained towards the target's law of ``x[p + 2]`` restricted to
the draft vocabulary: the loss is the cross-entropy (KL up to a constant) from that law to the
head's, weighted ``decay ** j`` over the ``k`` steps.

The optimizer is AdamW with a linear warm-up and cosine decay, and global-norm clipping. The
vocabulary map is the ``V_d`` most frequent target tokens of the corpus (:func:`vocab_map`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from asps_jax import kv_cache
from asps_jax.drafters import head as head_lib
from asps_jax.models import forward_for


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The static settings of a training run (hashable: the step is jitted per config)."""

    steps: int = 300
    batch_size: int = 8
    seq_len: int = 128
    learning_rate: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.01
    clip: float = 1.0
    ttt_steps: int = 3  # k: the depths trained (EAGLE-3 uses up to 7)
    decay: float = 0.8  # the weight of depth j is decay ** j


def vocab_map(ids: np.ndarray, vocab_size: int, draft_vocab_size: int) -> np.ndarray:
    """int32[V_d]: the ``draft_vocab_size`` most frequent target ids of ``ids`` (ties to the
    lower id, tokens never seen after every seen one), in increasing id order."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(
            f"draft_vocab_size must be in [1, {vocab_size}] (the target's vocabulary), got "
            f"{draft_vocab_size}"
        )
    counts = np.bincount(np.asarray(ids, np.int64).reshape(-1), minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts[:vocab_size]))
    return np.sort(order[:draft_vocab_size]).astype(np.int32)


def optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """AdamW, linear warm-up then cosine decay to 10 %, global-norm clipping."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        config.learning_rate,
        max(min(config.warmup, config.steps - 1), 1),
        max(config.steps, 2),
        end_value=0.1 * config.learning_rate,
    )
    return optax.chain(
        optax.clip_by_global_norm(config.clip),
        optax.adamw(schedule, weight_decay=config.weight_decay),
    )


def _step_mask(width: int, step: int) -> jax.Array:
    """bool[W, (step + 1) * W]: step ``step``'s entries over the keys of steps 0 .. step."""
    p = jnp.arange(width)[:, None]
    q = jnp.arange(width)[None, :]
    if step == 0:
        return q <= p
    blocks = [q <= p - step]  # step 0: the committed text of the chain
    blocks += [q == p - step + i for i in range(1, step)]  # the chain's own earlier depths
    blocks.append(q == p)
    return jnp.concatenate(blocks, axis=1)


def target_pass(head_config, target_config, target_params, tokens_BT):
    """The frozen target over windows ``tokens_BT``: ``(logits float32[B, T, V], features
    float[B, T, F])`` (no gradient flows into it)."""
    B, T = tokens_BT.shape
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    forward = forward_for(target_config, head_config.feature_layers)
    out = forward(target_params, tokens_BT, positions, causal, None)
    return jax.lax.stop_gradient(out.logits), jax.lax.stop_gradient(out.features)


def ttt_logits(head_config, params, features_BTF, tokens_BT, steps: int) -> list[jax.Array]:
    """The head's draft logits of every training-time-test step: ``steps`` arrays float32[B, W,
    V_d], W = T - 2; step j's entry p reads token ``x[p + 1]`` and stands for depth j of the
    chain that left the committed text at ``p - j`` (its law of ``x[p + 2]``; entries with
    ``p < j`` are padding)."""
    B, T = tokens_BT.shape
    W = T - 2
    tokens_BW = tokens_BT[:, 1 : W + 1]
    positions_BW = jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32), (B, W))
    hidden = head_lib.fuse(params, features_BTF[:, :W])
    keys, values, out_logits = [], [], []
    for j in range(steps):
        mask = jnp.broadcast_to(_step_mask(W, j), (B, W, (j + 1) * W))
        cache = None
        if keys:
            cache = kv_cache.KVCache(
                k=jnp.concatenate(keys, axis=2)[None],
                v=jnp.concatenate(values, axis=2)[None],
                lengths=jnp.full((B,), j * W, jnp.int32),
            )
        step = head_lib.forward(head_config, params, hidden, tokens_BW, positions_BW, mask, cache)
        logits_BWD, out, new_kv = step.logits, step.features, step.kv
        keys.append(jnp.swapaxes(new_kv.k[0], 1, 2))  # [B, KVH, W, H]
        values.append(jnp.swapaxes(new_kv.v[0], 1, 2))
        out_logits.append(logits_BWD)
        # Depth j + 1 at position p reads depth j's output at p - 1.
        hidden = jnp.concatenate([jnp.zeros_like(out[:, :1]), out[:, :-1]], axis=1)
    return out_logits


def ttt_loss(head_config, config: TrainConfig, learned, fixed, target_config, target_params,
             tokens_BT):  # fmt: skip
    """``(loss, metrics)`` of one batch of windows ``tokens_BT`` (see the module docstring);
    ``learned`` / ``fixed``: the head's trained parameters and its ``embed`` / ``d2t``."""
    params = {**learned, **fixed}
    B, T = tokens_BT.shape
    W = T - 2  # entries p = 0 .. T - 3: token x[p + 1], the target's law of x[p + 2]
    logits_BTV, features_BTF = target_pass(head_config, target_config, target_params, tokens_BT)
    teacher_BWD = jax.nn.log_softmax(logits_BTV[:, 1 : W + 1][..., params["d2t"]], axis=-1)
    p_teacher = jnp.exp(teacher_BWD)
    steps = ttt_logits(head_config, params, features_BTF, tokens_BT, config.ttt_steps)
    loss, weights, metrics = 0.0, 0.0, {}
    for j, logits_BWD in enumerate(steps):
        valid_W = (jnp.arange(W) >= j).astype(jnp.float32)[None, :]  # its chain starts at p - j
        log_q = jax.nn.log_softmax(logits_BWD, axis=-1)
        kl_BW = jnp.sum(p_teacher * (teacher_BWD - log_q), axis=-1)
        per_step = jnp.sum(kl_BW * valid_W) / (B * jnp.sum(valid_W))
        loss = loss + config.decay**j * per_step
        weights += config.decay**j
        hit = jnp.argmax(log_q, -1) == jnp.argmax(teacher_BWD, -1)
        metrics[f"kl_{j}"] = per_step
        metrics[f"acc_{j}"] = jnp.sum(hit * valid_W) / (B * jnp.sum(valid_W))
    return loss / weights, metrics


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(3, 4))
def train_step(head_config, config, target_config, learned, opt_state, fixed, target_params,
               tokens_BT):  # fmt: skip
    """One optimizer step: ``(learned, opt_state, loss, metrics)``."""
    grad_fn = jax.value_and_grad(ttt_loss, argnums=2, has_aux=True)
    (loss, metrics), grads = grad_fn(
        head_config, config, learned, fixed, target_config, target_params, tokens_BT
    )
    updates, opt_state = optimizer(config).update(grads, opt_state, learned)
    return optax.apply_updates(learned, updates), opt_state, loss, metrics


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def eval_step(head_config, config, target_config, learned, fixed, target_params, tokens_BT):
    """``(loss, metrics)`` of a batch, no update."""
    return ttt_loss(head_config, config, learned, fixed, target_config, target_params, tokens_BT)


def sample_windows(rng: np.random.Generator, ids: np.ndarray, batch: int, seq_len: int):
    """int32[batch, seq_len]: windows of ``ids`` at random offsets."""
    if len(ids) < seq_len:
        raise ValueError(
            f"the corpus has {len(ids)} tokens, fewer than one window of seq_len={seq_len}"
        )
    starts = rng.integers(0, len(ids) - seq_len + 1, size=batch)
    return np.stack([ids[s : s + seq_len] for s in starts]).astype(np.int32)


def flat_state(tree) -> dict[str, np.ndarray]:
    """A pytree's leaves as ``{"0": ..., "1": ...}`` host arrays (its structure is rebuilt
    from a fresh optimizer state on resume: :func:`unflat_state`)."""
    return {str(i): np.asarray(jax.device_get(a)) for i, a in enumerate(jax.tree.leaves(tree))}


def unflat_state(like, flat: dict[str, np.ndarray], what: str):
    """``flat`` (from :func:`flat_state`) in the structure of ``like``; a one-line error when
    the saved state does not fit it (another head size, another optimizer)."""
    leaves, treedef = jax.tree.flatten(like)
    if len(flat) != len(leaves):
        raise ValueError(f"{what}: {len(flat)} saved arrays, this run's state has {len(leaves)}")
    out = []
    for i, leaf in enumerate(leaves):
        a = flat[str(i)]
        if a.shape != tuple(leaf.shape):
            raise ValueError(
                f"{what}: saved array {i} has shape {a.shape}, this run's {tuple(leaf.shape)}"
            )
        out.append(jnp.asarray(a, leaf.dtype))
    return jax.tree.unflatten(treedef, out)
