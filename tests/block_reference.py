"""A float64 NumPy reference of a block drafter, written from its files on disk (``config.json`` +
``model.safetensors``, read with ``safetensors.numpy``) and the target's features from transformers
(``output_hidden_states``), independent of ``asps_jax``.

After a text of m + 1 tokens (m committed, the root last) the context is, at each committed position
t < m, ``c_t = rms(fc @ f_t) * hidden_norm`` (``f_t`` the target's streams entering the feature
layers at t, concatenated); layer l's context keys are ``rope(wk_l @ c_t, t)`` and values ``wv_l @
c_t``. The block is the root's embedding and the N mask embeddings at positions m .. m + N, each
normalised (``rms(.) * embed_norm``) plus ``c_{m-1}`` (nothing when m = 0); each of its entries
attends to every context key and every block entry, through a Llama layer (pre-norm attention, then
SiLU-gated MLP), per layer. Entry i >= 1's output h_i gives the draft logits of the token at
position m + i, placed on the target's vocabulary at ``d2t`` (probability 0 elsewhere), through the
readout (``block_config.readout``). Position-wise (absent or ``"position"``): ``lm_head @ rms(h_i) *
norm``. Recurrent: with x_0 the root, x_1 .. the drafted tokens and o_0 = 0,
``o_i = h_i + W_out @ silu(W_in @ [h_i, rms(embed[x_{i-1}]) * readout_norm, o_{i-1}])`` and the
logits ``lm_head @ rms(o_i) * norm``: depth i's law depends on the drafted path before it.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
from head_reference import hf_features, rms, rope, silu

LAYER = {
    "input_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "post_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}


class Block:
    """The block drafter of a folder for a target whose embedding is ``embed [V, E]``."""

    def __init__(self, folder, embed):
        from safetensors.numpy import load_file

        folder = Path(folder)
        self.config = json.loads((folder / "config.json").read_text())
        t = {k: v.astype(np.float64) for k, v in load_file(folder / "model.safetensors").items()}
        self.t = t
        self.layers = [
            {ours: t[f"layers.{i}.{name}"] for ours, name in LAYER.items()}
            for i in range(self.config["num_hidden_layers"])
        ]
        self.embed = np.asarray(embed, np.float64)
        self.d2t = np.arange(t["d2t"].size) + t["d2t"].astype(np.int64)
        self.feature_layers = list(self.config["block_config"]["target_layer_ids"])
        self.recurrent = self.config["block_config"].get("readout", "position") == "recurrent"

    def logits(self, features, root: int, drafted=None):
        """The draft logits ``[N, V_d]`` after ``m = len(features)`` committed positions and the
        root token at position m; depth i's after the ``drafted`` tokens before it (a recurrent
        readout needs the N - 1 of them)."""
        return self.readout(self.states(features, root), [root, *(drafted or ())])

    def readout(self, states, path):
        """The logits of the block's output states ``[N, E]``: depth i's through the path's token
        i - 1 (``path[0]`` the root) when the readout is recurrent."""
        t, eps = self.t, self.config["rms_norm_eps"]
        head = lambda o: t["lm_head.weight"] @ rms(o, t["norm.weight"], eps)  # noqa: E731
        if not self.recurrent:
            return np.stack([head(h) for h in states])
        out, o = [], np.zeros(states.shape[1])
        for h, token in zip(states, path, strict=True):
            a = rms(self.embed[token], t["readout.embed_norm.weight"], eps)
            u = np.concatenate([h, a, o])
            o = h + t["readout.fc_out.weight"] @ silu(t["readout.fc_in.weight"] @ u)
            out.append(head(o))
        return np.stack(out)

    def states(self, features, root: int):
        """The block's output states ``[N, E]`` (entries 1..N, before the readout)."""
        c, t = self.config, self.t
        eps, theta = c["rms_norm_eps"], c["rope_theta"]
        nh, kvh, H = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        m = len(features)
        ctx = [rms(t["fc.weight"] @ f, t["hidden_norm.weight"], eps) for f in features]
        x = np.concatenate([self.embed[root][None], t["mask_embedding"]])
        x = rms(x, t["embed_norm.weight"], eps) + (ctx[-1] if m else 0.0)
        for w in self.layers:
            keys = [rope((w["wk"] @ a).reshape(kvh, H), s, theta) for s, a in enumerate(ctx)]
            values = [(w["wv"] @ a).reshape(kvh, H) for a in ctx]
            h = [rms(row, w["input_norm"], eps) for row in x]
            keys += [rope((w["wk"] @ a).reshape(kvh, H), m + j, theta) for j, a in enumerate(h)]
            values += [(w["wv"] @ a).reshape(kvh, H) for a in h]
            k, v = np.stack(keys), np.stack(values)  # [m + N + 1, KVH, H]
            out = []
            for j, a in enumerate(h):
                q = rope((w["wq"] @ a).reshape(nh, H), m + j, theta)
                heads = []
                for i in range(nh):
                    scores = k[:, i // (nh // kvh)] @ q[i] / np.sqrt(H)
                    p = np.exp(scores - scores.max())
                    heads.append((p / p.sum()) @ v[:, i // (nh // kvh)])
                r = x[j] + w["wo"] @ np.concatenate(heads)
                g = rms(r, w["post_norm"], eps)
                out.append(r + w["w_down"] @ (silu(w["w_gate"] @ g) * (w["w_up"] @ g)))
            x = np.stack(out)
        return x[1:]

    def placed(self, logits_d):
        """Draft logits placed on the target's vocabulary (``-inf`` outside ``d2t``)."""
        out = np.full(self.embed.shape[0], -np.inf)
        out[self.d2t] = logits_d
        return out

    def laws(self, hf, text, warp=None, drafted=None):
        """The N draft laws after ``text`` (its last token the root; depth i's after the
        ``drafted`` tokens before it), through ``warp`` (a function of placed logits; default
        softmax)."""
        m = len(text) - 1
        features = hf_features(hf, text, self.feature_layers)[:m]
        logits = self.logits(features, int(text[-1]), drafted)
        return np.stack([(warp or _softmax)(self.placed(row)) for row in logits])


def _softmax(logits):
    p = np.exp(logits - logits.max())
    return p / p.sum()


def tabular_laws(block: Block, hf, prompt, depth: int, warp=None) -> list[np.ndarray]:
    """The drafter's laws after ``prompt`` in tests/tabular.py's layout: ``laws[i][x_1..x_i]`` is
    the law of draft token i + 1 after the drafted ``x_1..x_i`` (position-wise: position i's law,
    whatever they are)."""
    vocab = block.embed.shape[0]
    m = len(prompt) - 1
    states = block.states(hf_features(hf, prompt, block.feature_layers)[:m], int(prompt[-1]))
    out = []
    for i in range(depth):
        laws = []
        for drafted in itertools.product(range(vocab), repeat=i):
            path = [int(prompt[-1]), *drafted]
            row = block.readout(states[: i + 1], path)[i]
            laws.append((warp or _softmax)(block.placed(row)))
        out.append(np.stack(laws).reshape((vocab,) * i + (vocab,)))
    return out
