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
import re
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
    assert script.main(_args(corpus, tmp_path / "resumed")) == 130  # saved, no traceback
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
        (["--warmup", "-5"], "--warmup must be >= 0, got -5"),
        (["--draft-vocab", "0"], "--draft-vocab must be >= 1 (the head's vocabulary), got 0"),
        (["--feature-layers", "1,x"], "--feature-layers '1,x': give layer ids"),
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
        (b"", ".jsonl", "no line has a non-empty"),
        (b'\n{"text": ""}\n', ".jsonl", "(an empty corpus)"),
        (b"", ".txt", "the file is empty"),
        # A BOM'd corpus is read (as --prompts reads one): too short here, not "not JSON".
        (b'\xef\xbb\xbf{"text": "to be"}\n', ".jsonl", "fewer than one window"),
    ],
)
def test_bad_corpus_is_one_line(tmp_path, capsys, content, suffix, match):
    path = tmp_path / f"corpus{suffix}"
    if content is not None:
        path.write_bytes(content)
    assert _script().main(_args(path, tmp_path / "h")) == 2
    err = capsys.readouterr().err
    assert err.startswith("train_drafter.py: error: --data") and match in err, err
    assert err.count("\n") == 1
    assert not (tmp_path / "h").exists()  # nothing written


# --- The error boundary without compiling (issue 66, item 5): a stand-in optimizer step ---------


def _fake_step(calls, nan_at=None, sigint_at=None):
    """train.train_step's signature, no compile: the weights unchanged (NaN from call
    ``nan_at``), a SIGINT sent to this process during call ``sigint_at``."""

    def step(head_config, config, target_config, learned, opt_state, fixed, params, batch):
        calls.append(1)
        if sigint_at == len(calls):
            import os
            import signal

            os.kill(os.getpid(), signal.SIGINT)
        if nan_at is not None and len(calls) >= nan_at:
            learned = dict(learned, fc=learned["fc"] * jnp.nan)
        return learned, opt_state, jnp.zeros(()), {"acc_0": jnp.zeros(())}

    return step


def _quick_args(corpus, out, *extra):
    return [*_args(corpus, out, steps=4), "--save-every", "2", "--val-fraction", "0", *extra]


@pytest.fixture
def saved(corpus, tmp_path, monkeypatch):
    """A checkpoint of step 4 written by the script (stand-in steps), and its argv."""
    monkeypatch.setattr(train, "train_step", _fake_step([]))
    argv = _quick_args(corpus, tmp_path / "head")
    assert _script().main(argv) == 0
    return tmp_path / "head", argv


def _fails(argv, capsys, match, status=2):
    assert _script().main(argv) == status
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar's line
    assert err.startswith("train_drafter.py: error: ") and "\n" not in err, err
    assert re.search(match, err), err
    return err


def _bad_zip(path):
    path.write_bytes(path.read_bytes()[:100])


BAD_RESUMES = [
    ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:200]), r"model.safetensors"),
    ("train_state.npz", _bad_zip, r"train_state.npz: truncated or not a saved optimizer state"),
    ("train_state.npz", lambda p: p.write_bytes(b""), r"train_state.npz: truncated or not a"),
    ("train_state.npz", lambda p: np.savez(p, x=np.ones(2)), r"train_state.npz: no step count"),
    (
        "train_state.npz",
        lambda p: np.savez(p, step=np.asarray(2), **{"0": np.ones(3)}),
        r"train_state.npz: 1 saved arrays, this run's state has",
    ),
    ("training.json", lambda p: p.write_text("{not json"), r"training.json: not valid JSON"),
    ("training.json", lambda p: p.write_text("[1, 2]"), r"training.json: not a training log"),
]


@pytest.mark.parametrize("name, damage, match", BAD_RESUMES)
def test_a_damaged_checkpoint_is_one_line(saved, capsys, name, damage, match):
    out, argv = saved
    damage(out / name)
    _fails(argv, capsys, match)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--target", "tinyshakespeare-draft"], r"--target tinyshakespeare-draft: .* holds a head "
         r"trained for --target tinyshakespeare-target \(training.json\)"),
        (["--feature-layers", "0,1,2"], r"--feature-layers 0,1,2: .* holds a head with "
         r"--feature-layers 1,2,3 \(config.json\); drop the flag"),
        (["--draft-vocab", "200"], r"--draft-vocab 200: .* holds a head with --draft-vocab 300"),
    ],
)  # fmt: skip
def test_a_resume_with_other_flags_is_refused(saved, capsys, extra, match):
    out, argv = saved
    _fails([*argv, "--steps", "6", *extra], capsys, match)


def test_an_out_folder_not_of_this_script_is_refused(corpus, tmp_path, capsys):
    """--out a file, or a head folder with no train_state.npz (the bundled head's): refused
    before any step, the files untouched."""
    (tmp_path / "file").write_text("x")
    _fails(_quick_args(corpus, tmp_path / "file"), capsys, r"--out .*file: a file, not a folder")
    _fails([*_quick_args(corpus, tmp_path / "h"), "--draft-vocab", "5000"], capsys,
           r"--draft-vocab 5000: at most the target's 2048 tokens")  # fmt: skip
    bundled = ROOT / "models/tinyshakespeare-eagle3"
    before = {p.name: p.stat().st_mtime_ns for p in bundled.iterdir()}
    _fails(_quick_args(corpus, bundled), capsys, r"holds a head but no train_state.npz")
    assert {p.name: p.stat().st_mtime_ns for p in bundled.iterdir()} == before


def test_a_full_disk_keeps_the_last_checkpoint(saved, capsys, monkeypatch):
    """The head's write fails half-way with ENOSPC: one line (exit 2), the step-4 checkpoint
    whole and no temporary file left."""
    import errno

    from asps_jax.models import loader

    out, argv = saved
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = loader.write_safetensors

    def full(path, tensors):
        real(path, tensors[:2])  # a part of the file is written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(loader, "write_safetensors", full)
    _fails([*argv, "--steps", "6"], capsys, r"--out .*: writing the checkpoint of step 6 failed "
           r"\(No space left on device\); its checkpoint of step 4 is kept")  # fmt: skip
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_diverged_head_is_not_saved(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(train, "train_step", _fake_step([], nan_at=3))
    out = tmp_path / "head"
    _fails(_quick_args(corpus, out), capsys, r"the head diverged: NaN / inf weights in \['fc'\] at "
           r"step 4; not saved: .* keeps its checkpoint of step 2", status=1)  # fmt: skip
    assert json.loads((out / "training.json").read_text())["step"] == 2
    assert not list(out.glob("*.tmp*"))


def test_ctrl_c_stops_at_the_next_step_and_saves(corpus, tmp_path, capsys, monkeypatch):
    """SIGINT during step 3 of 4 (save every 2): step 3 finishes, is saved, exit 130, no
    traceback; the next run resumes at step 3."""
    calls = []
    monkeypatch.setattr(train, "train_step", _fake_step(calls, sigint_at=3))
    out = tmp_path / "head"
    assert _script().main(_quick_args(corpus, out)) == 130
    assert len(calls) == 3
    err = capsys.readouterr().err
    assert "interrupted;" in err and "holds step 3" in err and "Traceback" not in err
    assert json.loads((out / "training.json").read_text())["step"] == 3
    monkeypatch.setattr(train, "train_step", _fake_step(calls))
    assert _script().main(_quick_args(corpus, out)) == 0
    assert len(calls) == 4  # one step left


def test_presets_quick_and_the_default_folder(monkeypatch, tmp_path):
    """--preset tinyshakespeare-eagle3 is the bundled head's recorded recipe (its training.json,
    the command in docs/benchmarks.md); --quick shortens a run; explicit flags win; the default
    --out is in the current directory, never the checkout's models/."""
    script = _script()
    recorded = json.loads((ROOT / "models/tinyshakespeare-eagle3/training.json").read_text())
    args = script.parse(["--preset", "tinyshakespeare-eagle3"])
    got = {k: v for k, v in vars(args).items() if k in recorded["config"]}
    want = dict(recorded["config"], data=str(ROOT / recorded["config"]["data"]))
    want["out"] = "tinyshakespeare-eagle3"
    assert got == want
    assert recorded["command"] in (ROOT / "docs/benchmarks.md").read_text()
    assert script.parse(["--preset", "tinyshakespeare-eagle3", "--steps", "5"]).steps == 5
    quick = script.parse(["--quick"])
    assert (quick.steps, quick.seq_len) == (script.QUICK["steps"], script.QUICK["seq_len"])
    assert script.parse(["--quick", "--steps", "3"]).steps == 3
    assert script.parse([]).out is None  # run(): Path("<target>-eagle3"), relative to the cwd
