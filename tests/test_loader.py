"""Checkpoint loading (``asps_jax.models.loader``, ``cards``, ``vocab``): file layouts, where
checkpoints are found, and errors a user can act on (broken checkpoints at the end)."""

import json
import math
import os
import shutil
import subprocess
import sys

import huggingface_hub
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_checkpoints import write_tiny_family, write_tiny_llama
from safetensors.torch import save_file

from asps_jax.models import (
    FAMILIES,
    CheckpointError,
    IncompatibleModelsError,
    MissingWeightsError,
    UnknownModelError,
    cards,
    check_compatible,
    load_model,
    save_checkpoint,
)
from asps_jax.models.layers import is_spec

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
    # huggingface_hub reads its cache's place from the environment when first imported.
    monkeypatch.setattr(
        huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf_home" / "hub")
    )
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


@pytest.mark.slow
@pytest.mark.parametrize("variable", ["XDG_CACHE_HOME", "HF_HOME", "HF_HUB_CACHE"])
def test_the_cache_is_where_huggingface_hub_puts_it(hf_dir, tmp_path, variable):
    """Each of huggingface_hub's cache variables set alone, in a fresh process (the hub reads
    them at import): the snapshot laid out where the hub itself looks is the one loaded."""
    _, single = hf_dir
    base = tmp_path / "base"
    hub = {"XDG_CACHE_HOME": base / "huggingface" / "hub", "HF_HOME": base / "hub"}
    repo = hub.get(variable, base) / "models--someorg--tiny"
    shutil.copytree(single, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "HF_HOME")}
    env.pop("HF_HUB_CACHE", None)
    env.update({variable: str(base), "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path / "home")})
    code = (
        "from huggingface_hub import try_to_load_from_cache\n"
        "from asps_jax.models import cards\n"
        "print(try_to_load_from_cache('someorg/tiny', 'config.json'))\n"
        "print(cards.resolve('someorg/tiny').path)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    hub_config, ours = proc.stdout.split()
    assert hub_config == str(repo / "snapshots" / "abc123" / "config.json")  # the hub's own answer
    assert ours == str(repo / "snapshots" / "abc123")


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


# --- The learned-position families (OPT, GPT-2, GPT-Neo) ---------------------------------------

# Published parameter counts (model names and papers), independent of the cards' numbers.
NEW_CARDS = {
    "opt-125m": ("facebook/opt-125m", 125e6),
    "opt-350m": ("facebook/opt-350m", 331e6),
    "opt-1.3b": ("facebook/opt-1.3b", 1.3e9),
    "opt-6.7b": ("facebook/opt-6.7b", 6.7e9),
    "opt-13b": ("facebook/opt-13b", 13e9),
    "gpt2": ("openai-community/gpt2", 124e6),
    "gpt2-large": ("openai-community/gpt2-large", 774e6),
    "gpt2-xl": ("openai-community/gpt2-xl", 1.5e9),
    "gpt-neo-2.7b": ("EleutherAI/gpt-neo-2.7B", 2.7e9),
}


@pytest.mark.parametrize("alias", list(NEW_CARDS))
def test_family_cards_describe_the_published_models(alias):
    repo, size = NEW_CARDS[alias]
    card = cards.read_card(alias)
    assert card["repo_id"] == repo and card["alias"] == alias
    arch = card["architecture"]
    family = FAMILIES[arch["model_type"]]
    config = family.config_from_hf(arch)
    # transformers reads the card's keys as the same architecture (HF's own names are used).
    hf = transformers.AutoConfig.for_model(**arch)
    assert family.config_from_hf(hf.to_dict()) == config
    cards.check_card(card, config.to_hf(), "here")
    n = sum(math.prod(s[0]) for s in jax.tree.leaves(family.param_shapes(config), is_leaf=is_spec))
    assert abs(n / size - 1) < 0.04, (alias, n)
    pair = cards.read_card(card["pair"]["alias"])
    assert pair["architecture"]["vocab_size"] == arch["vocab_size"]


def test_paper_pairs_are_named_in_the_readme():
    readme = (cards.MODELS_DIR.parent / "README.md").read_text()
    for pair in ("--target opt-13b --draft opt-125m", "--target gpt2-xl --draft gpt2",
                 "--target gpt-neo-2.7b --draft gpt2"):  # fmt: skip
        assert pair in readme


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    model = write_tiny_family(path, "gpt2", seed=0)
    return model, path


def test_bare_base_model_checkpoint_with_mask_buffers(gpt2_dir, tmp_path):
    """openai-community/gpt2 ships GPT2Model names ("h.0...") plus causal-mask buffers."""
    model, path = gpt2_dir
    ref = load_model(path)
    state = {k.removeprefix("transformer."): v.contiguous() for k, v in model.state_dict().items()}
    state.pop("lm_head.weight", None)
    for i in range(2):
        state[f"h.{i}.attn.bias"] = torch.ones(1, 1, 64, 64)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    state["lm_head.weight"] = model.state_dict()["transformer.wte.weight"].clone()  # tied: ignored
    (tmp_path / "bare").mkdir()
    shutil.copy(path / "config.json", tmp_path / "bare")
    save_file(state, tmp_path / "bare" / "model.safetensors", metadata={"format": "pt"})
    assert_same_params(load_model(tmp_path / "bare").params, ref.params)
    # Independent of our loader: Conv1D c_attn [E, 3E] = q | k | v, already [in, out].
    c_attn = state["h.1.attn.c_attn.weight"].numpy()
    np.testing.assert_array_equal(np.asarray(ref.params["layers"]["wk"][1]).reshape(32, 32),
                                  c_attn[:, 32:64])  # fmt: skip


def _copy_with(src, dst, edit_state=None, edit_config=None, model=None):
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    config.update(edit_config or {})
    (dst / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state.pop("lm_head.weight", None)
    if edit_state:
        edit_state(state)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_family_checkpoint_errors_are_one_line_each(gpt2_dir, tmp_path):
    model, path = gpt2_dir
    drop = "transformer.h.1.attn.c_attn.weight"
    gone = _copy_with(path, tmp_path / "gone", lambda s: s.pop(drop), model=model)
    with pytest.raises(CheckpointError, match=r"missing tensors: transformer\.h\.1\.attn\.c_attn"):
        load_model(gone)
    wide = _copy_with(path, tmp_path / "wide", edit_config={"n_inner": 64}, model=model)
    with pytest.raises(CheckpointError) as err:
        load_model(wide)
    lines = [line.strip() for line in str(err.value).splitlines()[1:]]  # one per tensor
    fc = "transformer.h.0.mlp.c_fc.weight"
    assert f"tensor '{fc}': shape (32, 48), config expects (32, 64)" in lines
    assert "tensor 'transformer.h.1.mlp.c_fc.bias': shape (48,), config expects (64,)" in lines
    unknown = _copy_with(path, tmp_path / "bloom", edit_config={"model_type": "bloom"}, model=model)
    with pytest.raises(ValueError) as err:
        load_model(unknown)
    assert "model_type 'bloom' is not supported" in str(err.value)
    assert "gpt2" in str(err.value) and "\n" not in str(err.value)
    # A post-LN OPT has no final layer norm: a checkpoint carrying one does not match.
    opt = write_tiny_family(tmp_path / "opt", "opt", seed=0, do_layer_norm_before=False)
    extra = _copy_with(
        tmp_path / "opt",
        tmp_path / "opt_extra",
        lambda s: s.update({"model.decoder.final_layer_norm.weight": torch.ones(32)}),
        model=opt,
    )
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.decoder.final_layer_norm"):
        load_model(extra)


def test_vocabulary_check_across_families(tmp_path):
    """GPT-Neo and GPT-2 share a vocabulary and pair; OPT's (more rows, another tokenizer) does
    not pair with them."""
    paths = {}
    for family, vocab, extra in (("gpt2", V, ()), ("gpt_neo", V, ()), ("opt", V + 8, ("zzz",))):
        paths[family] = tmp_path / family
        write_tiny_family(paths[family], family, seed=0, vocab_size=vocab)
        tiny_tokenizer(extra=extra).save_pretrained(paths[family])
    gpt2, neo, opt = (load_model(paths[f]) for f in ("gpt2", "gpt_neo", "opt"))
    check_compatible(neo, gpt2)
    with pytest.raises(IncompatibleModelsError, match="different tokenizers"):
        check_compatible(opt, gpt2)


# --- Broken checkpoints (issue 15, defect 3): every problem is one ``CheckpointError`` (a
# ``ValueError``) whose one-line message names the file and the fix ----------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One tiny Llama checkpoint written by transformers; each case breaks a copy of it."""
    path = tmp_path_factory.mktemp("loader_errors") / "tiny"
    write_tiny_llama(path, seed=0)
    return path


def _copy(tiny, dst):
    shutil.copytree(tiny, dst)
    return dst


def _weights_cut(size_of):
    def edit(path):
        f = path / "model.safetensors"
        data = f.read_bytes()
        f.write_bytes(data[: size_of(data)])

    return edit


def _header_len(data):
    return int.from_bytes(data[:8], "little")


def _config_edit(change):
    def edit(path):
        f = path / "config.json"
        d = json.loads(f.read_text())
        change(d)
        f.write_text(json.dumps(d))

    return edit


def _config_text(text):
    def edit(path):
        (path / "config.json").write_text(text)

    return edit


BROKEN = {
    "empty_weights": (_weights_cut(lambda d: 0), "model.safetensors is truncated", "re-download"),
    "four_bytes": (_weights_cut(lambda d: 4), "model.safetensors is truncated", "re-download"),
    "cut_header": (
        _weights_cut(lambda d: 8 + _header_len(d) // 2),
        "model.safetensors is truncated",
        "re-download",
    ),
    "cut_in_half": (
        _weights_cut(lambda d: len(d) // 2),
        "model.safetensors is truncated: tensor",
        "re-download",
    ),
    "garbled_header": (
        lambda p: (p / "model.safetensors").write_bytes(
            (12).to_bytes(8, "little") + b"{not json!!}" + b"\0" * 64
        ),
        "model.safetensors is corrupt",
        "re-download",
    ),
    "no_hidden_size": (
        _config_edit(lambda d: d.pop("hidden_size")),
        "config.json lacks the field 'hidden_size'",
        "add it",
    ),
    "config_not_json": (_config_text("{model_type: llama"), "config.json is not valid JSON", "re-"),
    "config_not_object": (_config_text("[1, 2]"), "config.json is not a JSON object", "re-"),
    "unknown_type": (
        _config_edit(lambda d: d.update(model_type="bloom")),
        "model_type 'bloom' is not supported",
        "set model_type",
    ),
    "bad_index": (
        lambda p: (p / "model.safetensors.index.json").write_text("{"),
        "model.safetensors.index.json is corrupt",
        "re-download",
    ),
    "wrong_shape": (
        _config_edit(lambda d: d.update(intermediate_size=40)),
        "weights do not match its config.json",
        "fix config.json",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_checkpoint_is_one_checkpoint_error(tiny, tmp_path, case):
    edit, names, fix = BROKEN[case]
    path = _copy(tiny, tmp_path / case)
    edit(path)
    with pytest.raises(CheckpointError) as info:
        load_model(str(path))
    message = str(info.value)
    first = message.splitlines()[0]
    assert names in first and str(path) in first and fix in first, message
    if case != "wrong_shape":  # the tensor mismatches list one tensor per further line
        assert "\n" not in message
    assert isinstance(info.value, ValueError)


def test_corrupt_bin_checkpoint_is_a_checkpoint_error(tiny, tmp_path):
    path = _copy(tiny, tmp_path / "bin")
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not a zip archive")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin could not be read.*re-download"):
        load_model(str(path))
