"""A float64 NumPy reference of an EAGLE-3 draft head, written from the EAGLE-3 layout on disk
(``config.json`` + ``model.safetensors``, read with ``safetensors.numpy``) and the target's
features from transformers (``output_hidden_states``), independent of ``asps_jax``.

The head is one Llama decoder layer whose input at entry t is ``[rms(embed[x_t]) * input_norm;
rms(h_t) * hidden_norm]`` (2E wide), with its own causal KV over all earlier entries; its output
hidden vector through ``norm`` and ``lm_head`` gives draft logits over the draft vocabulary,
placed on the target's vocabulary at ``d2t`` (probability 0 elsewhere). After a text of m + 1
tokens (m committed, the root last) the entries are ``(fc @ f_t, x_{t+1})`` for t = 0 .. m - 1
(``f_t`` the target's streams entering the feature layers at position t, concatenated), and the
first draft law is the last entry's; each deeper token adds an entry of the previous entry's
output hidden vector and that token.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import torch

NAMES = {
    "fc": "fc.weight",
    "input_norm": "midlayer.input_layernorm.weight",
    "hidden_norm": "midlayer.hidden_norm.weight",
    "wq": "midlayer.self_attn.q_proj.weight",
    "wk": "midlayer.self_attn.k_proj.weight",
    "wv": "midlayer.self_attn.v_proj.weight",
    "wo": "midlayer.self_attn.o_proj.weight",
    "post_norm": "midlayer.post_attention_layernorm.weight",
    "w_gate": "midlayer.mlp.gate_proj.weight",
    "w_up": "midlayer.mlp.up_proj.weight",
    "w_down": "midlayer.mlp.down_proj.weight",
    "norm": "norm.weight",
    "lm_head": "lm_head.weight",
}


def rms(x, w, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, position: int, theta: float):
    """Hugging Face's rotate-half RoPE of ``x [heads, H]`` at ``position``."""
    H = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, H, 2, dtype=np.float64) / H)
    angles = np.concatenate([position * inv, position * inv])
    rotated = np.concatenate([-x[..., H // 2 :], x[..., : H // 2]], axis=-1)
    return x * np.cos(angles) + rotated * np.sin(angles)


def silu(x):
    return x / (1.0 + np.exp(-x))


class Head:
    """The head of an EAGLE-3 folder for a target whose embedding is ``embed [V, E]``."""

    def __init__(self, folder, embed):
        from safetensors.numpy import load_file

        folder = Path(folder)
        self.config = json.loads((folder / "config.json").read_text())
        tensors = load_file(folder / "model.safetensors")
        self.w = {ours: tensors[name].astype(np.float64) for ours, name in NAMES.items()}
        self.embed = np.asarray(embed, np.float64)
        offsets = tensors["d2t"].astype(np.int64)
        self.d2t = np.arange(offsets.size) + offsets  # the target id of each draft id
        self.layers = list(self.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])

    def entries(self, hiddens, tokens):
        """Feed entries one at a time (entry t: hidden ``hiddens[t]``, or, where it is None,
        the previous entry's output hidden vector; token ``tokens[t]``) at positions 0, 1, ...:
        the draft logits of every entry, ``[T, V_d]``."""
        c, w = self.config, self.w
        eps, theta = c["rms_norm_eps"], c["rope_theta"]
        nh, kvh = c["num_attention_heads"], c["num_key_value_heads"]
        H = c["head_dim"]
        keys, values, logits, outs, out = [], [], [], [], None
        for t, (h, x) in enumerate(zip(hiddens, tokens)):
            h = out if h is None else np.asarray(h, np.float64)
            a = np.concatenate(
                [rms(self.embed[x], w["input_norm"], eps), rms(h, w["hidden_norm"], eps)]
            )
            q = rope((w["wq"] @ a).reshape(nh, H), t, theta)
            keys.append(rope((w["wk"] @ a).reshape(kvh, H), t, theta))
            values.append((w["wv"] @ a).reshape(kvh, H))
            k, v = np.stack(keys), np.stack(values)  # [t + 1, KVH, H]
            group = nh // kvh
            heads = []
            for i in range(nh):
                scores = k[:, i // group] @ q[i] / np.sqrt(H)
                p = np.exp(scores - scores.max())
                heads.append((p / p.sum()) @ v[:, i // group])
            h2 = h + w["wo"] @ np.concatenate(heads)
            g = rms(h2, w["post_norm"], eps)
            out = h2 + w["w_down"] @ (silu(w["w_gate"] @ g) * (w["w_up"] @ g))
            logits.append(w["lm_head"] @ rms(out, w["norm"], eps))
            outs.append(out)
        return np.stack(logits), np.stack(outs)

    def law(self, logits_d):
        """The draft law over the target's vocabulary from draft logits ``[V_d]``."""
        p = np.exp(logits_d - logits_d.max())
        out = np.zeros(self.embed.shape[0])
        out[self.d2t] = p / p.sum()
        return out

    def fused(self, features):
        """``fc`` of the features ``[T, F]``: the hidden inputs of the prompt's entries."""
        return np.asarray(features, np.float64) @ self.w["fc"].T

    def draft_law(self, features, text, path=()):
        """The law of the draft token after ``text`` (its last token the root) and the drafted
        ``path``; ``features[t]``: the target's features at position t of ``text``."""
        m = len(text) - 1
        if m == 0:  # a one-token prompt: its entry has zero features
            hiddens = [np.zeros(self.w["fc"].shape[0])]
        else:
            hiddens = list(self.fused(features[:m]))
        tokens = list(text[1:]) if m else list(text)
        logits, _ = self.entries(hiddens + [None] * len(path), tokens + list(path))
        return self.law(logits[-1])


def hf_features(hf, text, layers) -> np.ndarray:
    """The target's streams entering ``layers`` at every position of ``text`` (transformers'
    ``hidden_states[i]``), concatenated: ``[T, len(layers) * E]`` float64."""
    with torch.no_grad():
        states = hf(torch.tensor([list(text)]), output_hidden_states=True).hidden_states
    return np.concatenate([states[i][0].double().numpy() for i in layers], axis=-1)


def tabular_laws(head: Head, hf, prompt, depth: int) -> list[np.ndarray]:
    """The head's draft laws after ``prompt`` in tests/tabular.py's layout: ``laws[i][x_1..x_i]``
    is the law of draft token i + 1 after the drafted ``x_1..x_i``."""
    features = hf_features(hf, prompt, head.layers)
    vocab = head.embed.shape[0]
    out = []
    for i in range(depth):
        law = np.stack(
            [head.draft_law(features, prompt, x) for x in itertools.product(range(vocab), repeat=i)]
        )
        out.append(law.reshape((vocab,) * i + (vocab,)))
    return out
