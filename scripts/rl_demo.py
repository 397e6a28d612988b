"""A GRPO-style RL loop on the bundled Shakespeare pair, on this CPU: exact speculative rollouts
through one long-lived ``asps_jax.Sampler``, a reward, a policy-gradient step with optax, and the
new weights swapped into the sampler with ``update_params`` (no recompile).

Each iteration: every prompt gets ``--group`` samples at temperature 1 (``n``, one seed per
prompt); the reward of a sample is the share of its tokens equal to a goal token (" the" by
default); advantages are the rewards less their group's mean, over the group's standard deviation
(GRPO); the loss is the negative advantage-weighted log-likelihood of the samples under the policy,
read by a teacher-forced forward of the current weights. Its value at the rollout's weights is
checked against the sampler's own ``raw_logprobs`` (the unprocessed law: what the loss needs).

The same rollouts are drawn with several drafters as the policy drifts: a fixed separate draft
(the bundled draft, never retrained: it goes stale), ``self:L`` (the policy's own first layers:
it follows every update) and prompt lookup (no weights), beside our AR; the table gives each
one's tokens per step, draft acceptance and wall time per rollout, and the XLA programs built in
each iteration (0 after the first: new weights never recompile).

Usage: ``python scripts/rl_demo.py`` (about a minute); ``--quick`` runs 3 iterations.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import asps_jax
from asps_jax.models import forward_for
from asps_jax.models.base import prepare_params
from asps_jax.scoring import score_chain

PROMPTS = ["ROMEO:", "JULIET:\nO", "KING HENRY:\nThe", "First Citizen:\nWe"]


def parse_args(argv=None) -> argparse.Namespace:
    first = __doc__.split("\n\n")[0]
    parser = argparse.ArgumentParser(description=first)
    parser.add_argument("--iterations", type=int, default=8, help="RL iterations (default 8).")
    parser.add_argument("--quick", action="store_true", help="Run 3 iterations.")
    parser.add_argument("--group", type=int, default=8, help="Samples per prompt (default 8).")
    parser.add_argument(
        "--max-new-tokens", type=int, default=32, help="Tokens per sample (default 32)."
    )
    parser.add_argument("--goal", default=" the", help='The rewarded token (default " the").')
    parser.add_argument(
        "--learning-rate", type=float, default=1e-3, help="Adam's step size (default 1e-3)."
    )
    parser.add_argument("--seed", type=int, default=0, help="The run's seed (default 0).")
    args = parser.parse_args(argv)
    if args.quick:
        args.iterations = 3
    return args


def sequences(prompts, out):
    """int32[R, T] prompt + sample, its valid mask and the mask of the sampled positions (the
    logits at position t score token t + 1)."""
    lengths = np.asarray(out.lengths)
    tokens = np.asarray(out.tokens)
    width = max(len(p) for p in prompts) + tokens.shape[1]
    seq = np.zeros((len(lengths), width), np.int32)
    valid = np.zeros_like(seq, bool)
    sampled = np.zeros_like(seq, bool)
    for r, prompt in enumerate(prompts):
        n = len(prompt)
        seq[r, :n] = prompt
        seq[r, n : n + lengths[r]] = tokens[r, : lengths[r]]
        valid[r, : n + lengths[r]] = True
        sampled[r, n - 1 : n - 1 + lengths[r]] = True
    return jnp.asarray(seq), jnp.asarray(valid), jnp.asarray(sampled)


def token_logprobs(config, params, seq, valid):
    """float32[R, T]: log p(seq[t + 1] | seq[:t + 1]) under the unprocessed law (teacher forced)."""
    logits, _ = score_chain(forward_for(config), prepare_params(config, params), None, seq, valid)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nxt = jnp.concatenate([seq[:, 1:], seq[:, :1]], axis=1)
    return jnp.take_along_axis(logp, nxt[:, :, None], axis=2)[:, :, 0]


def main(argv=None) -> None:
    args = parse_args(argv)
    target = asps_jax.load_model("tinyshakespeare-target", dtype="float32")
    draft = asps_jax.load_model("tinyshakespeare-draft", dtype="float32")
    tok = target.tokenizer
    goal = tok.encode(args.goal, add_special_tokens=False)
    if len(goal) != 1:
        raise SystemExit(f"--goal {args.goal!r} is {len(goal)} tokens; give one token's text")
    goal = goal[0]
    prompts = [tok.encode(p) for p in PROMPTS]
    rows = [p for p in prompts for _ in range(args.group)]
    common = dict(return_logprobs=True, raw_logprobs=True, temperature=1.0, eos_token_id=-1)
    samplers = {
        "ar": asps_jax.Sampler(target, None, method="ar", **common),
        "separate draft": asps_jax.Sampler(target, draft, num_draft_tokens=4, **common),
        "self:2": asps_jax.Sampler(target, "self:2", num_draft_tokens=4, **common),
        "lookup": asps_jax.Sampler(target, "lookup", num_draft_tokens=4, **common),
    }
    trainer = "self:2"  # the rollouts the policy learns from (every sampler has the same law)
    opt = optax.adam(args.learning_rate)
    params = target.params
    state = opt.init(params)

    @jax.jit
    def update(params, state, seq, valid, sampled, adv):
        def loss(params):
            logp = token_logprobs(target.config, params, seq, valid)
            per_row = jnp.sum(jnp.where(sampled, logp, 0.0), axis=1)
            return -jnp.mean(adv * per_row) / args.max_new_tokens

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    check = jax.jit(lambda p, s, v: token_logprobs(target.config, p, s, v))
    header = "iter  reward  " + "  ".join(f"{n:>22}" for n in samplers) + "  programs built"
    print("each drafter: tokens/step, acceptance, ms per rollout (a warm-up call first)")
    print(header)
    for it in range(args.iterations):
        seeds = [args.seed * 1000 + it * 10 + p for p in range(len(prompts))]
        cells, built = [], []
        for name, sampler in samplers.items():
            before = sampler.compiles
            call = dict(max_new_tokens=args.max_new_tokens, seed=seeds, n=args.group)
            if it == 0:
                sampler(prompts, **call)  # compile (first iteration only), then time
            start = time.perf_counter()
            out = sampler(prompts, **call)
            jax.block_until_ready(out.tokens)
            ms = 1000 * (time.perf_counter() - start)
            built.append(sampler.compiles - before)
            tps = float(np.mean(np.asarray(out.stats["tokens_per_step"])))
            acc = float(np.mean(np.asarray(out.stats["acceptance"])))
            cells.append(
                f"{tps:5.2f} {acc:5.2f} {ms:7.1f} ms"
                if name != "ar"
                else f"{tps:5.2f}  -   {ms:7.1f} ms"
            )
            if name == trainer:
                rollout = out
        tokens = np.asarray(rollout.tokens)
        lengths = np.asarray(rollout.lengths)
        reward = np.array(
            [np.mean(tokens[r, : lengths[r]] == goal) for r in range(len(lengths))], np.float32
        )
        groups = reward.reshape(len(prompts), args.group)
        adv = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, keepdims=True) + 1e-6)
        seq, valid, sampled = sequences(rows, rollout)
        forced = np.asarray(check(params, seq, valid))[np.asarray(sampled)]
        raw = np.concatenate(
            [np.asarray(rollout.raw_logprobs)[r, : lengths[r]] for r in range(len(lengths))]
        )
        gap = float(np.max(np.abs(forced - raw)))
        params, state, _ = update(params, state, seq, valid, sampled, jnp.asarray(adv.reshape(-1)))
        for sampler in samplers.values():
            sampler.update_params(params)
        print(
            f"{it:4d}  {reward.mean():6.3f}  "
            + "  ".join(f"{c:>22}" for c in cells)
            + f"  {sum(built):4d} (teacher-forced vs raw_logprobs: max |diff| {gap:.1e})"
        )


if __name__ == "__main__":
    main()
