"""Train the bundled tiny target/draft Llama pair (and their shared BPE tokenizer) on CPU.

    python scripts/train_tiny.py                    # writes models/tinyshakespeare-{target,draft}/
    python scripts/train_tiny.py --data my.txt --name mytext --out-dir /tmp/models

Steps: a byte-level BPE tokenizer trained on the first 90% of the text; a target Llama of a few
million parameters; a draft about 10x smaller, optionally distilled from the target (KL to the
target's soft labels mixed with the hard loss); both saved as Hugging Face checkpoints with a
``card.json`` (how they were made) and a short ``README.md`` model card. The validation split is the
last 10% of the text by position, never seen by the tokenizer or the models.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shlex
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from asps_jax.models import llama, save_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO_ROOT / "data/tinyshakespeare.txt"
ARCH_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
ARCH_KEYS += ("num_attention_heads", "num_key_value_heads", "tie_word_embeddings")
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2 as in Llama; <unk> doubles as padding


@dataclasses.dataclass(frozen=True)
class Split:
    """Token ids of the corpus, split by position (no shuffling: validation is unseen text)."""

    train: np.ndarray  # int32[~0.9 * tokens]
    val: np.ndarray  # int32[~0.1 * tokens]


# --- Tokenizer and data ------------------------------------------------------------------------


def train_tokenizer(text: str, vocab_size: int, max_len: int):
    """Byte-level BPE (so any text round-trips) wrapped for ``AutoTokenizer.from_pretrained``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer=trainer)
    bos = tok.token_to_id("<s>")
    # Encoding prepends <s> like Llama's tokenizer, so prompts look like the training windows.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<unk>",
        model_max_length=max_len,
    )


def split_text(text: str, val_fraction: float) -> tuple[str, str]:
    """Cut at a line break near ``1 - val_fraction`` of the characters."""
    cut = int(len(text) * (1.0 - val_fraction))
    newline = text.rfind("\n", 0, cut)
    cut = newline + 1 if newline > 0 else cut
    return text[:cut], text[cut:]


def sample_batch(rng: np.random.Generator, ids: np.ndarray, batch: int, seq_len: int, bos: int):
    """Random windows, each led by <s> (the model always sees <s> at position 0, as at inference).

    Returns inputs, labels: int32[B, T] with labels[:, t] the token after inputs[:, t].
    """
    starts = rng.integers(0, len(ids) - seq_len + 1, size=batch)
    chunks = np.stack([ids[s : s + seq_len] for s in starts])  # [B, T]
    bos_col = np.full((batch, 1), bos, np.int32)
    return np.concatenate([bos_col, chunks[:, :-1]], axis=1), chunks


def eval_windows(ids: np.ndarray, seq_len: int, bos: int, max_windows: int | None = None):
    """Non-overlapping windows covering ``ids`` in order (every token predicted once).

    Returns inputs, labels: int32[W, T] and weights float32[W, T] (0 on the padded tail).
    """
    n = -(-len(ids) // seq_len)
    if max_windows is not None:
        n = min(n, max_windows)
    labels = np.zeros((n, seq_len), np.int32)
    weights = np.zeros((n, seq_len), np.float32)
    for w in range(n):
        chunk = ids[w * seq_len : (w + 1) * seq_len]
        labels[w, : len(chunk)] = chunk
        weights[w, : len(chunk)] = 1.0
    inputs = np.concatenate([np.full((n, 1), bos, np.int32), labels[:, :-1]], axis=1)
    return inputs, labels, weights


# --- Losses and the jitted steps ---------------------------------------------------------------


def _logits(config, params, inputs_BT):
    B, T = inputs_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask_BTT = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    logits_BTV, _ = llama.forward(config, params, inputs_BT, positions_BT, mask_BTT, None)
    return logits_BTV


def _nll(logits_BTV, labels_BT):
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32))
    return -jnp.take_along_axis(logp_BTV, labels_BT[..., None], axis=-1)[..., 0], logp_BTV


def _loss(params, config, inputs_BT, labels_BT, teacher_logp_BTV, distill_weight):
    nll_BT, logp_BTV = _nll(_logits(config, params, inputs_BT), labels_BT)
    hard = jnp.mean(nll_BT)
    if teacher_logp_BTV is None:
        return hard, hard
    # KL(target || draft): the draft learns the target's whole law, not just the sampled token,
    # which is what the acceptance rate sum_v min(p, q) rewards.
    p_BTV = jnp.exp(teacher_logp_BTV)
    kl = jnp.mean(jnp.sum(p_BTV * (teacher_logp_BTV - logp_BTV), axis=-1))
    return (1.0 - distill_weight) * hard + distill_weight * kl, hard


def make_train_step(config, optimizer, teacher_config=None, distill_weight=0.0):
    """One jitted optimizer step; params and optimizer state are donated (updated in place)."""

    def step(params, opt_state, inputs_BT, labels_BT, teacher_params):
        teacher_logp = None
        if teacher_config is not None:
            # Outside _loss, so no gradient reaches the teacher.
            teacher_logp = jax.nn.log_softmax(_logits(teacher_config, teacher_params, inputs_BT))
        grads, hard = jax.grad(_loss, has_aux=True)(
            params, config, inputs_BT, labels_BT, teacher_logp, distill_weight
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, hard

    return jax.jit(step, donate_argnums=(0, 1))


@functools.partial(jax.jit, static_argnums=0)
def _eval_chunk(config, params, inputs_BT, labels_BT, weights_BT):
    nll_BT, _ = _nll(_logits(config, params, inputs_BT), labels_BT)
    return jnp.sum(nll_BT * weights_BT)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _overlap_chunk(target_config, target_params, draft_config, draft_params, inputs_BT, w_BT):
    p_BTV = jax.nn.softmax(_logits(target_config, target_params, inputs_BT).astype(jnp.float32))
    q_BTV = jax.nn.softmax(_logits(draft_config, draft_params, inputs_BT).astype(jnp.float32))
    return jnp.sum(jnp.sum(jnp.minimum(p_BTV, q_BTV), axis=-1) * w_BT)


def _mean_over_windows(chunk_fn, windows, batch: int) -> float:
    """Sum ``chunk_fn(inputs, labels, weights)`` over chunks of ``batch`` windows / token count.

    The window count is padded to a multiple of ``batch`` with zero-weight rows: one compiled shape.
    """
    pad = -len(windows[0]) % batch
    inputs, labels, weights = (np.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in windows)
    chunks = (slice(i, i + batch) for i in range(0, len(inputs), batch))
    total = sum(float(chunk_fn(inputs[c], labels[c], weights[c])) for c in chunks)
    return total / float(weights.sum())


def evaluate(config, params, windows, batch: int) -> float:
    """Mean cross-entropy per token (nats) over the windows."""
    return _mean_over_windows(functools.partial(_eval_chunk, config, params), windows, batch)


def acceptance_proxy(target, draft, windows, batch: int) -> float:
    """Mean of sum_v min(p, q) = 1 - TV(p, q) at temperature 1: SpS's per-token acceptance rate."""
    return _mean_over_windows(lambda x, _, w: _overlap_chunk(*target, *draft, x, w), windows, batch)


# --- Training ----------------------------------------------------------------------------------


def make_config(args, role: str, vocab_size: int, tokenizer):
    """A LlamaConfig from the ``--{role}-*`` flags (head_dim = hidden / heads)."""
    hidden, heads = getattr(args, f"{role}_hidden"), getattr(args, f"{role}_heads")
    return llama.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=getattr(args, f"{role}_intermediate"),
        num_hidden_layers=getattr(args, f"{role}_layers"),
        num_attention_heads=heads,
        num_key_value_heads=getattr(args, f"{role}_kv_heads"),
        head_dim=hidden // heads,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=bool(getattr(args, f"{role}_tie")),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def make_optimizer(args, steps: int):
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(args.warmup, max(steps - 1, 1)), steps, end_value=0.1 * args.lr
    )
    # No weight decay on the RMSNorm scales (1-D leaves): decaying them towards 0 fights the norm.
    decay_mask = functools.partial(jax.tree.map, lambda x: x.ndim >= 2)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay, mask=decay_mask),
    )


def train_model(args, label, config, split, bos, key, teacher=None, distill_weight=0.0):
    """Train from init; returns (params, training wall seconds). Logs losses every --eval-every."""
    role = label.split("-")[0]
    steps = getattr(args, f"{role}_steps")
    rng = _rng(args, 0 if role == "target" else 1)  # each draft variant sees the same batches
    params = llama.init_params(config, key, jnp.float32)
    optimizer = make_optimizer(args, steps)
    opt_state = optimizer.init(params)
    teacher_config, teacher_params = teacher if teacher is not None else (None, None)
    step_fn = make_train_step(config, optimizer, teacher_config, distill_weight)
    val_windows = eval_windows(split.val, args.seq_len, bos, args.eval_batches * args.batch_size)
    start, hard_losses = time.perf_counter(), []
    progress = tqdm(
        total=steps,
        desc=label,
        unit="step",
        file=sys.stderr,
        delay=2.0,  # short runs show no bar
        disable=not sys.stderr.isatty(),
    )
    for step in range(1, steps + 1):
        inputs, labels = sample_batch(rng, split.train, args.batch_size, args.seq_len, bos)
        params, opt_state, hard = step_fn(params, opt_state, inputs, labels, teacher_params)
        hard_losses.append(hard)
        progress.update()
        if step % args.eval_every == 0 or step == steps:
            train_loss = float(np.mean(jax.device_get(hard_losses)))
            val_loss = evaluate(config, params, val_windows, args.batch_size)
            hard_losses = []
            _log(
                f"[{label}] step {step:5d}/{steps}  train {_fmt(train_loss)}  "
                f"val {_fmt(val_loss)}  ({time.perf_counter() - start:.0f} s)"
            )
    progress.close()
    return params, time.perf_counter() - start


def final_metrics(args, config, params, split, bos) -> dict:
    """Train loss on random training windows and val loss on the whole validation split."""
    rng = _rng(args, 2)  # the same training windows for both models
    val = eval_windows(split.val, args.seq_len, bos)
    n_train = min(len(val[0]), max(len(split.train) // args.seq_len, 1))
    starts = np.sort(rng.choice(len(split.train) // args.seq_len, n_train, replace=False))
    T = args.seq_len
    train_ids = np.concatenate([split.train[s * T : (s + 1) * T] for s in starts])
    train = eval_windows(train_ids, args.seq_len, bos)
    train_loss = evaluate(config, params, train, args.batch_size)
    val_loss = evaluate(config, params, val, args.batch_size)
    return {
        "train_loss": round(train_loss, 4),
        "train_perplexity": round(float(np.exp(train_loss)), 2),
        "val_loss": round(val_loss, 4),
        "val_perplexity": round(float(np.exp(val_loss)), 2),
        "val_tokens": int(val[2].sum()),
    }


def _fmt(loss: float) -> str:
    return f"{loss:.3f} (ppl {np.exp(loss):7.2f})"


def _log(msg: str) -> None:
    tqdm.write(msg, file=sys.stdout)  # above a progress bar, if one is showing


def num_params(params) -> int:
    return int(sum(x.size for x in jax.tree.leaves(params)))


# --- Writing the checkpoints -------------------------------------------------------------------

CARD_README = """# {alias}

A tiny Llama-architecture {role} model: {parameters:,} parameters, {layers} layers, hidden {hidden}.
Trained from scratch on `{data_path}` by `scripts/train_tiny.py`
for asps_jax's demo and tests. Its {other} is `{other_alias}`; both share one tokenizer.
A toy for demos, not a useful model.

- Made by: `{command}`
- Training: {steps} steps of {batch_size} x {seq_len} tokens, AdamW,
  {train_wall_time_s:.0f} s on CPU{distill}.
- Loss (nats per token): train {train_loss:.3f}, validation {val_loss:.3f} (perplexity
  {val_perplexity:.1f}) on the tail of the text ({val_tokens} tokens) that neither the tokenizer
  nor the models saw.
- Weights: {dtype}, Hugging Face layout. Load with `asps_jax.load_model("{alias}")` or
  `transformers.AutoModelForCausalLM.from_pretrained("models/{alias}")`.

See `card.json` for the exact figures.
"""


def write_model(out_dir: Path, card: dict, config, params, tokenizer, dtype: str) -> None:
    """HF checkpoint (config, safetensors, tokenizer) + card.json + README.md in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_checkpoint(out_dir, config, jax.tree.map(lambda x: x.astype(dtype), params), tokenizer)
    (out_dir / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    made = card["made_by"]
    w = made["distill_weight"]
    text = CARD_README.format(
        **card,
        **card["metrics"],
        **made,
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        data_path=made["data"]["path"],
        other=card["pair"]["role"],
        other_alias=card["pair"]["alias"],
        distill=f", distilled from the target (KL weight {w:g})" if w else "",
    )
    (out_dir / "README.md").write_text(text)


# --- Command line ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="training text file (UTF-8)")
    p.add_argument("--out-dir", type=Path, default=REPO_ROOT / "models", help="where to write")
    p.add_argument("--name", default="tinyshakespeare", help="writes NAME-target/, NAME-draft/")
    p.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary incl. specials")
    p.add_argument("--seq-len", type=int, default=256, help="context length (tokens, incl. <s>)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per optimizer step")
    p.add_argument("--val-fraction", type=float, default=0.1, help="held-out tail of the text")
    p.add_argument("--seed", type=int, default=0, help="seeds init and batch order")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps (then cosine)")
    p.add_argument("--weight-decay", type=float, default=0.05, help="AdamW decay of matrices")
    p.add_argument("--eval-every", type=int, default=50, help="steps between loss reports")
    p.add_argument("--eval-batches", type=int, default=6, help="val batches per periodic report")
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="dtype of the saved weights (training is always float32)",
    )
    p.add_argument(
        "--distill-weight",
        type=float,
        default=0.5,
        help="draft loss = (1-w) * CE + w * KL(target || draft); 0 trains on text only",
    )
    p.add_argument(
        "--compare-distill",
        action="store_true",
        help="also train the draft with the other choice (w=0 or --distill-weight), "
        "report both acceptance proxies and keep the better draft",
    )
    for role, d in {"target": (192, 4, 4, 2, 512, False, 200),
                    "draft": (64, 2, 2, 1, 172, True, 250)}.items():  # fmt: skip
        p.add_argument(f"--{role}-hidden", type=int, default=d[0], help=f"{role} hidden size E")
        p.add_argument(f"--{role}-layers", type=int, default=d[1], help=f"{role} layers L")
        p.add_argument(f"--{role}-heads", type=int, default=d[2], help=f"{role} query heads")
        p.add_argument(f"--{role}-kv-heads", type=int, default=d[3], help=f"{role} KV heads")
        p.add_argument(f"--{role}-intermediate", type=int, default=d[4], help=f"{role} MLP F")
        p.add_argument(
            f"--{role}-tie",
            action=argparse.BooleanOptionalAction,
            default=d[5],
            help=f"{role}: tie the output head to the embedding",
        )
        p.add_argument(f"--{role}-steps", type=int, default=d[6], help=f"{role} optimizer steps")
    return p


def check_args(p: argparse.ArgumentParser, args) -> None:
    """Reject bad flags with a one-line message naming the flag (argparse exits with status 2)."""
    if not args.data.is_file():
        p.error(f"--data: no such file: {args.data}")
    ints = ["seq_len", "batch_size", "eval_every", "eval_batches"]
    for role in ("target", "draft"):
        ints += [f"{role}_{k}" for k in ("hidden", "layers", "heads", "kv_heads", "intermediate")]
        ints.append(f"{role}_steps")
        hidden, heads = getattr(args, f"{role}_hidden"), getattr(args, f"{role}_heads")
        if hidden % max(heads, 1) or heads % max(getattr(args, f"{role}_kv_heads"), 1):
            p.error(f"--{role}-heads must divide --{role}-hidden and be a multiple of "
                    f"--{role}-kv-heads")  # fmt: skip
    for name in ints:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.vocab_size < 256 + len(SPECIAL_TOKENS):
        p.error(f"--vocab-size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + specials)")
    if args.seq_len < 2:
        p.error("--seq-len must be >= 2")
    if not 0.0 < args.val_fraction < 1.0:
        p.error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    if not 0.0 <= args.distill_weight <= 1.0:
        p.error(f"--distill-weight must be in [0, 1], got {args.distill_weight}")
    if args.lr <= 0.0:
        p.error(f"--lr must be > 0, got {args.lr}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    start, cpu_start = time.perf_counter(), time.process_time()

    # --- Step 1: tokenizer on the training text only; token ids of both splits --------------
    text = args.data.read_text(encoding="utf-8")
    train_text, val_text = split_text(text, args.val_fraction)
    tokenizer = train_tokenizer(train_text, args.vocab_size, args.seq_len)

    def encode(t):  # the backend skips transformers' "longer than max length" warning
        return np.asarray(tokenizer.backend_tokenizer.encode(t, add_special_tokens=False).ids)

    split = Split(encode(train_text).astype(np.int32), encode(val_text).astype(np.int32))
    if min(len(split.train), len(split.val)) < args.seq_len:
        parser.error(f"--data: too short for --seq-len {args.seq_len} windows in both splits")
    bos, vocab = tokenizer.bos_token_id, len(tokenizer)
    _log(f"tokenizer: {vocab} tokens; {len(split.train)} train / {len(split.val)} val tokens")

    # --- Step 2: target, then draft (optionally distilled from the target) --------------------
    key = jax.random.key(args.seed)
    cfg = {r: make_config(args, r, vocab, tokenizer) for r in ("target", "draft")}
    target = train_model(args, "target", cfg["target"], split, bos, jax.random.fold_in(key, 0))
    val = eval_windows(split.val, args.seq_len, bos)
    weights = [args.distill_weight]
    if args.compare_distill:
        weights.append(0.0 if args.distill_weight > 0 else 0.5)
    drafts = []
    for w in weights:
        teacher = (cfg["target"], target[0]) if w > 0 else None
        label, draft_key = f"draft-w{w:g}", jax.random.fold_in(key, 1)
        params, wall = train_model(args, label, cfg["draft"], split, bos, draft_key, teacher, w)
        pair = (cfg["target"], target[0]), (cfg["draft"], params)
        accept = acceptance_proxy(*pair, val, args.batch_size)
        _log(f"[{label}] acceptance proxy 1 - TV(p, q) on val: {accept:.4f}")
        drafts.append((accept, w, params, wall))
    accept, weight, *draft = max(drafts, key=lambda d: d[0])
    final = {"target": target[0], "draft": draft[0]}
    metrics = {r: final_metrics(args, cfg[r], p, split, bos) for r, p in final.items()}
    metrics["draft"]["acceptance_proxy_vs_target"] = round(accept, 4)
    if len(drafts) > 1:
        by_weight = {f"{w:g}": round(a, 4) for a, w, _, _ in drafts}
        metrics["draft"]["acceptance_proxy_by_distill_weight"] = by_weight

    # --- Step 3: checkpoints and cards ---------------------------------------------------------
    made = {
        "command": shlex.join(["python", "scripts/train_tiny.py", *argv]),
        "data": _data_info(args.data, text),
        "seed": args.seed,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "learning_rate": args.lr,
        "total_wall_time_s": round(time.perf_counter() - start, 1),
        # CPU seconds of all threads: the machine-load-independent cost (wall time on a shared
        # machine stretches with the other processes' load).
        "total_cpu_time_s": round(time.process_time() - cpu_start, 1),
        "cpus": os.cpu_count(),
        "jax": jax.__version__,
    }
    names = {r: f"{args.name}-{r}" for r in ("target", "draft")}
    runs = {
        "target": (*target, 0.0, args.target_steps),
        "draft": (*draft, weight, args.draft_steps),
    }
    for role, (params, wall, w, steps) in runs.items():
        other = "draft" if role == "target" else "target"
        card = {
            "alias": names[role],
            "role": role,
            "parameters": num_params(params),
            "dtype": args.dtype,
            "pair": {"role": other, "alias": names[other]},
            # Checked by the loader against config.json (asps_jax.models.cards.check_card).
            "architecture": {k: v for k, v in cfg[role].to_hf().items() if k in ARCH_KEYS},
            "made_by": {**made, "steps": steps, "train_wall_time_s": round(wall, 1)},
            "metrics": metrics[role],
        }
        card["made_by"]["distill_weight"] = w
        write_model(args.out_dir / names[role], card, cfg[role], params, tokenizer, args.dtype)
        _log(f"wrote {args.out_dir / names[role]}: {card['parameters']:,} parameters")
    cpu = time.process_time() - cpu_start
    _log(f"done in {time.perf_counter() - start:.0f} s wall, {cpu:.0f} s CPU")
    return 0


def _rng(args, stream: int) -> np.random.Generator:
    return np.random.default_rng([args.seed, stream])


def _data_info(path: Path, text: str) -> dict:
    import hashlib

    return {
        "path": os.path.relpath(path.resolve(), REPO_ROOT),
        "characters": len(text),
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
    }


if __name__ == "__main__":
    sys.exit(main())
