"""A family's Hugging Face tensor table: one ``HFTensor`` per HF name, owning its layout transform.

Every family declares ``HF_TENSORS``, a tuple of :class:`HFTensor`; the loader reads and writes
checkpoints through it alone, so no family's names are known outside its module. A transform maps
one HF tensor (one layer's slice of it) to one or more of our parameters and back:

=========  =====================  ==========================================================
kind       HF layout              ours (``n_in`` leading input axes, then the output axes)
=========  =====================  ==========================================================
copy       same shape as ours     embeddings, norms, position tables
linear     ``[n*O, I]``           ``torch.nn.Linear`` computes ``x @ W.T``; we store ``[in, out]``
conv1d     ``[I, n*O]``           GPT-2's ``Conv1D`` computes ``x @ W``: already ``[in, out]``
vector     ``[n*O]``              biases (our shape ``[out...]``, e.g. ``[heads, head_dim]``)
=========  =====================  ==========================================================

``I`` is the product of our first ``n_in`` axes, ``O`` of the rest; ``n`` is the number of our
parameters the HF tensor holds side by side along its output axis (GPT-2's fused ``c_attn`` is
``[E, 3E]`` = q | k | v: ``params=("layers/wq", "layers/wk", "layers/wv")``). A ``tied`` entry
(the LM head of a model that ties it to the embedding) is dropped when the config has no such
parameter; the HF tensor, if an exporter wrote it anyway, is then ignored.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

KINDS = ("copy", "linear", "conv1d", "vector")


@dataclasses.dataclass(frozen=True)
class HFTensor:
    name: str  # HF name; "{i}" is the layer index (slot i of our stacked leading L axis)
    params: tuple[str, ...]  # our parameter paths, e.g. ("layers/wq",); several = split-into-n
    kind: str = "copy"
    n_in: int = 1  # input axes of ours (linear / conv1d), e.g. 2 for wo [heads, head_dim, E]
    tied: bool = False

    def __post_init__(self):
        if isinstance(self.params, str):
            object.__setattr__(self, "params", (self.params,))
        if self.kind not in KINDS:
            raise ValueError(f"HFTensor {self.name}: kind {self.kind!r} is not one of {KINDS}")
        if len(self.params) > 1 and self.kind == "copy":
            raise ValueError(f"HFTensor {self.name}: a split needs linear, conv1d or vector")

    @property
    def keys(self) -> tuple[tuple[str, ...], ...]:
        return tuple(tuple(p.split("/")) for p in self.params)

    def _io(self, inner: tuple[int, ...]) -> tuple[int, int]:
        n_in = 0 if self.kind == "vector" else self.n_in
        return math.prod(inner[:n_in]), math.prod(inner[n_in:])

    def hf_shape(self, inner: tuple[int, ...]) -> tuple[int, ...]:
        """The HF shape for our per-layer shape ``inner`` (every split part has that shape)."""
        if self.kind == "copy":
            return tuple(inner)
        n = len(self.params)
        i, o = self._io(inner)
        return {"linear": (n * o, i), "conv1d": (i, n * o), "vector": (n * o,)}[self.kind]

    def to_ours(self, array: np.ndarray, inner: tuple[int, ...]) -> list[np.ndarray]:
        """One HF array (already shape-checked) -> our ``len(params)`` arrays of shape ``inner``."""
        if self.kind == "copy":
            return [array]
        n = len(self.params)
        i, o = self._io(inner)
        if self.kind == "vector":
            return [part.reshape(inner) for part in array.reshape(n, o)]
        if self.kind == "linear":  # [n*O, I] -> n x [I, O]: the transpose nn.Linear implies
            return [part.T.reshape(inner) for part in array.reshape(n, o, i)]
        return [array.reshape(i, n, o)[:, j].reshape(inner) for j in range(n)]  # conv1d

    def to_hf(self, parts: list[np.ndarray]) -> np.ndarray:
        """Our arrays (one layer's slices) -> the HF array."""
        if self.kind == "copy":
            return parts[0]
        i, o = self._io(parts[0].shape)
        if self.kind == "vector":
            return np.concatenate([p.reshape(o) for p in parts])
        if self.kind == "linear":
            return np.concatenate([p.reshape(i, o).T for p in parts], axis=0)
        return np.concatenate([p.reshape(i, o) for p in parts], axis=1)


def expand(table, param_shapes: dict, num_layers: int) -> tuple[dict, set[str]]:
    """``({hf name: (entry, layer or None)}, tied names to ignore)`` for one config.

    Entries whose parameters this config does not have are left out (e.g. OPT's ``project_in``
    when ``word_embed_proj_dim == hidden_size``): a checkpoint holding them is then refused as
    holding unexpected tensors, except for ``tied`` entries, whose tensor is ignored.
    """
    out, ignored = {}, set()
    for entry in table:
        present = [_has(param_shapes, k) for k in entry.keys]
        if not all(present):
            if any(present):
                raise ValueError(f"HFTensor {entry.name}: only some of {entry.params} exist")
            if entry.tied:
                ignored.add(entry.name)
            continue
        if "{i}" in entry.name:
            for i in range(num_layers):
                out[entry.name.format(i=i)] = (entry, i)
        else:
            out[entry.name] = (entry, None)
    return out, ignored


def _has(tree: dict, keys: tuple[str, ...]) -> bool:
    for k in keys:
        if not isinstance(tree, dict) or k not in tree:
            return False
        tree = tree[k]
    return True
