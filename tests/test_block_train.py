"""Training a block drafter (asps_jax/drafters/block_train.py, scripts/train_drafter.py --kind
block).

References: the drafter's own forward at inference (the training loss must read, for an anchor p,
exactly the block the drafter runs after committing positions < p), the script's own
uninterrupted run for resuming, and the flags' documented bounds.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train_drafter import TARGET, _script, corpus  # noqa: F401 (a fixture)

from asps_jax.drafters import block_model as bm
from asps_jax.drafters import block_train, train
from asps_jax.models.llama import init_params as llama_init


@pytest.fixture(scope="module")
def tiny():
    """(target params, block config, block params): a random 3-layer target and a random block
    drafter of 4 positions over 20 of its 24 tokens."""
    target = llama_init(TARGET, jax.random.key(0))
    config = bm.BlockConfig.for_target(
        TARGET, draft_vocab_size=20, layers=(0, 1, 2), block_size=4, num_layers=2
    )
    d2t = np.sort(np.random.default_rng(0).choice(24, 20, replace=False))
    params = bm.init_params(config, jax.random.key(1), target["embed"], d2t, std=0.3)
    return target, config, params


@pytest.mark.slow
def test_training_reduces_the_loss_and_reads_the_drafted_block(tiny):
    """The loss at an anchor is the KL to the drafter's inference forward after committing the
    positions before it (checked at 3 anchors); 20 steps on a fixed batch cut it by half; the
    target is not touched."""
    target, config, params = tiny
    settings = block_train.BlockTrainConfig(steps=20, learning_rate=1e-2, warmup=2, anchors=3)
    tokens = jax.random.randint(jax.random.key(4), (2, 16), 0, 24)
    anchors = jnp.asarray([[1, 5, 12], [3, 7, 11]], jnp.int32)
    learned = bm.trainable(params)
    fixed = {"embed": params["embed"], "d2t": params["d2t"]}
    logits, features = train.target_pass(config, TARGET, target, tokens)
    for b, p in [(0, 5), (1, 11), (0, 1)]:  # the inference path: a cache of positions < p
        ctx = bm.context_kv(config, params, features[b : b + 1, :p], jnp.arange(p)[None])
        k, v = jnp.swapaxes(ctx.k, 2, 3), jnp.swapaxes(ctx.v, 2, 3)
        last = bm.context(config, params, features[b : b + 1, p - 1 : p])
        got = bm.forward(config, params, k, v, jnp.ones((1, 1, p), bool), last,
                         tokens[b : b + 1, p : p + 1], jnp.asarray([[p]]))[0, 0]  # fmt: skip
        teacher = jax.nn.log_softmax(logits[b, p : p + 4][:, params["d2t"]], -1)
        want_kl = jnp.sum(jnp.exp(teacher) * (teacher - jax.nn.log_softmax(got, -1)), -1)
        one = jnp.asarray([[p]], jnp.int32)
        _, m = block_train.block_loss(config, settings, learned, fixed, TARGET, target,
                                      tokens[b : b + 1], one)  # fmt: skip
        np.testing.assert_allclose([float(m[f"kl_{i}"]) for i in range(4)], want_kl, rtol=1e-4)
    state = train.optimizer(settings).init(learned)
    before = jax.tree.map(np.asarray, target)
    losses = []
    for _ in range(20):
        learned, state, loss, _ = block_train.train_step(
            config, settings, TARGET, learned, state, fixed, target, tokens, anchors
        )
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0], losses
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, target))


@pytest.mark.slow
def test_the_recurrent_readout_is_teacher_forced_on_the_text(tiny):
    """With the recurrent readout the loss at an anchor p is the KL to the drafter's forward whose
    depth i reads the text's token at p + i (the bonus token first), not any other path."""
    target, config, _ = tiny
    c = dataclasses.replace(config, readout="recurrent", readout_size=8)
    d2t = np.sort(np.random.default_rng(0).choice(24, 20, replace=False))
    params = bm.init_params(c, jax.random.key(2), target["embed"], d2t, std=0.3)
    settings = block_train.BlockTrainConfig(anchors=1)
    tokens, p = jax.random.randint(jax.random.key(4), (1, 16), 0, 24), 6
    logits, features = train.target_pass(c, TARGET, target, tokens)
    ctx = bm.context_kv(c, params, features[:, :p], jnp.arange(p)[None])
    k, v = jnp.swapaxes(ctx.k, 2, 3), jnp.swapaxes(ctx.v, 2, 3)
    last = bm.context(c, params, features[:, p - 1 : p])
    one = jnp.asarray([[p]], jnp.int32)
    args = (c, params, k, v, jnp.ones((1, 1, p), bool), last, tokens[:, p : p + 1], one)
    teacher = jax.nn.log_softmax(logits[0, p : p + 4][:, params["d2t"]], -1)
    kls = []
    for parents in (tokens[:, None, p : p + 4], jnp.asarray([[[tokens[0, p], 0, 1, 2]]])):
        log_q = jax.nn.log_softmax(bm.forward(*args, parents)[0, 0], -1)
        kls.append(np.asarray(jnp.sum(jnp.exp(teacher) * (teacher - log_q), -1)))
    learned = bm.trainable(params)
    fixed = {"embed": params["embed"], "d2t": params["d2t"]}
    _, m = block_train.eval_step(c, settings, TARGET, learned, fixed, target, tokens, one)
    np.testing.assert_allclose([float(m[f"kl_{i}"]) for i in range(4)], kls[0], rtol=1e-4)
    assert kls[0][0] == kls[1][0] and np.abs(kls[0][1:] - kls[1][1:]).min() > 1e-4


def _args(data, out, steps=6):
    return [
        "--kind", "block", "--data", str(data), "--out", str(out), "--steps", str(steps),
        "--seq-len", "24", "--batch-size", "2", "--save-every", "3", "--draft-vocab", "300",
        "--val-fraction", "0.2", "--block-size", "4", "--block-layers", "1", "--anchors", "4",
    ]  # fmt: skip


@pytest.mark.slow
def test_script_resumes_where_it_stopped(corpus, tmp_path, monkeypatch, capsys):  # noqa: F811
    """``--kind block``: a run stopped after its step-3 checkpoint and started again with the
    same --out ends with the weights of the uninterrupted run; the drafter it writes loads for
    the bundled target, with its validation figures logged."""
    script = _script()
    assert script.main(_args(corpus, tmp_path / "straight")) == 0
    real_step, calls = block_train.train_step, []

    def stop_after_three(*args):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(1)
        return real_step(*args)

    monkeypatch.setattr(block_train, "train_step", stop_after_three)
    assert script.main(_args(corpus, tmp_path / "resumed")) == 130  # Ctrl-C's exit status
    monkeypatch.setattr(block_train, "train_step", real_step)
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
    assert [e["step"] for e in log["evals"]] == [3, 6] and log["config"]["kind"] == "block"
    import asps_jax
    from asps_jax.drafters import block

    loaded = block.load_block(tmp_path / "straight", asps_jax.load_model("tinyshakespeare-target"))
    assert loaded.config.block_size == 4 and loaded.config.draft_vocab_size == 300


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--block-size", "0"], "--block-size must be >= 1"),
        (["--anchors", "0"], "--anchors"),
        (["--readout-size", "0"], "--readout-size must be >= 1, got 0"),
        (["--readout", "attention"], "--readout: invalid choice"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(corpus, tmp_path, capsys, extra, match):  # noqa: F811
    with pytest.raises(SystemExit) as e:
        _script().main(_args(corpus, tmp_path / "b") + extra)
    assert e.value.code == 2
    assert match in capsys.readouterr().err


def test_a_block_longer_than_the_window_is_one_line(corpus, tmp_path, capsys):  # noqa: F811
    assert _script().main(_args(corpus, tmp_path / "b") + ["--block-size", "30"]) == 2
    assert "--seq-len 24 must exceed --block-size 30" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
