"""Training a learned head (asps_jax/drafters/train.py, scripts/train_drafter.py).

References: the drafting path itself (training-time test must give, at step j, exactly the law the
head drafts depth j with: fed one entry at a time through its cache), collections.Counter for the
vocabulary map, and the script's own uninterrupted run for resuming.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asps_jax import kv_cache
from asps_jax.drafters import head as head_lib
from asps_jax.drafters import train
from asps_jax.models import LlamaConfig
from asps_jax.models.llama import init_params as llama_init

ROOT = Path(__file__).resolve().parents[1]
TARGET = LlamaConfig(
    vocab_size=24, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
    num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
)  # fmt: skip


@pytest.fixture(scope="module")
def tiny():
    """(target params, head config, head params): a random 3-layer target and a random head
    over a draft vocabulary of 20 of its 24 tokens."""
    target = llama_init(TARGET, jax.random.key(0))
    config = head_lib.HeadConfig.for_target(TARGET, draft_vocab_size=20, layers=(0, 1, 3))
    d2t = np.sort(np.random.default_rng(0).choice(24, 20, replace=False))
    params = head_lib.init_params(config, jax.random.key(1), target["embed"], d2t, std=0.3)
    return target, config, params


def test_vocab_map_takes_the_most_frequent_tokens():
    rng = np.random.default_rng(3)
    ids = rng.zipf(1.5, 5000) % 50
    got = train.vocab_map(ids, 50, 12)
    counts = collections.Counter(ids.tolist())
    ranked = sorted(range(50), key=lambda t: (-counts.get(t, 0), t))  # ties to the lower id
    assert got.tolist() == sorted(ranked[:12])
    with pytest.raises(ValueError, match="draft_vocab_size must be in"):
        train.vocab_map(ids, 50, 51)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _drafted(config, params, features_TF, tokens_T, depth: int):
    """What the head drafts at depths 0 .. ``depth`` after each committed position s (one row
    per s), fed as in decoding (``head._chain``, the drafter's own feed): entries 0 .. s (the
    target's features, the next token) as one chain through an empty cache, then one entry per
    depth reading its own hidden output. ``[depth + 1]`` arrays float32[W, V_d]."""
    W = tokens_T.shape[0] - 2
    starts = jnp.arange(W)
    cache = kv_cache.init_cache(config, W, 32, jnp.float32)
    hidden = jnp.broadcast_to(
        head_lib.fuse(params, features_TF[None, :W]), (W, W, config.hidden_size)
    )
    tokens = jnp.broadcast_to(tokens_T[1 : W + 1], (W, W))
    cache, logits, out = head_lib._chain(config, params, cache, hidden, tokens, starts + 1)
    drafted, last = [logits[starts, starts]], out[starts, starts]
    for j in range(1, depth + 1):
        token = tokens_T[jnp.minimum(starts + j + 1, tokens_T.shape[0] - 1)]
        cache, logits, out = head_lib._chain(
            config, params, cache, last[:, None], token[:, None], jnp.ones((W,), jnp.int32)
        )
        drafted.append(logits[:, 0])
        last = out[:, 0]
    return drafted


@pytest.mark.slow
def test_training_time_test_is_what_the_head_drafts(tiny):
    """Step j's logits at entry p (training, all positions at once) equal the logits the head
    drafts at depth j after committed position p - j, fed entry by entry through its cache: the
    training masks and shifts are exactly the drafting's."""
    target, config, params = tiny
    tokens = jax.random.randint(jax.random.key(2), (1, 12), 0, 24)
    _, features = jax.jit(train.target_pass, static_argnums=(0, 1))(config, TARGET, target, tokens)
    steps = jax.jit(train.ttt_logits, static_argnums=(0, 4))(config, params, features, tokens, 3)
    drafted = _drafted(config, params, features[0], tokens[0], 2)
    W = tokens.shape[1] - 2
    for j in range(3):
        got = np.asarray(steps[j][0, j:])  # entries p = j .. W - 1
        np.testing.assert_allclose(got, np.asarray(drafted[j][: W - j]), atol=2e-5, err_msg=j)


@pytest.mark.slow
def test_training_reduces_the_loss(tiny):
    """A few optimizer steps on a fixed batch cut the KL by more than half, and the target's
    weights are not touched."""
    target, config, params = tiny
    settings = train.TrainConfig(steps=20, learning_rate=1e-2, warmup=2, ttt_steps=2)
    tokens = jax.random.randint(jax.random.key(4), (4, 16), 0, 24)
    learned = head_lib.trainable(params)
    fixed = {"embed": params["embed"], "d2t": params["d2t"]}
    state = train.optimizer(settings).init(learned)
    before = jax.tree.map(np.asarray, target)
    losses = []
    for _ in range(20):
        learned, state, loss, metrics = train.train_step(
            config, settings, TARGET, learned, state, fixed, target, tokens
        )
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0], losses
    assert set(metrics) == {"kl_0", "kl_1", "acc_0", "acc_1"}
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, target))


def _script():
    spec = importlib.util.spec_from_file_location(
        "train_drafter", ROOT / "scripts/train_drafter.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(corpus, out, steps=6):
    return [
        "--data", str(corpus), "--out", str(out), "--steps", str(steps), "--seq-len", "24",
        "--batch-size", "2", "--save-every", "3", "--draft-vocab", "300", "--val-fraction", "0.2",
        "--ttt-steps", "2",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    text = (ROOT / "data/tinyshakespeare.txt").read_text()[:6000]
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("\n".join(json.dumps({"text": p}) for p in text.split("\n\n")) + "\n")
    return path


@pytest.mark.slow
def test_script_resumes_where_it_stopped(corpus, tmp_path, monkeypatch, capsys):
    """A run stopped after its step-3 checkpoint and started again with the same --out ends
    with the weights of the uninterrupted run (the same windows, optimizer state and step); the
    head it writes loads for the bundled target and validation figures are logged."""
    script = _script()
    assert script.main(_args(corpus, tmp_path / "straight")) == 0
    real_step, calls = train.train_step, []

    def stop_after_three(*args):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(1)
        return real_step(*args)

    monkeypatch.setattr(train, "train_step", stop_after_three)
    with pytest.raises(KeyboardInterrupt):
        script.main(_args(corpus, tmp_path / "resumed"))
    monkeypatch.setattr(train, "train_step", real_step)
    assert json.loads((tmp_path / "resumed/training.json").read_text())["step"] == 3
    assert script.main(_args(corpus, tmp_path / "resumed")) == 0
    assert "resuming" in capsys.readouterr().out
    from safetensors.numpy import load_file

    a = load_file(tmp_path / "straight/model.safetensors")
    b = load_file(tmp_path / "resumed/model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-7, err_msg=name)
    log = json.loads((tmp_path / "straight/training.json").read_text())
    assert [e["step"] for e in log["evals"]] == [3, 6] and log["tokens"]["val"] > 0
    config = json.loads((tmp_path / "straight/config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 300


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--seq-len", "2"], "--seq-len must be >= 4"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--lr", "2"], "--lr must be in"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(corpus, tmp_path, capsys, extra, match):
    with pytest.raises(SystemExit) as e:
        _script().main(_args(corpus, tmp_path / "h") + extra)
    assert e.value.code == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize(
    "content, suffix, match",
    [
        (None, ".txt", "no such file"),
        (b"\xff\xfe", ".txt", "not UTF-8"),
        (b'{"text": "a"}\nnot json\n', ".jsonl", "line 2 is not JSON"),
        (b'{"body": "a"}\n', ".jsonl", 'line 1 has no "text"'),
        (b"to be", ".txt", "fewer than one window"),
    ],
)
def test_bad_corpus_is_one_line(tmp_path, content, suffix, match):
    path = tmp_path / f"corpus{suffix}"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        _script().main(_args(path, tmp_path / "h"))
    assert match in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "h").exists()  # nothing written
