"""The bundled tiny pair (models/tinyshakespeare-{target,draft}/) and scripts/train_tiny.py.

Expected values come from transformers (HF parity on the shipped files), from literals, and from
the files themselves (card.json against the loaded parameters), never from our own forward.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "models"
ALIASES = ("tinyshakespeare-target", "tinyshakespeare-draft")
LINES = [
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "KING RICHARD II:\nNow, my lord, what is the news?",
]


def _train_tiny():
    spec = importlib.util.spec_from_file_location("train_tiny", REPO / "scripts/train_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _hf_logits(path: Path, tokens_BT: np.ndarray) -> np.ndarray:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return model(torch.from_numpy(tokens_BT).long()).logits.numpy()


def _our_logits(model, tokens_BT: np.ndarray) -> np.ndarray:
    B, T = tokens_BT.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    logits, _ = model.forward(model.params, jnp.asarray(tokens_BT), positions, mask, None)
    return np.asarray(logits)


def _tokenize(tokenizer, lines) -> np.ndarray:
    """Equal-length rows (cut to the shortest line) so no padding enters the parity check."""
    ids = [tokenizer(line)["input_ids"] for line in lines]
    T = min(len(i) for i in ids)
    return np.asarray([i[:T] for i in ids], np.int32)


# --- The shipped files -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("alias", ALIASES)
def test_bundled_parity_with_transformers(alias):
    from transformers import AutoTokenizer

    import asps_jax

    model = asps_jax.load_model(alias, dtype="float32")
    assert model.tokenizer is not None
    tokens_BT = _tokenize(AutoTokenizer.from_pretrained(MODELS / alias), LINES)
    assert tokens_BT.shape[1] >= 8
    ours = _our_logits(model, tokens_BT)
    want = _hf_logits(MODELS / alias, tokens_BT)
    np.testing.assert_allclose(ours, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("alias", ALIASES)
def test_bundled_files_and_card(alias):
    from safetensors.numpy import load_file

    folder = MODELS / alias
    config = json.loads((folder / "config.json").read_text())
    card = json.loads((folder / "card.json").read_text())
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == card["dtype"] == "bfloat16"
    assert card["alias"] == alias and alias.endswith(card["role"])
    tensors = load_file(folder / "model.safetensors")
    assert card["parameters"] == sum(t.size for t in tensors.values())
    assert {str(t.dtype) for t in tensors.values()} == {"bfloat16"}
    metrics, made = card["metrics"], card["made_by"]
    assert 0.0 < metrics["train_loss"] < np.log(config["vocab_size"])
    assert 0.0 < metrics["val_loss"] < np.log(config["vocab_size"])
    assert made["command"].startswith("python scripts/train_tiny.py")
    assert made["total_wall_time_s"] <= 15 * 60
    assert (folder / "README.md").read_text().startswith(f"# {alias}")
    size = sum(f.stat().st_size for f in folder.iterdir())
    assert size < 8 * 2**20, f"{alias} folder is {size / 2**20:.1f} MiB"


def test_bundled_pair_sizes():
    cards = [json.loads((MODELS / a / "card.json").read_text()) for a in ALIASES]
    target, draft = (c["parameters"] for c in cards)
    assert 1_000_000 <= target <= 10_000_000
    assert 5 <= target / draft <= 20
    assert 0.0 < cards[1]["metrics"]["acceptance_proxy_vs_target"] < 1.0


def test_tokenizer_round_trip_and_shared():
    from transformers import AutoTokenizer

    target, draft = (AutoTokenizer.from_pretrained(MODELS / a) for a in ALIASES)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        target_file, draft_file = (MODELS / a / name for a in ALIASES)
        assert target_file.read_bytes() == draft_file.read_bytes()
    assert target.get_vocab() == draft.get_vocab()
    assert (target.bos_token, target.eos_token) == ("<s>", "</s>")
    assert len(target) == 2048
    text = "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n\t naïve café – ½ 🎭"
    ids = target(text)["input_ids"]
    assert ids[0] == target.bos_token_id == 1
    assert ids == draft(text)["input_ids"]
    assert target.decode(ids, skip_special_tokens=True) == text
    # Byte-level BPE merges common words: far fewer tokens than bytes.
    assert len(ids) < 0.6 * len(text.encode())


# --- scripts/train_tiny.py ---------------------------------------------------------------------

TINY = [
    "--vocab-size", "300", "--seq-len", "16", "--batch-size", "4", "--eval-every", "4",
    "--target-hidden", "32", "--target-layers", "1", "--target-heads", "2",
    "--target-kv-heads", "1", "--target-intermediate", "48", "--target-steps", "6",
    "--draft-hidden", "16", "--draft-layers", "1", "--draft-heads", "1",
    "--draft-kv-heads", "1", "--draft-intermediate", "32", "--draft-steps", "6",
]  # fmt: skip


@pytest.mark.slow
def test_train_tiny_smoke(tmp_path, capsys):
    import asps_jax

    data = tmp_path / "lines.txt"
    data.write_text("".join(f"{line}\n\n" for line in LINES) * 40)
    out = tmp_path / "out"
    args = [*TINY, "--data", str(data), "--out-dir", str(out), "--name", "toy", "--seed", "3"]
    assert _train_tiny().main([*args, "--dtype", "float32", "--compare-distill"]) == 0
    log = capsys.readouterr().out
    assert "acceptance proxy" in log and "[target] step     6/6" in log
    for role in ("target", "draft"):
        folder = out / f"toy-{role}"
        card = json.loads((folder / "card.json").read_text())
        assert card["role"] == role and card["made_by"]["steps"] == 6
        if role == "draft":  # --compare-distill keeps the draft with the higher 1 - TV
            by_weight = card["metrics"]["acceptance_proxy_by_distill_weight"]
            assert set(by_weight) == {"0.5", "0"}
            best = max(by_weight, key=by_weight.get)
            assert card["made_by"]["distill_weight"] == float(best)
            assert card["metrics"]["acceptance_proxy_vs_target"] == by_weight[best]
        model = asps_jax.load_model(str(folder))
        assert model.config.hidden_size == (32 if role == "target" else 16)
        assert model.tokenizer.decode(model.tokenizer("Before we")["input_ids"][1:]) == "Before we"
        leaves = jax.tree.leaves(model.params)
        assert sum(x.size for x in leaves) == card["parameters"]
        assert {x.dtype for x in leaves} == {jnp.dtype("float32")}  # --dtype float32
        assert np.isfinite(card["metrics"]["val_loss"])


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--data", "/nonexistent/corpus.txt"),
        ("--target-steps", "0"),
        ("--vocab-size", "100"),
        ("--seq-len", "1"),
        ("--val-fraction", "1.5"),
        ("--distill-weight", "-0.1"),
        ("--draft-heads", "3"),
        ("--lr", "0"),
        ("--seq-len", "64"),  # the 120-character corpus has too few tokens for a window
    ],
)
def test_train_tiny_rejects_bad_flags(tmp_path, capsys, flag, value):
    data = tmp_path / "t.txt"
    data.write_text("hello world\n" * 10)
    with pytest.raises(SystemExit) as exc:
        _train_tiny().main(["--data", str(data), "--out-dir", str(tmp_path), flag, value])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_train_tiny_help_explains_every_flag(capsys):
    tt = _train_tiny()
    with pytest.raises(SystemExit) as exc:
        tt.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for action in tt.build_parser()._actions:
        assert action.help and len(action.help) > 8, action.option_strings
        assert all(flag in text for flag in action.option_strings)
    assert "--compare-distill" in text and "--distill-weight" in text


def test_train_tiny_windows_and_split():
    tt = _train_tiny()
    train, val = tt.split_text("a\nbb\nccc\ndddd\n", 0.3)
    assert train + val == "a\nbb\nccc\ndddd\n" and train.endswith("\n") and val == "dddd\n"
    ids = np.arange(10, 20, dtype=np.int32)
    inputs, labels, weights = tt.eval_windows(ids, 4, bos=1)
    np.testing.assert_array_equal(labels, [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 0, 0]])
    np.testing.assert_array_equal(inputs, [[1, 10, 11, 12], [1, 14, 15, 16], [1, 18, 19, 0]])
    np.testing.assert_array_equal(weights.sum(axis=1), [4, 4, 2])
    inputs, labels = tt.sample_batch(np.random.default_rng(0), ids, 3, 5, bos=1)
    np.testing.assert_array_equal(inputs[:, 0], [1, 1, 1])
    np.testing.assert_array_equal(inputs[:, 1:], labels[:, :-1])
    assert np.all(np.diff(labels, axis=1) == 1)  # contiguous windows of the corpus


@pytest.mark.slow
def test_acceptance_proxy_matches_numpy():
    """sum_v min(p, q) through our jitted helper equals a float64 NumPy evaluation of it."""
    import scipy.special

    from asps_jax.models import llama

    tt = _train_tiny()
    cfg = llama.LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=8,
    )  # fmt: skip
    target = (cfg, llama.init_params(cfg, jax.random.key(0)))
    draft = (cfg, llama.init_params(cfg, jax.random.key(1)))
    windows = tt.eval_windows(np.arange(3, 23, dtype=np.int32), 8, bos=1)
    got = tt.acceptance_proxy(target, draft, windows, batch=2)
    inputs, _, weights = windows
    p, q = (
        scipy.special.softmax(np.asarray(tt._logits(c, w, jnp.asarray(inputs)), np.float64), -1)
        for c, w in (target, draft)
    )
    overlap = np.minimum(p, q).sum(-1)
    want = (overlap * weights).sum() / weights.sum()
    assert abs(got - want) < 1e-5


# --- The bundled learned head ------------------------------------------------------------------


def test_bundled_head_files_match_its_training_log():
    """models/tinyshakespeare-eagle3/: an EAGLE-3-layout head for the bundled target (its
    config.json read here, not through asps_jax), with the training log the script wrote."""
    folder = MODELS / "tinyshakespeare-eagle3"
    config = json.loads((folder / "config.json").read_text())
    target = json.loads((MODELS / "tinyshakespeare-target/config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1
    assert config["target_hidden_size"] == target["hidden_size"]
    assert config["vocab_size"] == target["vocab_size"]
    assert (
        max(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        < target["num_hidden_layers"]
    )
    log = json.loads((folder / "training.json").read_text())
    assert log["target"] == "tinyshakespeare-target" and log["step"] == log["config"]["steps"]
    assert log["data"]["sha256"] == _data_sha256()
    assert log["evals"][-1]["loss"] < 0.5 * log["evals"][0]["loss"]  # it learned


def _data_sha256() -> str:
    import hashlib

    return hashlib.sha256((REPO / "data/tinyshakespeare.txt").read_bytes()).hexdigest()


@pytest.mark.slow
def test_bundled_head_runs_out_of_the_box():
    """``draft="eagle3:tinyshakespeare-eagle3"`` (found under models/ by name) drafts for the
    bundled target, and better than the bundled draft model on the same prompts and keys."""
    import asps_jax

    target = asps_jax.load_model("tinyshakespeare-target")
    draft = asps_jax.load_model("tinyshakespeare-draft")
    prompts = [target.tokenizer.encode(line) for line in LINES]
    common = dict(seed=0, max_new_tokens=48, method="asps", num_draft_tokens=4, eos_token_id=-1)
    head = asps_jax.sample(target, "eagle3:tinyshakespeare-eagle3", prompts, **common)
    model = asps_jax.sample(target, draft, prompts, **common)
    assert np.all(np.asarray(head.lengths) == 48)
    per_step = lambda out: float(np.mean(np.asarray(out.stats["tokens_per_step"])))  # noqa: E731
    assert per_step(head) > per_step(model) > 1.5
