"""Hugging Face checkpoint I/O: read and write ``config.json`` + weights in HF names and layouts.

Reading streams one tensor at a time (safetensors through a read-only memory map, ``.bin`` through
``torch.load(mmap=True)``) into one preallocated array per stacked parameter, so a checkpoint never
needs two full copies in host memory and bfloat16 stays bfloat16 unless a dtype is asked for.
Each model family's ``HF_TENSORS`` table (``hf_table.HFTensor`` entries, each owning its layout
transform: copy, linear, conv1d, vector, split-into-n, tied head) is the single name/layout
mapping, used both ways; nothing here knows a family's tensor names.
"""

from __future__ import annotations

import json
import math
import re
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from asps_jax.checks import known_keywords
from asps_jax.models import hf_table

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
WEIGHT_FILES = (SAFETENSORS_INDEX, SAFETENSORS_FILE, BIN_INDEX, BIN_FILE)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")

_ST_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


class CheckpointError(ValueError):
    """Every checkpoint problem: weights that do not match the config (missing, unexpected or
    wrongly shaped tensors), a truncated or corrupt weight file or index, a ``config.json`` that is
    not JSON, lacks a field or names an unknown model type. The message names the file and the
    fix."""


_REDOWNLOAD = "re-download or re-save the checkpoint"


def as_dtype(dtype) -> np.dtype | None:
    """None, a name ('float32', 'bf16', ...) or a NumPy/JAX dtype -> a NumPy dtype."""
    if dtype is None:
        return None
    aliases = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "fp16": "float16"}
    if isinstance(dtype, str):
        dtype = aliases.get(dtype, dtype)
        if dtype == "bfloat16":
            return np.dtype(ml_dtypes.bfloat16)
    try:
        out = np.dtype(jnp.dtype(dtype))
    except TypeError as e:
        raise ValueError(f"dtype: unknown dtype {dtype!r}") from e
    if out.kind != "f" and out != np.dtype(ml_dtypes.bfloat16):
        raise ValueError(f"dtype must be a floating dtype, got {dtype!r}")
    return out


# --- Tensor streams ---------------------------------------------------------------------------


def _safetensors_header(path: Path) -> tuple[dict, int]:
    """The parsed header of a safetensors file and the size of its data section, checked against
    the file's size; a truncated or corrupt file is a one-line :class:`CheckpointError`."""
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(
            f"{path} is truncated ({size} bytes, not even a safetensors header); {_REDOWNLOAD}"
        )
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise CheckpointError(
                f"{path} is truncated: its header claims {n} bytes but the file has {size}; "
                f"{_REDOWNLOAD}"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{path} is corrupt: its header is not valid JSON ({e}); {_REDOWNLOAD}"
        ) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is corrupt: its header is not a JSON object; {_REDOWNLOAD}")
    return header, size - 8 - n


def _read_safetensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(name, array)`` views of a memory-mapped safetensors file (no copy)."""
    header, data_size = _safetensors_header(path)
    offset = path.stat().st_size - data_size
    data = (
        np.memmap(path, dtype=np.uint8, mode="r", offset=offset)
        if data_size
        else np.zeros(0, np.uint8)
    )
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{path} is corrupt: the header entry of tensor {name!r} lacks dtype, shape or "
                f"data_offsets; {_REDOWNLOAD}"
            ) from None
        if dtype not in _ST_DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name} has unsupported dtype {dtype}; save it as F32, F16 or BF16"
            )
        if end > data_size:
            raise CheckpointError(
                f"{path} is truncated: tensor {name!r} ends at byte {end} of the data section, "
                f"which has {data_size}; {_REDOWNLOAD}"
            )
        if not 0 <= start <= end or end - start != math.prod(shape) * _ST_DTYPES[dtype].itemsize:
            raise CheckpointError(
                f"{path} is corrupt: tensor {name!r} of shape {shape} ({dtype}) spans bytes "
                f"[{start}, {end}); {_REDOWNLOAD}"
            )
        yield name, data[start:end].view(_ST_DTYPES[dtype]).reshape(shape)


def _read_bin(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    try:
        import torch
    except ImportError as e:
        raise CheckpointError(
            f"{path} is a PyTorch .bin checkpoint; install torch to read it, or convert it to "
            "safetensors"
        ) from e
    try:
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError:  # legacy (non-zip) serialisation cannot be memory-mapped
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a broken file; all mean the same
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path} could not be read as a PyTorch checkpoint ({first}); {_REDOWNLOAD}"
        ) from None
    for name in list(state):
        t = state.pop(name)
        if t.dtype == torch.bfloat16:  # NumPy has no bfloat16; reinterpret the bits
            yield name, t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            yield name, t.numpy()


def folder_config(folder: Path, where: str, expected: str) -> dict:
    """``folder``'s ``config.json`` as a dict, for a folder that must hold it and weight files (a
    drafter's checkpoint); one-line errors name ``where`` and, for a folder without them, what it
    was ``expected`` to hold and what it holds."""
    if not (folder / CONFIG_FILE).is_file() or not weight_files(folder):
        found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else "no such folder"
        raise ValueError(f"{where}: expected {expected}, found {found}")
    try:
        raw = json.loads((folder / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} is not a JSON object")
    return raw


def weight_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint folder, in the order they are read (may be empty)."""
    for index in (SAFETENSORS_INDEX, BIN_INDEX):
        if (path / index).is_file():
            try:
                weight_map = json.loads((path / index).read_text())["weight_map"]
                return [path / f for f in sorted(set(weight_map.values()))]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
                raise CheckpointError(
                    f"{path / index} is corrupt (not JSON with a 'weight_map' of tensor names to "
                    f"files); {_REDOWNLOAD}"
                ) from None
    for single in (SAFETENSORS_FILE, BIN_FILE):
        if (path / single).is_file():
            return [path / single]
    return []


def iter_tensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    files = weight_files(path)
    if not files:
        raise CheckpointError(f"{path}: no weights found (looked for {', '.join(WEIGHT_FILES)})")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{path}: shard {f.name} named in the index is missing")
        yield from (_read_safetensors(f) if f.suffix == ".safetensors" else _read_bin(f))


# --- Name mapping -----------------------------------------------------------------------------


def _table(family, config) -> tuple[dict, set[str], dict]:
    """``({hf name: (HFTensor, layer)}, tied names to ignore, param_shapes)`` for this config."""
    shapes = family.param_shapes(config)
    table, tied = hf_table.expand(family.HF_TENSORS, shapes, config.num_hidden_layers)
    return table, tied, shapes


def _get(tree: dict, keys):
    for k in keys:
        tree = tree[k]
    return tree


def _set(tree: dict, keys, value):
    for k in keys[:-1]:
        tree = tree.setdefault(k, {})
    tree[keys[-1]] = value


def _canonical(name: str, table: dict, prefix: str, ignored) -> str:
    """A checkpoint of the bare base model (``GPT2Model``, ``OPTModel``) names its tensors without
    the base-model prefix (``h.0.attn.c_attn.weight``); the table uses the full names."""
    if name in table or not prefix or name.startswith(prefix):
        return name
    full = prefix + name
    return full if full in table or any(p.fullmatch(full) for p in ignored) else name


def load_params(path: Path, config, family, dtype=None) -> dict:
    """Read every tensor of the checkpoint at ``path`` into our stacked layout."""
    want_dtype = as_dtype(dtype)
    table, tied, shapes = _table(family, config)
    ignored = [re.compile(p) for p in family.HF_IGNORED]
    buffers: dict[tuple[str, ...], np.ndarray] = {}
    seen: set[str] = set()
    errors: list[str] = []
    for raw_name, array in iter_tensors(path):
        name = _canonical(raw_name, table, family.HF_PREFIX, ignored)
        if name in tied or any(p.fullmatch(name) for p in ignored):
            continue  # a tied head (the embedding is the head) or a non-parameter buffer
        if name not in table:
            errors.append(f"unexpected tensor {raw_name!r} {tuple(array.shape)}")
            continue
        entry, layer = table[name]
        inner = [_get(shapes, k)[0][1 if layer is not None else 0 :] for k in entry.keys]
        expected = entry.hf_shape(inner[0])
        if tuple(array.shape) != expected:
            errors.append(
                f"tensor {raw_name!r}: shape {tuple(array.shape)}, config expects {expected}"
            )
            continue
        for keys, part in zip(entry.keys, entry.to_ours(array, inner[0]), strict=True):
            if keys not in buffers:
                buffers[keys] = np.empty(_get(shapes, keys)[0], want_dtype or array.dtype)
            dest = buffers[keys][layer] if layer is not None else buffers[keys]
            dest[...] = part
        seen.add(name)
    # Drop the last views: they keep the memory map (and a stacked buffer) alive.
    array = dest = part = None
    missing = sorted(set(table) - seen)
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" ... ({len(missing)} in all)" if len(missing) > 8 else ""
        )
        errors.append(f"missing tensors: {shown}")
    if errors:
        raise CheckpointError(
            f"checkpoint {path}: its weights do not match its config.json ({_REDOWNLOAD}, or fix "
            "config.json):\n  " + "\n  ".join(errors[:20])
        )
    params: dict = {}
    for keys in list(buffers):
        _set(params, keys, jnp.asarray(buffers.pop(keys)))  # one host copy freed per parameter
    return params


# --- Writing ----------------------------------------------------------------------------------


def write_safetensors(path: Path, tensors: list[tuple[str, np.ndarray]]) -> None:
    """Write tensors one by one (the header needs only their shapes and dtypes)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, a in tensors:
        header[name] = {
            "dtype": _ST_NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # 8-byte alignment of the data section
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, a in tensors:
            f.write(np.ascontiguousarray(a).tobytes())


def write_checkpoint(
    folder: Path, tensors: list[tuple[str, np.ndarray]], config: dict, weights: str, conf: str
) -> Path:
    """``tensors`` into ``folder / weights`` (safetensors) and ``config`` into ``folder / conf``
    (JSON), both written in full first, then renamed: a failed write (a full disk) leaves the
    folder's previous checkpoint as it was and no temporary file."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp_weights, tmp_conf = folder / (weights + ".tmp"), folder / (conf + ".tmp")
    try:
        write_safetensors(tmp_weights, tensors)
        tmp_conf.write_text(json.dumps(config, indent=2) + "\n")
    except BaseException:
        tmp_weights.unlink(missing_ok=True)
        tmp_conf.unlink(missing_ok=True)
        raise
    tmp_weights.replace(folder / weights)
    tmp_conf.replace(folder / conf)
    return folder


def hf_tensors(config, params, family) -> list[tuple[str, np.ndarray]]:
    """Our params as ``(HF name, HF-layout array)``: views of one host copy of each parameter."""
    table, _, shapes = _table(family, config)
    host: dict[tuple[str, ...], np.ndarray] = {}
    out = []
    for name, (entry, layer) in table.items():
        for keys in entry.keys:
            if keys in host:
                continue
            try:
                host[keys] = np.asarray(_get(params, keys))
            except KeyError as e:
                raise ValueError(f"params: missing parameter {'/'.join(keys)}") from e
            if host[keys].shape != _get(shapes, keys)[0]:
                raise ValueError(
                    f"params: {'/'.join(keys)} has shape {host[keys].shape}, "
                    f"config expects {_get(shapes, keys)[0]}"
                )
        parts = [host[k][layer] if layer is not None else host[k] for k in entry.keys]
        out.append((name, entry.to_hf(parts)))
    return out


def save_checkpoint(path, config, params, tokenizer=None, family=None) -> Path:
    """Write an HF-layout checkpoint (config.json, model.safetensors, tokenizer files)."""
    from asps_jax.models.base import family_for_config

    family = family or family_for_config(config)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(config, params, family)
    dtypes = {a.dtype for _, a in tensors}
    dtype_name = str(jnp.dtype(next(iter(dtypes)))) if len(dtypes) == 1 else "float32"
    hf_config = dict(config.to_hf(), torch_dtype=dtype_name, dtype=dtype_name)
    (path / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    write_safetensors(path / SAFETENSORS_FILE, tensors)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path


def read_config(path: Path, family_for_type) -> tuple[object, object]:
    """``(family, config)`` from ``path/config.json``."""
    where = Path(path) / CONFIG_FILE
    try:
        d = json.loads(where.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where} is not valid JSON ({e}); {_REDOWNLOAD}") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{where} is not a JSON object of config fields; {_REDOWNLOAD}")
    try:
        family = family_for_type(d.get("model_type"), where=str(where))
    except ValueError as e:
        raise CheckpointError(f"{e}; set model_type in {where} or convert the model") from None
    try:
        return family, family.config_from_hf(d)
    except KeyError as e:
        raise CheckpointError(
            f"{where} lacks the field {e.args[0]!r} that a {d['model_type']} config needs; "
            f"add it (see the model's original config.json) or {_REDOWNLOAD}"
        ) from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"{where} holds an invalid {d['model_type']} config ({e}); fix config.json or "
            f"{_REDOWNLOAD}"
        ) from None


def _tokenizer_class(path: Path):
    """The tokenizer class ``tokenizer_config.json`` names, where transformers exports it: what
    AutoTokenizer would pick from that name, without importing AutoTokenizer, which imports torch
    when it is installed (through transformers' configuration module: seconds at every start).
    None: let AutoTokenizer decide."""
    try:
        name = json.loads((Path(path) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(name, str) or not name.isidentifier():
        return None
    import transformers

    cls = getattr(transformers, name, None)
    if cls is None:
        return None
    base = transformers.PreTrainedTokenizerBase
    return cls if isinstance(cls, type) and issubclass(cls, base) else None


def load_tokenizer(path: Path):
    """The folder's tokenizer (the class its ``tokenizer_config.json`` names, else
    ``transformers.AutoTokenizer``'s choice), or None when it holds no tokenizer files."""
    if not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        return None
    try:
        cls = _tokenizer_class(path)
        if cls is None:
            from transformers import AutoTokenizer as cls
        return cls.from_pretrained(str(path))
    except (ImportError, ValueError, OSError) as e:
        # The weights are usable without it (token ids in, token ids out); say what is missing,
        # e.g. `sentencepiece` for checkpoints that ship only tokenizer.model.
        warnings.warn(
            f"could not load the tokenizer in {path} ({type(e).__name__}: {e}); the model is "
            "loaded without one (pip install sentencepiece if it ships only tokenizer.model)",
            stacklevel=3,
        )
        return None


@known_keywords()
def load_model(name_or_path, *, dtype=None, quantize=None):
    """Load an alias, a checkpoint folder or a cached HF repo id (docs/api.md §2) as a ``Model``;
    ``quantize="int8"`` / ``"int4"`` / ``"int4:G"`` stores its matrices quantized
    (:mod:`asps_jax.models.quant`)."""
    from asps_jax.models import cards, quant
    from asps_jax.models.base import Model, family_for_type

    if quantize is not None:
        quant.parse(quantize)  # a bad request fails before anything is read

    found = cards.resolve(name_or_path)
    family, config = read_config(found.path, family_for_type)
    cards.check_card(found.card, config.to_hf(), found.path)
    params = load_params(found.path, config, family, dtype=dtype)
    tokenizer = load_tokenizer(found.path)
    model = Model(
        name=found.name, path=str(found.path), config=config, params=params, tokenizer=tokenizer
    )
    return model if quantize is None else quant.quantize_model(model, quantize)
