"""Model cards (``models/<alias>/card.json``) and where a checkpoint is looked for.

The bundled models are the package ``asps_jax._models``: the checkout's top-level ``models/``
folder, which pyproject.toml maps onto that name, so that an editable install reads the checkout's
folder and a wheel (``pip install .``, a git URL, ``dist/*.whl``) carries it as package data.

A card names an alias's Hugging Face repo id and the architecture numbers its config must have.
``resolve`` finds the checkpoint folder, in this order:

1. ``name_or_path`` itself when it is a directory;
2. ``$ASPS_MODELS_DIR/<alias>``;
3. the bundled checkpoint ``models/<alias>/`` (card.json next to config.json + weights);
4. the local Hugging Face cache where huggingface_hub puts it (``$HF_HUB_CACHE``, ``$HF_HOME/hub``,
   ``$XDG_CACHE_HOME/huggingface/hub``, ``~/.cache/huggingface/hub``), read through
   huggingface_hub's cache functions: the revision ``refs/main`` points at first;
5. ``huggingface_hub.snapshot_download`` when ``HF_HUB_OFFLINE`` is unset and the Hub is reachable.

Nothing found raises ``MissingWeightsError``: its first line a one-line summary with the command
that fetches the weights, then every place searched, one per line.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import os
import re
import socket
from pathlib import Path


def _models_dir() -> Path:
    """The folder of the bundled models: the package ``asps_jax._models`` where an install maps it
    (editable or a wheel), else ``<checkout>/models`` (the tree run from its checkout, on
    ``PYTHONPATH``, with no install of its own)."""
    try:
        folder = importlib.resources.files("asps_jax._models")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "models"
    return Path(str(folder))  # installed unpacked: a real folder


MODELS_DIR = _models_dir()
CARD_FILE = "card.json"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class MissingWeightsError(FileNotFoundError):
    """No checkpoint files where they were looked for; the message says how to get them."""


class UnknownModelError(ValueError):
    """Not an alias, not a directory, not a Hugging Face repo id."""


@dataclasses.dataclass(frozen=True)
class Resolved:
    name: str
    path: Path
    card: dict | None


def known_aliases() -> list[str]:
    if not MODELS_DIR.is_dir():
        return []
    return sorted(p.parent.name for p in MODELS_DIR.glob(f"*/{CARD_FILE}"))


def read_card(alias: str) -> dict | None:
    path = MODELS_DIR / alias / CARD_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())


# The families in the order the README's table lists them: model_type -> the name it shows.
FAMILY_NAMES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2 / 2.5",
    "qwen3": "Qwen3",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3 (text)",
    "opt": "OPT",
    "gpt2": "GPT-2",
    "gpt_neo": "GPT-Neo",
}


def _model_type(card: dict) -> str:
    """A card's family: its architecture's ``model_type``, else its bundled checkpoint's."""
    kind = card.get("architecture", {}).get("model_type")
    if kind is None:
        kind = json.loads((MODELS_DIR / card["alias"] / "config.json").read_text())["model_type"]
    return kind


def markdown_table() -> str:
    """The README's model table, made from the cards: per family, every alias (its Hugging Face
    repo, or "bundled") and the target / draft pairs the cards name."""
    rows = {kind: ([], []) for kind in FAMILY_NAMES}
    for alias in known_aliases():
        card = read_card(alias)
        names, pairs = rows[_model_type(card)]
        repo = card.get("repo_id")
        names.append(f"`{alias}` → `{repo}`" if repo else f"`{alias}` (bundled)")
        if card.get("role") == "target" and "pair" in card:
            pairs.append(f"`--target {alias} --draft {card['pair']['alias']}`")
    lines = ["| family | aliases (→ Hugging Face repo) | pairs |", "|---|---|---|"]
    for kind, (names, pairs) in rows.items():
        if names:
            pairs_text = ", ".join(pairs) or "—"
            lines.append(f"| {FAMILY_NAMES[kind]} | {', '.join(names)} | {pairs_text} |")
    return "\n".join(lines) + "\n"


def is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() and any((path / w).is_file() for w in _WEIGHTS)


def hf_cache_root() -> Path:
    """The Hugging Face hub cache, as huggingface_hub itself resolves it (``$HF_HUB_CACHE``, else
    ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
    ``~/.cache/huggingface/hub``, read when huggingface_hub is first imported)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def find_in_hf_cache(repo_id: str, root: Path) -> Path | None:
    """The snapshot folder of ``repo_id`` in the cache ``root``: the revision ``refs/main``
    points at when it holds weights, else the most recently modified complete one (read through
    huggingface_hub's own cache functions)."""
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache
    from huggingface_hub.errors import CacheNotFound, CorruptedCacheException

    config = try_to_load_from_cache(repo_id, "config.json", cache_dir=root)
    if isinstance(config, str) and is_checkpoint(Path(config).parent):
        return Path(config).parent
    try:
        repos = scan_cache_dir(root).repos
    except (CacheNotFound, CorruptedCacheException, OSError):
        return None
    snapshots = [
        revision
        for repo in repos
        if repo.repo_id == repo_id and repo.repo_type == "model"
        for revision in repo.revisions
        if is_checkpoint(revision.snapshot_path)
    ]
    if not snapshots:
        return None
    return max(snapshots, key=lambda r: r.last_modified).snapshot_path


def _offline_reason() -> str | None:
    """None when a download may be tried, else why not."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in ("", "0", "false", "no"):
        return "HF_HUB_OFFLINE is set"
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
        return None
    except OSError:
        return "huggingface.co is unreachable"


def _download(repo_id: str) -> Path | None:
    from huggingface_hub import snapshot_download

    text = ["*.json", "tokenizer*", "*.model"]
    path = Path(snapshot_download(repo_id, allow_patterns=text + ["*.safetensors"]))
    if not is_checkpoint(path):  # repos that ship only PyTorch .bin weights
        path = Path(snapshot_download(repo_id, allow_patterns=text + ["pytorch_model*.bin"]))
    return path if is_checkpoint(path) else None


def fetch_command(repo_id: str | None, card: dict | None) -> str:
    if card and card.get("fetch_command"):
        return card["fetch_command"]
    return f"hf download {repo_id}" if repo_id else "(no download source is known)"


def resolve(name_or_path: str | os.PathLike) -> Resolved:
    """Find the checkpoint folder for an alias, a directory or a cached repo id."""
    name = str(name_or_path)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise MissingWeightsError(f"{path} has no config.json; it is not a checkpoint folder")
        if not is_checkpoint(path):
            raise MissingWeightsError(
                f"{path} has a config.json but no weights (looked for {', '.join(_WEIGHTS)})"
            )
        return Resolved(name, path, None)
    card = read_card(name) if re.fullmatch(r"[\w.-]+", name) else None
    if card is not None:
        repo_id = card.get("repo_id")
    elif _REPO_ID.fullmatch(name):
        repo_id = name
    else:
        raise UnknownModelError(
            f"unknown model {name!r}: not a directory, not a Hugging Face repo id (org/name), and "
            f"not one of the known aliases {known_aliases()} (cards in {MODELS_DIR})"
        )
    searched = []
    alias = name if card is not None else repo_id.replace("/", "--")
    if os.environ.get("ASPS_MODELS_DIR"):
        candidate = Path(os.environ["ASPS_MODELS_DIR"]).expanduser() / alias
        searched.append(f"$ASPS_MODELS_DIR/{alias} = {candidate}")
        if is_checkpoint(candidate):
            return Resolved(name, candidate, card)
    else:
        searched.append("$ASPS_MODELS_DIR/<alias> (ASPS_MODELS_DIR is not set)")
    if card is not None:
        searched.append(f"bundled checkpoint {MODELS_DIR / name}")
        if is_checkpoint(MODELS_DIR / name):
            return Resolved(name, MODELS_DIR / name, card)
    if repo_id:
        root = hf_cache_root()
        searched.append(f"Hugging Face cache {root / ('models--' + repo_id.replace('/', '--'))}")
        found = find_in_hf_cache(repo_id, root)
        if found is not None:
            return Resolved(name, found, card)
        offline = _offline_reason()
        if offline is None:
            found = _download(repo_id)
            if found is not None:
                return Resolved(name, found, card)
            searched.append(f"download of {repo_id} from the Hugging Face Hub (no weights there)")
        else:
            searched.append(f"download from the Hugging Face Hub skipped: {offline}")
    where = "\n  - ".join(searched)
    raise MissingWeightsError(
        f"no weights for {name!r}"
        + (f" ({repo_id})" if repo_id and repo_id != name else "")
        + f"; fetch them with: {fetch_command(repo_id, card)}\n"
        + f"Looked in:\n  - {where}\n"
        + f"Or put a checkpoint folder at $ASPS_MODELS_DIR/{alias}, or pass its path."
    )


def check_card(card: dict | None, hf_config: dict, path: Path) -> None:
    """The loaded config must have the architecture numbers the card promises."""
    if not card:
        return
    bad = {
        k: (v, hf_config.get(k))
        for k, v in card.get("architecture", {}).items()
        if hf_config.get(k) != v
    }
    if bad:
        detail = ", ".join(f"{k}: card {v[0]}, checkpoint {v[1]}" for k, v in bad.items())
        raise ValueError(
            f"checkpoint {path} does not match the card of {card.get('alias')!r} ({detail})"
        )
