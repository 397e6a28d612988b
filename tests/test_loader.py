"""Checkpoint loading: file layouts, where checkpoints are found, and errors a user can act on."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

from asps_jax.models import (
    CheckpointError,
    IncompatibleModelsError,
    MissingWeightsError,
    UnknownModelError,
    cards,
    check_compatible,
    load_model,
    save_checkpoint,
)

V = 40


def tiny_hf(seed=0, **overrides):
    torch.manual_seed(seed)
    kw = dict(
        vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**kw, **overrides})).eval()


def tiny_tokenizer(extra=()):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": 3 + i for i in range(V - 3 - len(extra))}}
    vocab.update({w: len(vocab) for w in extra})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    model = tiny_hf()
    path = tmp_path_factory.mktemp("single")
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return model, path


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No network, an empty HF cache and home, no ASPS_MODELS_DIR."""
    for var in ("HF_HUB_CACHE", "ASPS_MODELS_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def assert_same_params(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_single_sharded_and_bin_load_identically(hf_dir, tmp_path):
    model, single = hf_dir
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="8KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    bin_dir, bin_sharded = tmp_path / "bin", tmp_path / "bin_sharded"
    for d in (bin_dir, bin_sharded):
        d.mkdir()
        shutil.copy(single / "config.json", d)
    torch.save(state, bin_dir / "pytorch_model.bin")
    names = sorted(state)
    halves = {f"pytorch_model-0000{i + 1}-of-00002.bin": names[i::2] for i in range(2)}
    for fname, keys in halves.items():
        torch.save({k: state[k] for k in keys}, bin_sharded / fname)
    index = {"weight_map": {k: f for f, ks in halves.items() for k in ks}}
    (bin_sharded / "pytorch_model.bin.index.json").write_text(json.dumps(index))

    ref = load_model(single)
    assert ref.tokenizer is not None and ref.tokenizer.get_vocab()["w0"] == 3
    for d in (sharded, bin_dir, bin_sharded):
        assert_same_params(load_model(d).params, ref.params)
    # Independent of our loader: HF's [out, in] q_proj of layer 1 is our wq[1] transposed.
    q = state["model.layers.1.self_attn.q_proj.weight"].numpy()
    np.testing.assert_array_equal(np.asarray(ref.params["layers"]["wq"][1]).reshape(16, -1), q.T)


def test_bfloat16_bin_stays_bfloat16(hf_dir, tmp_path):
    model, single = hf_dir
    shutil.copy(single / "config.json", tmp_path)
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    torch.save(state, tmp_path / "pytorch_model.bin")
    m = load_model(tmp_path)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(m.params))
    emb = model.state_dict()["model.embed_tokens.weight"].to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(np.asarray(m.params["embed"], np.float32), emb)


def test_hf_cache_layout_and_aliases(hf_dir, offline, monkeypatch):
    _, single = hf_dir
    repo = offline / "hf_home" / "hub" / "models--someorg--tiny"
    good, stale = repo / "snapshots" / "abc123", repo / "snapshots" / "old999"
    shutil.copytree(single, good)
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # a stale snapshot without weights is skipped
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    m = load_model("someorg/tiny")
    assert m.name == "someorg/tiny" and m.path == str(good)

    # An alias whose card points at that repo id; $ASPS_MODELS_DIR/<alias> takes precedence.
    card_root = offline / "cards"
    (card_root / "tinyalias").mkdir(parents=True)
    card = {"alias": "tinyalias", "repo_id": "someorg/tiny", "architecture": {"hidden_size": 16}}
    (card_root / "tinyalias" / "card.json").write_text(json.dumps(card))
    monkeypatch.setattr(cards, "MODELS_DIR", card_root)
    assert cards.known_aliases() == ["tinyalias"]
    assert load_model("tinyalias").path == str(good)
    local = offline / "mine"
    shutil.copytree(single, local / "tinyalias")
    monkeypatch.setenv("ASPS_MODELS_DIR", str(local))
    assert load_model("tinyalias").path == str(local / "tinyalias")
    monkeypatch.delenv("ASPS_MODELS_DIR")
    shutil.copytree(single, card_root / "tinyalias", dirs_exist_ok=True)  # bundled checkpoint
    assert load_model("tinyalias").path == str(card_root / "tinyalias")

    card["architecture"] = {"hidden_size": 4096, "num_hidden_layers": 32}
    (card_root / "tinyalias" / "card.json").write_text(json.dumps(card))
    with pytest.raises(ValueError, match="hidden_size: card 4096, checkpoint 16"):
        load_model("tinyalias")


def test_alias_without_weights_says_where_and_how(offline, monkeypatch):
    with pytest.raises(MissingWeightsError) as err:
        load_model("llama7b")
    msg = str(err.value)
    assert isinstance(err.value, FileNotFoundError)
    assert "huggyllama/llama-7b" in msg and "hf download huggyllama/llama-7b" in msg
    assert "ASPS_MODELS_DIR" in msg and "Hugging Face cache" in msg
    assert str(offline / "hf_home" / "hub") in msg and "HF_HUB_OFFLINE" in msg
    with pytest.raises(MissingWeightsError, match="hf download JackFram/llama-68m"):
        load_model("llama68m")
    with pytest.raises(UnknownModelError, match="llama68m"):
        load_model("no such model!")


def test_cards_hold_the_paper_pair():
    expected = {
        "llama7b": ("huggyllama/llama-7b", 32000, 4096, 32, 32, 11008),
        "llama68m": ("JackFram/llama-68m", 32000, 768, 2, 12, 3072),
    }
    for alias, (repo, v, e, layers, heads, f) in expected.items():
        card = cards.read_card(alias)
        a = card["architecture"]
        assert card["repo_id"] == repo and card["alias"] == alias
        got = (a["vocab_size"], a["hidden_size"], a["num_hidden_layers"])
        assert got + (a["num_attention_heads"], a["intermediate_size"]) == (v, e, layers, heads, f)


def broken_copy(src, dst, edit_state=None, edit_config=None):
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    if edit_config:
        config.update(edit_config)
    (dst / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in tiny_hf().state_dict().items()}
    if edit_state:
        edit_state(state)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_checkpoint_errors_name_the_problem(hf_dir, tmp_path, offline):
    _, single = hf_dir
    wrong_shape = (
        r"'model\.layers\.0\.mlp\.up_proj\.weight': shape \(24, 16\), config expects \(32, 16\)"
    )
    with pytest.raises(CheckpointError, match=wrong_shape):
        load_model(broken_copy(single, tmp_path / "shape", edit_config={"intermediate_size": 32}))
    extra = broken_copy(single, tmp_path / "extra", lambda s: s.update(extra=torch.zeros(3)))
    with pytest.raises(CheckpointError, match="unexpected tensor 'extra'"):
        load_model(extra)
    gone = broken_copy(single, tmp_path / "gone", lambda s: s.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.norm\.weight"):
        load_model(gone)
    # rotary inv_freq buffers from older exporters are ignored
    ok = broken_copy(
        single,
        tmp_path / "rotary",
        lambda s: s.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2)}),
    )
    load_model(ok)

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(single / "config.json", no_weights)
    with pytest.raises(MissingWeightsError, match="no weights.*model.safetensors"):
        load_model(no_weights)
    (tmp_path / "empty").mkdir()
    with pytest.raises(MissingWeightsError, match="no config.json"):
        load_model(tmp_path / "empty")
    lost = tmp_path / "lost_shard"
    lost.mkdir()
    shutil.copy(single / "config.json", lost)
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00001.safetensors"}}
    (lost / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="shard model-00001-of-00001.safetensors .* missing"):
        load_model(lost)
    broken_tok = tmp_path / "broken_tokenizer"
    shutil.copytree(single, broken_tok)
    (broken_tok / "tokenizer.json").write_text("{not json")
    with pytest.warns(UserWarning, match="could not load the tokenizer"):
        assert load_model(broken_tok).tokenizer is None
    for bad in ("int8", "nonsense"):
        with pytest.raises(ValueError, match="dtype"):
            load_model(single, dtype=bad)


def test_save_with_tokenizer_and_compatibility(hf_dir, tmp_path):
    _, single = hf_dir
    m = load_model(single)
    save_checkpoint(tmp_path / "copy", m.config, m.params, tokenizer=m.tokenizer)
    copy = load_model(tmp_path / "copy")
    assert_same_params(copy.params, m.params)
    assert copy.tokenizer.get_vocab() == m.tokenizer.get_vocab()
    check_compatible(m, copy)

    other = tmp_path / "other"
    tiny_hf(seed=1).save_pretrained(other)
    tiny_tokenizer(extra=("zzz",)).save_pretrained(other)
    with pytest.raises(IncompatibleModelsError, match="different tokenizers"):
        check_compatible(m, load_model(other))
    wide = tmp_path / "wide"
    tiny_hf(vocab_size=V + 8).save_pretrained(wide)
    with pytest.raises(IncompatibleModelsError, match="vocab_size 40 but draft .* has 48"):
        check_compatible(m, load_model(wide))
    with pytest.raises(ValueError, match="params: layers/wq has shape"):
        bad = dict(m.params, layers=dict(m.params["layers"], wq=m.params["layers"]["wq"][:1]))
        save_checkpoint(tmp_path / "bad", m.config, bad)
