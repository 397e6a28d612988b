"""Bad input to the Python API (``asps_jax.sample``, ``sampler.prepare``): every bad value is a
one-line ``ValueError`` raised before anything is compiled or allocated, and out-of-range values
that have a meaning keep it (``top_k`` beyond the vocabulary keeps every token)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from hf_checkpoints import load_tiny_pair, write_tiny_llama
from subprocess_env import xla_flags

import asps_jax
from asps_jax import drafters, footprint, plan, sampler, trees
from asps_jax.controls import penalties
from asps_jax.controls.processors import SamplingParams
from asps_jax.drafters import self_layers
from asps_jax.verify import registry

VOCAB = 12
PROMPT = [1, 5, 3]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_tiny_pair(tmp_path_factory.mktemp("hostile"), VOCAB)


def _prepare(pair, **kwargs):
    target, draft = pair
    args = dict(prompts=[PROMPT], key=jax.random.key(0), max_new_tokens=4, method="asps")
    args.update(kwargs)
    return sampler.prepare(target, args.pop("draft", draft), args.pop("prompts"), **args)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        # A negative length used to slice the row silently from the end.
        (dict(prompts=np.array([[1, 2, 3]]), prompt_lengths=[-1]), "prompt_lengths must lie"),
        (dict(prompts=np.array([[1, 2, 3]]), prompt_lengths=[4]), "prompt_lengths must lie"),
        # Text used to fail inside int() with "invalid literal".
        (dict(prompts="KING HENRY:"), "token ids, not text"),
        (dict(prompts=["KING HENRY:"]), "token ids, not text"),
        (dict(prompts=[[1.5, 2]]), "non-integer"),
        # 1e308 passed the finite check and overflowed to inf in float32.
        (dict(temperature=1e308), "temperature"),
        (dict(draft_temperature=1e300), "draft_temperature"),
        (dict(top_k=2.5), "top_k"),
        (dict(eos_token_id=VOCAB), "eos_token_id"),
        (dict(eos_token_id=[2, VOCAB + 5]), "eos_token_id"),
        (dict(method="ar", num_drafts=2), "num_drafts must be 1"),
        # Multi-draft options are checked by the registry before anything is traced.
        (dict(method="is", num_drafts=2, levels=0), "levels must be an int >= 1"),
        (dict(method="specinfer", num_drafts=2, tail="block"), "tail must be one of"),
        (dict(method="is_bv", num_drafts=2, beta=1.0), "unknown option"),
        (dict(num_draft_tokens=64), "num_draft_tokens=64 does not fit"),
        # Used to be accepted and fail ~25 s later with a 596 GiB allocation traceback.
        (dict(method="specinfer", num_drafts=2**20, num_draft_tokens=60), "--num-drafts"),
        (dict(prompts=[PROMPT] * 2**21, max_new_tokens=50), "--batch-size"),
        # A branching draft tree: only for the tree methods, and its own sizes.
        (dict(tree=(2, 2)), "method 'asps' verifies chains"),
        (dict(method="tv", tree=(2, 0)), "every width >= 1"),
        (dict(method="tv", tree=()), "every width >= 1"),
        (dict(method="tv", tree="22"), "every width >= 1"),
        (dict(method="tv_wr", tree=(2, 2), num_drafts=2), "num_drafts=2 contradicts"),
        (dict(method="is_bv", tree=(2, 2), num_draft_tokens=3), "num_draft_tokens=3 contradicts"),
        (dict(method="is_bv", tree=(2, 2), rule="lp"), "rule must be one of"),
    ],
)
@pytest.mark.slow
def test_bad_input_is_a_one_line_error(pair, kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        _prepare(pair, **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(method="nope"), "unknown method"),
        (dict(method="asps", num_drafts=2), "single draft chain"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(num_draft_tokens=0), "num_draft_tokens"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(prompts=[[]]), "empty"),
        (dict(prompts=[[1, VOCAB]]), "outside"),
        (dict(prompts=[list(range(VOCAB)) * 5]), "context"),
        (dict(draft=None), "needs a draft"),
    ],
)
def test_bad_input_to_sample_is_a_clear_error(pair, kwargs, match):
    """Through ``asps_jax.sample`` itself (6 new tokens: the long prompt passes the context)."""
    target, draft = pair
    args = dict(
        target=target,
        draft=draft,
        prompts=[PROMPT],
        key=jax.random.key(0),
        max_new_tokens=6,
        method="asps",
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        asps_jax.sample(**args)


def test_mismatched_vocabularies_are_refused(pair, tmp_path):
    target, _ = pair
    write_tiny_llama(tmp_path / "other", seed=3, vocab_size=VOCAB + 4)
    other = asps_jax.load_model(str(tmp_path / "other"))
    with pytest.raises(ValueError, match="vocab"):
        asps_jax.sample(target, other, [PROMPT], key=jax.random.key(0), max_new_tokens=2)


def test_single_draft_error_names_only_methods_sample_accepts(pair):
    with pytest.raises(ValueError, match="single draft chain") as info:
        _prepare(pair, method="sps", num_drafts=2)
    message = str(info.value)
    for method in registry.names("drafts", sample=True):  # specinfer_wor too (issue 65)
        assert method in message


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(draft="lookup"), r"^draft='lookup': method 'specinfer_wor' draws its K root drafts "),
        (dict(draft_stop="confidence:0.5"), r"^draft_stop: .* 'specinfer_wor' draws its K roots "),
    ],
)
def test_specinfer_wor_refuses_what_cannot_draw_distinct_roots(pair, kwargs, match):
    """Point-mass lookup chains and confidence-stopped chains cannot be one node's distinct
    siblings: one line naming the argument (issue 65)."""
    with pytest.raises(ValueError, match=match) as info:
        _prepare(pair, method="specinfer_wor", num_drafts=2, **kwargs)
    assert "\n" not in str(info.value)


def test_size_estimate_counts_the_caches_and_the_tree():
    class Config:  # llama-7b
        num_hidden_layers, num_key_value_heads, head_dim, vocab_size = 32, 32, 128, 32000
        num_attention_heads, hidden_size, intermediate_size = 32, 4096, 11008

    # 2000 prompt tokens + 45 new + 1 + 2 = 2048 slots; 2 (k, v) * 32 layers * 32 heads * 128
    # dims * 2 bytes = 512 KiB per slot and row.
    parts = footprint.estimate(
        Config, None, method="ar", batch=1, prompt_len=2000, max_new_tokens=45,
        num_draft_tokens=1, num_drafts=1, target_itemsize=2,
    )  # fmt: skip
    assert parts["kv caches"] == 2048 * 512 * 1024
    # Nodes, draft replicas (leaves) and the widest level: 1 + 4 + 8 + 8 + 8, 8, 8.
    assert footprint.tree_shape(8, 4, (4, 2, 1, 1)) == (29, 8, 8)
    assert footprint.tree_shape(3, 4) == (13, 3, 3)
    assert footprint.tree_shape(0, 0, (1000, 1000, 1000)) == (1001001001, 10**9, 10**9)


class _Llama7B:
    num_hidden_layers, num_key_value_heads, head_dim, vocab_size = 32, 32, 128, 32000
    num_attention_heads, hidden_size, intermediate_size = 32, 4096, 11008


class _Llama7BFirst2(_Llama7B):  # draft="self:2"
    num_hidden_layers = 2


def test_size_estimate_counts_what_a_lookup_allocates():
    """A prompt lookup (no draft model) scores a tree of 1 + K*n nodes and keeps its laws: not the
    AR estimate it used to be given. K = 4 chains of n = 8: 33 nodes of V = 32000 laws."""
    common = dict(batch=8, prompt_len=10, max_new_tokens=28, target_itemsize=2)
    ar = footprint.estimate(_Llama7B, None, method="ar", num_draft_tokens=1, num_drafts=1, **common)
    lookup = footprint.estimate(
        _Llama7B, drafters.Lookup(), method="specinfer", num_draft_tokens=8, num_drafts=4,
        **common,
    )  # fmt: skip
    nodes = 1 + 4 * 8
    # Target logits and laws of every node, the draft laws by node, the point masses [B, K, n, V].
    assert lookup["step laws"] >= 4 * 8 * (5 * nodes + 2 * 4 * 8) * 32000
    assert lookup["target forward"] > ar["target forward"]  # 33 queries, not a 16-token prompt
    assert lookup["tree masks"] >= 8 * nodes**2 and lookup["draft rollout"] > 0
    # The same cache (16 + 28 + 8 + 2 = 54 slots -> 64; AR: 47 -> 64): no draft cache.
    assert lookup["kv caches"] == ar["kv caches"] == 8 * 64 * 2 * 32 * 32 * 128 * 2
    assert sum(lookup.values()) > sum(ar.values()) + 4 * 8 * nodes * 32000 * 4


def test_size_estimate_of_a_shared_self_draft_counts_scratch_not_a_cache():
    """draft="self:2" reading the target's cache: no draft cache of its own, the target's cache
    n*K slots longer (the rollout's scratch); a self-draft that keeps its own cache (a sliding
    window among its layers) counts the draft cache of B*K replicas."""
    common = dict(
        method="specinfer", batch=1, prompt_len=1000, max_new_tokens=30, num_draft_tokens=8,
        num_drafts=4, target_itemsize=2, draft_itemsize=2,
    )  # fmt: skip
    shared = footprint.estimate(_Llama7B, drafters.SharedLayers(_Llama7BFirst2), **common)
    own = footprint.estimate(_Llama7B, drafters.ModelDraft(_Llama7BFirst2), **common)
    slot = 2 * 32 * 32 * 128 * 2  # bytes per slot of the target (k, v; layers, heads, dims)
    # 1000 -> 1008 prompt + 30 + 8 + 2 = 1048 (+ 32 scratch = 1080) -> 1088 slots either way.
    assert shared["kv caches"] == 1088 * slot
    assert own["kv caches"] == 1088 * slot + 4 * 1088 * slot // 16  # 4 replicas of 2 layers
    assert shared["draft rollout"] < own["draft rollout"]  # no prefill of the draft
    assert sum(shared.values()) < sum(own.values())


def test_check_memory_reads_the_drafter(pair, monkeypatch):
    """check_memory (what sample and the CLI call) passes the drafter on: "lookup" is estimated
    as a lookup, not as AR; "self:1" of a target whose layers can share the cache counts no draft
    cache, and one that cannot (as with a sliding window) counts one."""
    target, _ = pair
    shape = dict(batch=1, prompt_len=3, max_new_tokens=4, num_draft_tokens=4, num_drafts=2)
    ar = sampler.check_memory(target, None, **{**shape, "num_drafts": 1}, method="ar")
    lookup = sampler.check_memory(target, "lookup", **shape, method="specinfer")
    assert lookup == sampler.check_memory(
        target, None, **shape, method="specinfer", drafter="lookup"
    )
    assert lookup["step laws"] > ar["step laws"] and lookup["kv caches"] == ar["kv caches"]
    shared = sampler.check_memory(target, "self:1", **shape, method="specinfer")
    monkeypatch.setattr(self_layers, "can_share_cache", lambda config: False)
    own = sampler.check_memory(target, "self:1", **shape, method="specinfer")
    assert shared["kv caches"] < own["kv caches"]


def _never_built(*_):
    raise AssertionError("the tree was built before the size check")


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        # Used to build the tree (10^9 nodes) before any check: 22 GB, killed by the kernel.
        (dict(method="tv", tree=(1000, 1000, 1000)), "lower tree (--tree)"),
        # Passed the old estimate, which left out the N x N masks: 37 GiB allocations 70-90 s on.
        (dict(method="tv_wr", tree=(100000,)), "lower tree (--tree)"),
        (dict(method="tv_wr", tree=(20000,)), "lower tree (--tree)"),
        (dict(method="tv_wr", num_drafts=100000, num_draft_tokens=1), "num_drafts (--num-drafts)"),
        # The level race of 1000 walkers: [W, W, levels, W / 2] floats per node, 60 GiB.
        (dict(method="is_bv", tree=(1000,)), "lower tree (--tree)"),
    ],
)
def test_huge_trees_are_refused_before_they_are_built(pair, monkeypatch, kwargs, needle):
    """``sample`` refuses from the shapes alone (the tree builders are never called), on a 16 GiB
    device; no wall-clock bound, which would depend on the machine's load."""
    monkeypatch.setattr(trees, "branching_token_tree", _never_built)
    monkeypatch.setattr(trees, "chains_token_tree", _never_built)
    monkeypatch.setattr(plan, "_device_memory_bytes", lambda mesh: 16 << 30)
    target, draft = pair
    with pytest.raises(ValueError, match="needs about") as info:
        asps_jax.sample(target, draft, [PROMPT], key=jax.random.key(0), max_new_tokens=4, **kwargs)
    message = str(info.value)
    assert "\n" not in message and needle in message, message


# Run in a fresh process: compile a Session, then measure the peak resident memory of its steps
# alone (the high-water mark reset after compiling, freed memory handed back to the system).
_MEASURE = """
import ctypes, gc, json, sys
import jax
import asps_jax
from asps_jax import sampler

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

target = asps_jax.load_model("tinyshakespeare-target")
draft = asps_jax.load_model("tinyshakespeare-draft")
out = []
for shape in json.loads(sys.argv[1]):
    prompts = [[1] * 5] * shape.pop("batch")
    drafter = shape.pop("draft", draft)  # the draft model, or a drafter's name ("lookup")
    session = asps_jax.Session(
        target, drafter, prompts, key=jax.random.key(0), max_new_tokens=4, eos_token_id=-1,
        **shape
    )
    spec = session.spec
    parts = sampler.check_memory(
        target, drafter, batch=len(prompts), prompt_len=5, max_new_tokens=4,
        num_draft_tokens=spec.num_draft_tokens, num_drafts=spec.num_drafts,
        method=spec.method, widths=spec.widths,
    )
    session.compile()
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    before = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    next(session.steps())  # prefill and one step: every step has the same buffers
    out.append([status("VmHWM:") - before, sum(parts.values())])
    del session
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads and resets /proc/self peak memory")
def test_size_estimate_bounds_the_measured_peak():
    """The estimate is an upper bound of the peak memory of real steps, within a factor 4: a
    branching tree drawn without replacement and a chain, at batch sizes where the buffers
    dominate (the bundled pair, V = 2048). A shape may name a drafter (``draft="lookup"``)."""
    shapes = [
        dict(method="tv", tree=[4, 2], batch=128),
        dict(method="asps", num_draft_tokens=4, batch=512),
    ]
    # -O0 halves the compile (the HLO and its buffers are the same, subprocess_env.py).
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": xla_flags()}
    run = subprocess.run(
        [sys.executable, "-c", _MEASURE, json.dumps(shapes)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    for shape, (peak, estimate) in zip(shapes, json.loads(run.stdout.splitlines()[-1])):
        assert 100 << 20 < peak <= estimate <= 4 * peak, (shape, peak >> 20, estimate >> 20)


@pytest.mark.slow
def test_top_k_beyond_int32_keeps_every_token(pair):
    """2**32 + 1 used to wrap to 1 in int32 and sample greedily."""
    target, _ = pair
    common = dict(key=jax.random.key(3), max_new_tokens=8, method="ar", eos_token_id=-1)
    rows = [PROMPT] * 8
    wide = asps_jax.sample(target, None, rows, top_k=2**32 + 1, **common)
    free = asps_jax.sample(target, None, rows, **common)
    np.testing.assert_array_equal(np.asarray(wide.tokens), np.asarray(free.tokens))
    assert len({tuple(r) for r in np.asarray(wide.tokens).tolist()}) > 1  # not greedy


# --- Round 3 of hostile input: numbers the device cannot hold (float32), bools and strings given
# for numbers, static sizes past what can matter (n-grams longer than the context, draft trees
# past the node bound), drafter options where no drafter runs. Each is a one-line ValueError
# before anything is compiled, or (an n-gram that can never repeat) the setting it equals.


@pytest.mark.parametrize(
    "kwargs, match",
    [
        # Finite in float64, inf in float32: 0 * inf = NaN turned every law into NaN, and the
        # error blamed the checkpoint.
        (dict(frequency_penalty=1e39), "frequency_penalty must be a finite number that float32"),
        (dict(presence_penalty=-1e39), "presence_penalty must be a finite number that float32"),
        (dict(presence_penalty=[0.0, 1e39], prompts=[PROMPT] * 2), "presence_penalty"),
        (
            dict(repetition_penalty=1e39),
            "repetition_penalty must be a finite number > 0 that float32",
        ),
        (
            dict(repetition_penalty=1e-50),
            "repetition_penalty must be a finite number > 0 that float32",
        ),
        (dict(top_p=1e-50), "top_p must be in"),
        (dict(logit_bias={2: 1e39}), "the bias of token 2 must be a finite number that float32"),
        (dict(logit_bias={2: -1e39}), "the bias of token 2 must be a finite number that float32"),
        # Bools and strings were turned into numbers by NumPy before the checks.
        (dict(repetition_penalty=True), "repetition_penalty must be a number"),
        (dict(min_p=True), "min_p must be a number"),
        (dict(no_repeat_ngram_size="3"), "no_repeat_ngram_size must be a number"),
        (dict(temperature="0.7"), "temperature must be a number"),
        (dict(top_k=[True]), "top_k must be a number"),
        (dict(logit_bias={2: True}), "the bias of token 2"),
        (dict(logit_bias={2: "1.5"}), "the bias of token 2"),
        (dict(eos_token_id=True), "eos_token_id must be a token id"),
        (dict(eos_token_id=[2, "3"]), "eos_token_id must be a token id"),
        (dict(method="tv", tree=(True, 2)), "every width >= 1"),
        # int(nan) raised "cannot convert float NaN to integer", naming nothing.
        (dict(no_repeat_ngram_size=float("nan")), "no_repeat_ngram_size must be an integer"),
        (dict(top_k=float("nan")), "top_k must be an integer"),
        # Banning the whole vocabulary gave "the model produced NaN" after compiling.
        (dict(logit_bias={i: -np.inf for i in range(VOCAB)}), "bans every token"),
        # A lookup n-gram longer than the context can never match: it traced a loop of 10^9.
        (dict(draft="lookup", method="sps", lookup_ngram=10**9), "longer than the model context"),
        # Drafter options where no drafter runs were ignored, or blamed "a draft model".
        (dict(method="ar", draft=None, lookup_ngram=2), "method 'ar' uses no draft"),
        (dict(method="ar", draft=None, draft_stop="confidence:0.5"), "method 'ar' uses no draft"),
        (dict(method="ar", draft="lookup", lookup_max=2), "method 'ar' uses no draft"),
        # Fits the memory of a tiny model, then compiled for minutes.
        (dict(method="tv", tree=(5000,)), "the draft tree has 5000 nodes"),
        (dict(method="tv", tree=(32, 32)), "the draft tree has 1056 nodes"),
        (dict(method="is", num_drafts=300, num_draft_tokens=4), "lower num_drafts"),
    ],
)
def test_round3_bad_input_is_a_one_line_error(pair, kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        _prepare(pair, **kwargs)
    assert "\n" not in str(info.value)


def test_the_largest_float32_values_are_accepted(pair):
    """The bounds are float32's, not tighter."""
    big = 3.4e38
    _prepare(pair, frequency_penalty=big, presence_penalty=-big, logit_bias={2: big, 3: -np.inf})
    _prepare(pair, method="tv", tree=(32, 31))  # 1024 nodes: the bound itself


def test_integers_past_int64_are_clamped_or_refused(pair):
    """``top_k=10**20`` raised OverflowError converting to int64 (a traceback, exit 1 in the
    CLI); it keeps every token, as any top_k >= V does."""
    call = _prepare(pair, top_k=10**20)
    assert np.asarray(call.inputs.sampling.top_k).tolist() == [VOCAB]
    with pytest.raises(ValueError, match="token id 100000000000000000000 lies outside"):
        _prepare(pair, logit_bias={10**20: 1.0})


def test_an_ngram_longer_than_the_context_bans_nothing(pair):
    """``no_repeat_ngram_size`` past the context can never repeat: it is the setting 0 (no
    n-gram code in the program), where 10^9 used to trace a loop to 2^30."""
    target, _ = pair
    context = target.config.max_position_embeddings
    huge = _prepare(pair, no_repeat_ngram_size=[10**9])
    assert huge.inputs.sampling.ngram_window == 0
    assert np.asarray(huge.inputs.sampling.no_repeat_ngram_size).tolist() == [0]
    within = _prepare(pair, no_repeat_ngram_size=context)
    assert within.inputs.sampling.ngram_window >= context


@pytest.mark.slow
def test_penalties_past_float32_stay_a_law():
    """A bias near the float32 maximum plus a reward times a count used to reach +inf (no law:
    the row failed as if the model gave NaN); it is clamped to the largest float32, and a banned
    token stays banned whatever the reward (-inf + inf was NaN)."""
    sampling = SamplingParams.make(
        1,
        frequency_penalty=-3e38,
        logit_bias=np.array([[3e38, 3e38, -np.inf, 0.0]], np.float32),
    )
    history = penalties.History.init(
        np.array([[0]], np.int32), np.array([0], np.int32), vocab=4, extra=4
    )
    history = history.append(np.array([[1, 2, 2, 3]], np.int32), np.array([4], np.int32))
    logits = np.array([[[1.0, 2.0, 3.0, 0.5]]], np.float32)
    no_path = np.zeros((1, 1, 0), np.int32)
    out = np.asarray(penalties.apply_controls(sampling, history, logits, no_path, [0]))[0, 0]
    f32_max = np.finfo(np.float32).max
    assert out[1] == f32_max  # 3e38 + 2 + 3e38: clamped, not inf
    assert out[2] == -np.inf  # banned; its count times the reward overflows to -inf
    assert np.isfinite(out[0]) and np.isfinite(out[3])
    law, ok = penalties.process(sampling, history, logits, no_path, [0])
    probs = np.exp(np.asarray(law, np.float64))[0, 0]
    assert bool(np.asarray(ok)[0, 0]) and np.allclose(probs, [0.0, 1.0, 0.0, 0.0])


def test_self_draft_of_a_one_layer_target_says_it_cannot(tmp_path):
    write_tiny_llama(tmp_path / "one", seed=0, vocab_size=VOCAB, num_hidden_layers=1)
    target = asps_jax.load_model(str(tmp_path / "one"))
    with pytest.raises(ValueError, match="the target has 1; give a draft model") as info:
        sampler.prepare(target, "self:1", [PROMPT], key=jax.random.key(0), max_new_tokens=2)
    assert "e.g. 'self:1'" not in str(info.value)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(vocab_size=True), "vocab_size must be an integer >= 1, got True"),
        (dict(vocab_size=0), "vocab_size must be an integer >= 1"),
        (dict(head_dim=4.0), "head_dim must be an integer >= 1"),
        (dict(max_position_embeddings="64"), "max_position_embeddings must be an integer"),
        (dict(vocab_size=VOCAB + 4, tokenizer=["t"] * VOCAB), "exceeds the tokenizer's 12"),
    ],
)
def test_own_model_sizes_are_checked(kwargs, match):
    from asps_jax.models.own import own_model

    args = dict(
        vocab_size=VOCAB,
        num_hidden_layers=1,
        num_key_value_heads=1,
        head_dim=4,
        max_position_embeddings=64,
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match) as info:
        own_model(lambda *a: None, {"w": np.zeros(2, np.float32)}, **args)
    assert "\n" not in str(info.value)
