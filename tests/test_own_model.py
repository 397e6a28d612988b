"""A user's own JAX model driving ``sample``: the Flax NNX example of docs/api.md (run from the
docs), greedy and two-token-law parity against the module's own full forward (no cache, causal
mask: independent of our cache, tree and commit plumbing), and the contract errors."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats as sps_stats

import asps_jax
from asps_jax.kv_cache import KVBlock, init_cache
from asps_jax.models import ContractError, own_model

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"
MARK = "<!-- own-model example: tests/test_own_model.py runs this block -->"
V = 12
ROWS = 3000


def docs_example() -> dict:
    text = DOC.read_text(encoding="utf-8")
    block = re.search(re.escape(MARK) + r"\s*```python\n(.*?)```", text, re.S)
    assert block, "the own-model example block is missing from docs/api.md"
    namespace: dict = {}
    exec(compile(block.group(1), str(DOC), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def example():
    return docs_example()


def full_forward_logits(module, seq) -> np.ndarray:
    """The module on the whole sequence, no cache, a causal mask: the reference."""
    T = len(seq)
    tokens = jnp.asarray([seq], jnp.int32)
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    mask = jnp.tril(jnp.ones((T, T), bool))[None]
    logits, _ = module(tokens, pos, mask, None)
    return np.asarray(logits[0], np.float64)


def greedy(module, prompt, n) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(full_forward_logits(module, seq)[-1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.slow
def test_docs_example_runs_and_greedy_matches(example):
    out = example["out"]
    assert np.asarray(out.tokens).shape == (2, 8) and np.asarray(out.lengths).tolist() == [8, 8]
    target, draft = example["target"], example["draft"]
    module = example["TinyLM"](12, 32, 2, 8, rngs=nnx.Rngs(0))  # the target's weights again
    prompts = [[1, 5, 3], [2]]
    expected = [greedy(module, p, 8) for p in prompts]
    for method in ("asps", "ar"):  # asps: the example's compiled loop, at temperature 0
        got = asps_jax.sample(
            target,
            draft,
            prompts,
            method=method,
            key=jax.random.key(0),
            max_new_tokens=8,
            num_draft_tokens=3,
            temperature=0.0,
        )
        assert np.asarray(got.tokens).tolist() == expected, method


@pytest.mark.slow
def test_own_model_follows_the_module_law(example):
    """Two-token law of ``sps`` with the NNX pair against the module's own softmax."""
    target, draft = example["target"], example["draft"]
    module = example["TinyLM"](12, 32, 2, 8, rngs=nnx.Rngs(0))
    prompt = [1, 5, 3]
    out = asps_jax.sample(
        target,
        draft,
        [prompt] * ROWS,
        method="sps",
        key=jax.random.key(3),
        max_new_tokens=2,
        num_draft_tokens=2,
        eos_token_id=-1,
    )
    tokens = np.asarray(out.tokens)

    def probs(seq):
        z = full_forward_logits(module, seq)[-1]
        e = np.exp(z - z.max())
        return e / e.sum()

    law = (probs(prompt)[:, None] * np.stack([probs(prompt + [x]) for x in range(V)])).ravel()
    counts = np.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V)
    expected = law * ROWS
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    assert sps_stats.chisquare(obs[keep], exp[keep]).pvalue > 1e-3


def _shapes(model, B=2, T=3, S=5):
    """``model.forward`` traced (not run) with a cache of S slots."""
    cache = init_cache(model.config, B, S)
    tokens = jnp.zeros((B, T), jnp.int32)
    mask = jnp.ones((B, T, S + T), bool)
    return jax.eval_shape(model.forward, model.params, tokens, tokens, mask, cache)


def _user(forward):
    return own_model(
        forward,
        {"w": jnp.ones((V, 4))},
        vocab_size=V,
        num_hidden_layers=1,
        num_key_value_heads=1,
        head_dim=4,
        max_position_embeddings=16,
    )


def _kv(params, tokens):
    x = params["w"][tokens][None, :, :, None, :]  # [1, B, T, 1, 4]
    return KVBlock(k=x, v=x)


@pytest.mark.parametrize(
    "forward, rule",
    [
        (lambda p, t, pos, m, c: (p["w"][t], _kv(p, t)), r"logits must be \[B, T, V\]"),
        (
            lambda p, t, pos, m, c: ((p["w"][t] @ p["w"].T).astype(jnp.bfloat16), _kv(p, t)),
            "logits must be float32",
        ),
        (lambda p, t, pos, m, c: (p["w"][t] @ p["w"].T, c), "returned a KVCache, i.e. wrote"),
        (
            lambda p, t, pos, m, c: (
                p["w"][t] @ p["w"].T,
                (jnp.zeros((1, 2, 1, 8, 4)), jnp.zeros((1, 2, 1, 8, 4))),
            ),
            r"cache's S slots: the cache was written",
        ),
        (lambda p, t, pos, m, c: p["w"][t] @ p["w"].T, r"must return \(logits, new_kv\)"),
    ],
)
def test_contract_errors_name_the_rule(forward, rule):
    with pytest.raises(ContractError, match=rule) as e:
        _shapes(_user(forward))
    assert "\n" not in str(e.value) and "forward contract" in str(e.value)
    good = _user(lambda p, t, pos, m, c: (p["w"][t] @ p["w"].T, _kv(p, t)))
    assert _shapes(good)[0].shape == (2, 3, V)


def test_nnx_module_writing_its_state_is_refused():
    class Caching(nnx.Module):  # keeps a cache in a Variable: the contract forbids it
        def __init__(self):
            self.w = nnx.Param(jnp.ones((V, 8)))
            self.kv = nnx.Variable(jnp.zeros((2, 3, 8)))

        def __call__(self, tokens, positions, mask, cache):
            x = self.w[...][tokens]
            self.kv.value = x
            kv = x.reshape(1, *tokens.shape, 2, 4)
            return (x @ self.w[...].T).astype(jnp.float32), KVBlock(k=kv, v=kv)

    model = asps_jax.models.nnx_model(
        Caching(),
        vocab_size=V,
        num_hidden_layers=1,
        num_key_value_heads=2,
        head_dim=4,
        max_position_embeddings=16,
    )
    with pytest.raises(ContractError, match="changed its own state"):
        _shapes(model)


@pytest.mark.parametrize(
    "param_axes, needle",
    [
        ({"w": ("vocab",)}, "param_axes: leaf 0 names 1 axes"),
        ({"x": ("vocab", "embed")}, "param_axes must have the structure of params"),
    ],
)
def test_param_axes_must_follow_the_params(param_axes, needle):
    with pytest.raises(ValueError, match=needle):
        own_model(
            lambda *a: None,
            {"w": jnp.ones((V, 4))},
            vocab_size=V,
            num_hidden_layers=1,
            num_key_value_heads=1,
            head_dim=4,
            max_position_embeddings=16,
            param_axes=param_axes,
        )


# The docs example on 8 fake CPU devices (a subprocess: the device count is fixed at JAX's start),
# its parameters placed by a user-given param_axes; greedy tokens equal one device's.
MESH_WORKER = """
import json, sys
sys.path.insert(0, {tests!r})
import jax, numpy as np
import asps_jax
from asps_jax import sharding
from test_own_model import docs_example
ns = docs_example()
axes = {{"embed": {{"embedding": ("vocab", "embed")}}, "pos": {{"embedding": (None, "embed")}},
        "qkv": {{"kernel": ("embed", "heads"), "bias": ("heads",)}},
        "out": {{"kernel": ("heads", "embed"), "bias": ("embed",)}},
        "head": {{"kernel": ("embed", "vocab"), "bias": ("vocab",)}}}}
target = ns["wrap"](ns["TinyLM"](12, 32, 2, 8, rngs=ns["nnx"].Rngs(0)), param_axes=axes)
draft = ns["wrap"](ns["TinyLM"](12, 16, 2, 8, rngs=ns["nnx"].Rngs(1)), param_axes=axes)
mesh = asps_jax.make_mesh("data=2,model=4")
placed = sharding.place_model_params(target, mesh)
out = asps_jax.sample(target, draft, [[1, 5, 3], [2]], method="asps", key=jax.random.key(0),
                      max_new_tokens=8, num_draft_tokens=3, temperature=0.0, mesh=mesh)
print(json.dumps({{"tokens": np.asarray(out.tokens).tolist(),
                  "head": str(placed["head"]["kernel"].sharding.spec),
                  "devices": len(jax.devices())}}))
"""


@pytest.mark.slow
def test_own_model_on_a_mesh_by_param_axes(example):
    import json
    import os
    import subprocess

    from subprocess_env import xla_flags

    tests = str(Path(__file__).resolve().parent)
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    env["XLA_FLAGS"] = xla_flags("--xla_force_host_platform_device_count=8")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(tests).parent), env.get("PYTHONPATH", "")])
    worker = subprocess.Popen(
        [sys.executable, "-c", MESH_WORKER.format(tests=tests)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    local = asps_jax.sample(  # the example's compiled loop, at temperature 0
        example["target"],
        example["draft"],
        [[1, 5, 3], [2]],
        method="asps",
        key=jax.random.key(0),
        max_new_tokens=8,
        num_draft_tokens=3,
        temperature=0.0,
    )
    stdout, stderr = worker.communicate(timeout=600)
    assert worker.returncode == 0, stderr[-3000:]
    got = json.loads(stdout.strip().splitlines()[-1])
    assert got["devices"] == 8 and "model" in got["head"]
    assert got["tokens"] == np.asarray(local.tokens).tolist()
