"""Broken checkpoints (issue 15, defect 3): every problem is one ``CheckpointError`` (a
``ValueError``) whose one-line message names the file and the fix. Each case breaks a copy of one
tiny Llama checkpoint written by transformers."""

from __future__ import annotations

import json
import shutil

import pytest
from hf_checkpoints import write_tiny_llama

from asps_jax.models import CheckpointError, load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
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


CASES = {
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


@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_checkpoint_is_one_checkpoint_error(tiny, tmp_path, case):
    edit, names, fix = CASES[case]
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
