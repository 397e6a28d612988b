"""Training a block drafter (:mod:`asps_jax.drafters.block_model`) against its frozen target.

The target runs inside the jitted train step (online features, as for the EAGLE-3 head:
:func:`asps_jax.drafters.train.target_pass`). Each window of T tokens gives the target's laws and
features at every position; ``anchors`` random positions p per window each stand for a drafting
step whose bonus token is ``x[p]``: the block at p sees the context slots ``< p`` and its entry i
(the token at ``p + 1 + i``) is trained towards the target's law at that position given the
window's text, restricted to the draft vocabulary; a recurrent readout is teacher-forced on the
window's own tokens (depth i's parent is ``x[p + i]``). The loss is ``sum_i w_i KL(target_i ||
block_i) / sum_i w_i`` with ``w_i = decay ** i`` over the N positions (the later ones are reached
less often, so count less), averaged over the anchors.

The optimizer is :func:`asps_jax.drafters.train.optimizer` (AdamW, linear warm-up then cosine
decay, global-norm clipping). :func:`fit` is the resumable loop (``scripts/train_drafter.py
--kind block``): the drafter and the optimizer state are written every ``save_every`` steps, and a
run started again on the same folder resumes where it stopped, drawing the same batches.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from asps_jax.drafters import block_model as bm
from asps_jax.drafters import train

STATE_FILE, LOG_FILE = "train_state.npz", "training.json"


@dataclasses.dataclass(frozen=True)
class BlockTrainConfig(train.TrainConfig):
    """:class:`~asps_jax.drafters.train.TrainConfig` plus the anchors (blocks) per window."""

    anchors: int = 64
    decay: float = 0.9


def sample_anchors(rng: np.random.Generator, batch: int, seq_len: int, block: int, count: int):
    """int32[batch, count]: bonus positions ``p`` in ``[1, seq_len - block]`` (a block's N
    targets inside the window, at least one context position)."""
    if seq_len - block < 1:
        raise ValueError(f"seq_len={seq_len} must exceed the block size {block}")
    return rng.integers(1, seq_len - block + 1, size=(batch, count)).astype(np.int32)


def block_loss(c, config, learned, fixed, target_config, target_params, tokens_BT, anchors_BA):
    """``(loss, metrics)`` of windows ``tokens_BT`` at anchors ``anchors_BA`` (module docstring)."""
    params = {**learned, **fixed}
    B, T = tokens_BT.shape
    N, A = c.block_size, anchors_BA.shape[1]
    logits_BTV, features_BTF = train.target_pass(c, target_config, target_params, tokens_BT)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    ctx = bm.context_kv(c, params, features_BTF, positions)
    ctx_k, ctx_v = jnp.swapaxes(ctx.k, 2, 3), jnp.swapaxes(ctx.v, 2, 3)  # [L, B, KVH, T, H]
    valid_BAS = jnp.arange(T)[None, None, :] < anchors_BA[:, :, None]
    first_BA = jnp.take_along_axis(tokens_BT, anchors_BA, axis=1)
    last_BAE = jnp.take_along_axis(
        bm.context(c, params, features_BTF), anchors_BA[..., None] - 1, 1
    )
    at = (anchors_BA[:, :, None] + jnp.arange(N)[None, None, :]).reshape(
        B, A * N
    )  # the law of x[p + 1 + i], whose parent is x[p + i]
    parents_BAN = jnp.take_along_axis(tokens_BT, at, axis=1).reshape(B, A, N)
    logits_BAND = bm.forward(
        c, params, ctx_k, ctx_v, valid_BAS, last_BAE, first_BA, anchors_BA, parents_BAN
    )
    teacher = jnp.take_along_axis(logits_BTV, at[:, :, None], axis=1)[..., params["d2t"]]
    teacher = jax.nn.log_softmax(teacher.reshape(B, A, N, -1), axis=-1)
    log_q = jax.nn.log_softmax(logits_BAND, axis=-1)
    kl_N = jnp.mean(jnp.sum(jnp.exp(teacher) * (teacher - log_q), axis=-1), axis=(0, 1))
    hit_N = jnp.mean(jnp.argmax(log_q, -1) == jnp.argmax(teacher, -1), axis=(0, 1))
    w_N = config.decay ** jnp.arange(N, dtype=jnp.float32)
    metrics = {f"kl_{i}": kl_N[i] for i in range(N)}
    metrics.update({f"acc_{i}": hit_N[i] for i in range(N)})
    return jnp.sum(w_N * kl_N) / jnp.sum(w_N), metrics


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(3, 4))
def train_step(c, config, target_config, learned, opt_state, fixed, target_params, tokens_BT,
               anchors_BA):  # fmt: skip
    """One optimizer step: ``(learned, opt_state, loss, metrics)``."""
    grad_fn = jax.value_and_grad(block_loss, argnums=2, has_aux=True)
    (loss, metrics), grads = grad_fn(
        c, config, learned, fixed, target_config, target_params, tokens_BT, anchors_BA
    )
    updates, opt_state = train.optimizer(config).update(grads, opt_state, learned)
    return optax.apply_updates(learned, updates), opt_state, loss, metrics


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def eval_step(c, config, target_config, learned, fixed, target_params, tokens_BT, anchors_BA):
    """``(loss, metrics)`` of a batch, no update."""
    return block_loss(c, config, learned, fixed, target_config, target_params, tokens_BT,
                      anchors_BA)  # fmt: skip


def _batch(seed, step: int, ids, config: BlockTrainConfig, block: int):
    """Step ``step``'s windows and anchors, from a generator seeded by ``(seed, step)`` (a resumed
    run draws what the uninterrupted one would have)."""
    rng = np.random.default_rng([seed, step])
    tokens = train.sample_windows(rng, ids, config.batch_size, config.seq_len)
    anchors = sample_anchors(rng, config.batch_size, config.seq_len, block, config.anchors)
    return jnp.asarray(tokens), jnp.asarray(anchors)


def start(out: Path, target, config: BlockTrainConfig, make_config, d2t, seed: int):
    """``(block config, learned, fixed, opt_state, step, log)``: resumed from ``out`` when it
    holds a training state, else fresh (``make_config(len(d2t))``, random weights)."""
    opt = train.optimizer(config)
    if (out / STATE_FILE).is_file():
        where = f"--out {out}"
        c = bm.read_config(out, target.config, where)
        params, _ = bm.read_params(out, c, jnp.float32, where)
        params["embed"] = jnp.asarray(target.params["embed"], jnp.float32)
        learned = bm.trainable(params)
        saved = dict(np.load(out / STATE_FILE))
        step = int(saved.pop("step"))
        opt_state = train.unflat_state(opt.init(learned), saved, str(out / STATE_FILE))
        log = json.loads((out / LOG_FILE).read_text()) if (out / LOG_FILE).is_file() else {}
        return c, learned, {"embed": params["embed"], "d2t": params["d2t"]}, opt_state, step, log
    c = make_config(len(d2t))
    embed = jnp.asarray(target.params["embed"], jnp.float32)
    params = from_target(c, bm.init_params(c, jax.random.key(seed), embed, d2t), target)
    learned = bm.trainable(params)
    fixed = {"embed": params["embed"], "d2t": params["d2t"]}
    return c, learned, fixed, opt.init(learned), 0, {}


def from_target(c, params: dict, target) -> dict:
    """``params`` with the output layer started from the target's own (its final norm, and its
    head's rows of the draft vocabulary) when the widths match: the drafter's output then starts
    in the target's hidden space, as DFlash and EAGLE-3 drafters read the target's head."""
    t = target.params
    head = t.get("lm_head")
    if head is None or t.get("final_norm") is None or c.hidden_size != c.target_hidden_size:
        return params
    head = jnp.asarray(head, jnp.float32)
    rows = head.T if head.shape[0] == c.hidden_size else head  # [V, E] either way
    return dict(
        params,
        lm_head=rows[params["d2t"]],
        norm=jnp.asarray(t["final_norm"], jnp.float32),
    )


def save_state(out: Path, c, learned, fixed, opt_state, step: int) -> None:
    """The drafter and the optimizer state, each file replaced whole."""
    bm.save(out, c, {**learned, **fixed})
    tmp = out / (STATE_FILE + ".tmp.npz")
    np.savez(tmp, step=np.asarray(step), **train.flat_state(opt_state))
    tmp.replace(out / STATE_FILE)


def fit(target, target_params, train_ids, val_ids, out, config: BlockTrainConfig, *, make_config,
        d2t, seed: int = 0, save_every: int = 100, info: dict | None = None) -> int:  # fmt: skip
    """Train (or resume) the block drafter in folder ``out``; the last step. ``info``: what the
    log (``training.json``) records beside the evaluations."""
    out = Path(out)
    c, learned, fixed, opt_state, step, log = start(out, target, config, make_config, d2t, seed)
    log.setdefault("evals", [])
    if step:
        print(f"resuming {out} at step {step} of {config.steps}")
    val = None
    if len(val_ids) >= config.seq_len:
        val = _batch(1, 0, val_ids, dataclasses.replace(config, batch_size=4 * config.batch_size),
                     c.block_size)  # fmt: skip

    def save(step):
        if val is not None:
            loss, m = eval_step(c, config, target.config, learned, fixed, target_params, *val)
            log["evals"].append({"step": step, "loss": float(loss),
                                 **{k: float(v) for k, v in m.items()}})  # fmt: skip
            tqdm.write(f"step {step}: val loss {float(loss):.4f}, accuracy at positions 1 / "
                       f"{c.block_size}: {float(m['acc_0']):.3f} / "
                       f"{float(m[f'acc_{c.block_size - 1}']):.3f}")  # fmt: skip
        log["train_wall_time_s"] = log.get("train_wall_time_s", 0.0) + time.perf_counter() - t0
        save_state(out, c, learned, fixed, opt_state, step)
        (out / LOG_FILE).write_text(json.dumps(dict(log, **(info or {}), step=step), indent=2))

    progress = tqdm(total=config.steps, initial=step, desc="block", unit="step",
                    dynamic_ncols=True)  # fmt: skip
    t0 = time.perf_counter()
    while step < config.steps:
        tokens, anchors = _batch(seed, step, train_ids, config, c.block_size)
        learned, opt_state, loss, m = train_step(
            c, config, target.config, learned, opt_state, fixed, target_params, tokens, anchors
        )
        step += 1
        progress.update(1)
        if step % 10 == 0 or step == config.steps:
            progress.set_postfix(loss=f"{float(loss):.3f}", acc0=f"{float(m['acc_0']):.3f}")
        if step % save_every == 0 or step == config.steps:
            save(step)
            t0 = time.perf_counter()
    progress.close()
    return step
