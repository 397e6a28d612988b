"""The memory a sampling call needs, estimated from its shapes alone (docs/api.md §3).

:func:`estimate` adds up, in bytes, what one call of :func:`asps_jax.sample` holds at its peak,
before anything is built: no tree, no array, no trace. It is the one size check of the library
(``sample`` / ``stream`` / ``Session``) and of ``scripts/sample.py``; :func:`check` turns it
into a one-line error that names the argument to lower. On a mesh it is one chip's (:class:`Chips`:
its rows, its share of the target cache's KV heads and of the attention scores' heads), checked
with the weights that chip holds against one chip's memory (``plan.py``).

The parts, for ``B`` rows (padded to the batch bucket), ``S`` cache slots, ``N`` tree nodes
(``1 + K*n`` for K chains of n tokens, ``1 + w_1 + w_1 w_2 + ...`` for a branching tree), ``R``
draft replicas (``B*K``, or ``B*prod(widths)`` for a tree), depth ``D``, vocabulary ``V``:

* ``kv caches``: the target's ``B`` rows and the draft's ``R`` replicas, ``S`` slots each (a
  self-draft that shares the target's cache, ``draft="self:L"``: no draft cache, the target's
  ``n*K`` scratch slots more per row instead; a prompt lookup: no draft cache);
* ``tree tables``: the static tree built on the host at trace time (parents, root paths, the
  ``bool[N, N]`` ancestor table, its copies as constants of the compiled program);
* ``tree masks``: everything on device that grows with ``N**2`` per row: the merged tree's
  attention mask, the sibling merge (``[N, N, D]`` path comparisons), the traversal's
  ``[N, N]`` tables;
* ``target forward``: the attention scores ``[B, heads, N, S + N]`` (float32, a few live
  copies), the layer activations and the new keys / values of every node;
* ``step laws``: the target's ``[B, N, V]`` logits and processed laws, the draft rollout's
  per-depth laws ``[R, D, V]``, the verifier's per-row ``[N, V]`` work buffers;
* ``draft rollout``: the draft forwards over the ``R`` replicas (and the prompt prefill; a
  shared self-draft: ``K`` queries per row over the target cache, no prefill); a prompt lookup:
  its search, ``[H, n]`` window tables per row over the ``H`` tokens of the row's text, and its
  point-mass laws ``[B, K, n, V]``;
* ``selection``: the level race of ``is`` / ``optimal`` / ``is_bv`` (``[W, W, levels, W/2]``
  per node for W drafts or walkers), or ``is_bv``'s ``alive="count"`` tables (``[W, N, N]``);
* ``outputs``: the emitted tokens and their log-probabilities. :func:`check` adds the weights.

Each part is an upper bound of what XLA keeps live (elementwise chains counted as materialized);
tests/test_sampler_bad_input.py compares the total with the measured peak of real runs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

F32 = 4
_RACE_LEVELS = 16  # the level race's default number of levels (verify/registry.py)
# The padding of sampler.prepare: prompt width, cache length, batch rows (sampler uses these).
BUCKETS = _PROMPT_BUCKET, _CACHE_BUCKET, _BATCH_BUCKET = 16, 64, 8
_PY_OBJECT = 64  # bytes per entry of a Python list / tuple of ints, the ints included


def round_up(x: int, multiple: int) -> int:
    return -(-max(int(x), 1) // multiple) * multiple


def tree_shape(num_drafts: int, num_draft_tokens: int, widths=()) -> tuple[int, int, int]:
    """``(N nodes, draft replicas per row, max walkers)`` of the decode loop's tree: K chains of
    n tokens, or the branching tree ``widths`` (exact Python integers, however large)."""
    if widths:
        level, nodes, walkers = 1, 1, 1
        for w in widths:
            level *= int(w)
            nodes += level
            walkers = max(walkers, level)
        return nodes, level, walkers
    return 1 + num_drafts * num_draft_tokens, num_drafts, num_drafts


def model_sizes(config) -> dict:
    """The sizes of a model config the estimate needs (any family)."""
    kvh, head = config.num_key_value_heads, config.head_dim
    heads = getattr(config, "num_attention_heads", None) or kvh
    hidden = getattr(config, "hidden_size", None) or heads * head
    ffn = getattr(config, "intermediate_size", None) or getattr(config, "ffn_dim", None)
    return dict(
        kv_slot=2 * config.num_hidden_layers * kvh * head,  # elements per cache slot and row
        heads=heads,
        width=4 * hidden + 3 * (ffn or 4 * hidden),  # live activations per token, per layer
        vocab=config.vocab_size,
    )


def forward_bytes(m: dict, rows: int, tokens: int, slots: int, itemsize: int, heads=1) -> int:
    """One forward of ``tokens`` queries per row over ``slots`` cached keys: attention scores
    (float32: scores, masked, softmax), the mask, activations and the new keys / values.
    ``heads``: the chips the attention heads are split over (one chip's scores)."""
    keys = slots + tokens
    scores = 3 * F32 * rows * -(-m["heads"] // heads) * tokens * keys
    mask = 2 * rows * tokens * keys
    activations = F32 * rows * tokens * m["width"]
    new_kv = itemsize * rows * tokens * m["kv_slot"]
    return scores + mask + activations + new_kv


@dataclasses.dataclass(frozen=True)
class Shape:
    """The sizes of one call that a drafter's :meth:`~asps_jax.drafters.Drafter.footprint`
    reads: ``rows`` B (padded), ``replicas`` the root paths per row (K, or ``prod(widths)``),
    ``depth`` D, ``slots`` S per cache row, ``prompt`` the padded prompt width, ``history`` the
    text width H of a row, ``vocab`` V, ``draft_itemsize`` bytes per draft weight / cache entry."""

    rows: int
    replicas: int
    depth: int
    slots: int
    prompt: int
    history: int
    vocab: int
    draft_itemsize: int


@dataclasses.dataclass(frozen=True)
class Chips:
    """How a mesh splits a call's buffers, for the estimate of *one* chip's (``plan.py``):
    ``data`` the chips the rows are split over, ``kv`` those the target's KV heads are split over
    (1 where the model axis does not divide them: the cache is whole on every chip of a row's
    group), ``heads`` those its attention heads are. Everything else a chip holds whole: the
    vocabulary of every law (the draws read whole rows), the activations' model width, the
    draft's caches (split by rows only), the host's tree tables."""

    data: int = 1
    kv: int = 1
    heads: int = 1


def rollout_law_bytes(sizes: Shape) -> int:
    """A rollout's per-depth laws, ``[R, D, V]`` stacked per depth, transposed and gathered."""
    return 3 * F32 * sizes.rows * sizes.replicas * sizes.depth * sizes.vocab


def _method(method):
    """A registry :class:`~asps_jax.verify.registry.Method` (or None: ``"ar"``) from a value or
    a name."""
    if isinstance(method, str):
        from asps_jax.verify.registry import REGISTRY

        return REGISTRY.get(method)
    return method


def _selection(method, options: dict, k: int, rows: int, walkers: int, nodes: int, vocab: int):
    """Bytes of the method's selection: the level race (``[W, W, levels, W/2]`` per node) of a
    racing method, or the ``alive="count"`` tables of a tree selection (``[W, N+1, N+1]``)."""
    if method.rows_option is None:  # no selection that races
        return 0
    levels = None
    if method.kind == "drafts":
        if k > 1 and options.get("rule") in (None, "level_race"):
            levels = options.get("levels", _RACE_LEVELS)
    elif options.get("alive", "walkers") == "count":
        size = nodes + 1  # the law of the number of drafts alive, per walker: [W, N+1, N+1]
        return 3 * F32 * rows * walkers * size**2 + _PY_OBJECT * size**2
    else:
        rule = options.get("rule", "level_race")
        levels = getattr(rule, "levels", _RACE_LEVELS) if rule != "fixed_order" else None
    if levels is None:
        return 0
    levels = levels if isinstance(levels, int) else _RACE_LEVELS
    gauss = -(-walkers // 2)  # [W, W, levels, W/2] products per node, a few rows [W, V]
    return rows * F32 * (2 * walkers**2 * levels * gauss + 3 * (walkers + levels) * vocab)


def _tree_parts(method, rows, nodes, depth, k, n, vocab) -> tuple[int, int, int]:
    """``(tree tables, tree masks, step laws)`` of the verification of a drafted tree."""
    # Host: the parents as Python ints, root paths, the [N, N] ancestor tables (the chain
    # table and the token tree's, and their copies as constants of the compiled program).
    tables = nodes * (2 * _PY_OBJECT + F32 * (depth + 1)) + 4 * nodes**2
    if method.kind == "tree":
        # Merged attention mask (float32 ancestors, one-hot, reach), the sibling merge's
        # [N, N, D] path comparison, the traversal's q(x_j) and tried-before tables.
        masks = rows * nodes**2 * (10 + depth + 3 + 17)
        laws = 10 * F32 * rows * nodes * vocab  # per row: q, p, P, emit, scan copies
    else:
        # The attention mask of the scored slots (float32 ancestors, one-hot, reach).
        masks = 10 * rows * nodes**2
        laws = F32 * rows * nodes * vocab  # the draft laws laid out by node
        laws += 3 * F32 * rows * k * (n + 1) * vocab  # laws along each chain's root path
    return tables, masks, laws


def estimate(
    target_config,
    drafter,
    *,
    method,
    batch: int,
    prompt_len: int,
    max_new_tokens: int,
    num_draft_tokens: int,
    num_drafts: int,
    widths=(),
    options=None,
    target_itemsize: int = 4,
    draft_itemsize: int = 4,
    num_prompts: int | None = None,
    chips: Chips | None = None,
) -> dict[str, int]:
    """Bytes per part (see the module docstring) of one sampling call, from its shapes alone;
    with ``chips`` (a mesh), what one chip holds: its share of the rows, of the target cache's
    KV heads and of the attention scores' heads (:class:`Chips`).

    ``drafter``: the call's :class:`~asps_jax.drafters.Drafter` (None for ``method="ar"``),
    whose own buffers are its :meth:`~asps_jax.drafters.Drafter.footprint`; ``method`` the
    registry method (or its name; None or ``"ar"``: no draft). ``num_prompts``: continuous
    batching (:mod:`asps_jax.slots`): ``batch`` is then the number of slots (the rows of the
    caches and of every per-step buffer), and the prompt set and its per-prompt outputs,
    ``num_prompts`` rows each, are on device too. ``widths`` a branching tree (tree methods);
    ``options`` the method options (``levels``, ``alive``, ``rule`` change the selection's
    size). Weights are not included (the caller knows them).
    """
    method = _method(method)
    drafting = method is not None and drafter is not None
    chips = Chips() if chips is None else chips
    rows = round_up(batch, _BATCH_BUCKET) if batch > 1 else 1
    rows = -(-rows // chips.data)  # one chip's rows (the batch is padded to split evenly)
    t = model_sizes(target_config)
    vocab = t["vocab"]
    prompt = round_up(prompt_len, _PROMPT_BUCKET)
    n = k = 1
    nodes, replicas, walkers, depth = 1, 0, 1, 0
    if drafting:
        n, k = num_draft_tokens, num_drafts
        nodes, replicas, walkers = tree_shape(k, n, widths)
        depth = len(widths) if widths else n
    scratch = drafter.cache_slots(n, k) if drafting else 0
    slots = round_up(prompt + max_new_tokens + n + 2 + scratch, _CACHE_BUCKET)
    parts = {
        "kv caches": rows * slots * -(-t["kv_slot"] // chips.kv) * target_itemsize,
        "outputs": 2 * F32 * rows * (max_new_tokens + n + 1)
        + (
            0
            if num_prompts is None
            else round_up(num_prompts, _BATCH_BUCKET)
            * (2 * F32 * (max_new_tokens + n + 1) + F32 * prompt)
        ),
        "tree tables": 0,
        "tree masks": 0,
        "target forward": max(
            forward_bytes(t, rows, nodes, slots, target_itemsize, chips.heads),
            forward_bytes(t, rows, prompt, slots, target_itemsize, chips.heads),
        ),
        "step laws": 4 * F32 * rows * nodes * vocab,  # target logits, processed laws, usable
        "draft rollout": 0,
        "selection": 0,
    }
    if drafting:
        history = prompt + max_new_tokens + n + 1
        sizes = Shape(rows, replicas, depth, slots, prompt, history, vocab, draft_itemsize)
        own = drafter.footprint(sizes)
        parts["kv caches"] += own.get("kv caches", 0)
        parts["draft rollout"] = own.get("draft rollout", 0)
        tables, masks, laws = _tree_parts(method, rows, nodes, depth, k, n, vocab)
        parts["tree tables"], parts["tree masks"] = tables, masks
        parts["step laws"] += own.get("laws", 0) + laws
        parts["selection"] = _selection(method, dict(options or {}), k, rows, walkers, nodes, vocab)
    return parts


# What to lower, as the API and the command line name it.
ARGUMENTS = {
    "batch": "batch_size (the number of prompts; --batch-size)",
    "max_new_tokens": "max_new_tokens (--max-new-tokens)",
    "num_drafts": "num_drafts (--num-drafts)",
    "num_draft_tokens": "num_draft_tokens (--num-draft-tokens)",
    "tree": "tree (--tree)",
}


def _smaller(shape: dict) -> dict[str, dict]:
    """Each argument that can be lowered, halved (a tree: its widest level halved, or its last
    level dropped when every width is 1)."""
    out = {}
    for name in ("batch", "max_new_tokens"):
        if shape[name] > 1:
            out[name] = {**shape, name: shape[name] // 2}
    if shape["widths"]:
        widths = list(shape["widths"])
        widest = int(np.argmax(widths))
        if widths[widest] > 1:
            widths[widest] //= 2
        elif len(widths) > 1:
            widths.pop()
        if tuple(widths) != tuple(shape["widths"]):
            out["tree"] = {**shape, "widths": tuple(widths)}
    elif _method(shape["method"]) is not None:
        for name in ("num_drafts", "num_draft_tokens"):
            if shape[name] > 1:
                out[name] = {**shape, name: shape[name] // 2}
    return out


def _gib(size: int) -> str:
    gib = size / (1 << 30)
    return f"{gib:.1f} GiB" if gib < 1e4 else f"{gib:.2e} GiB"


def check(
    target_config,
    drafter,
    *,
    available: int,
    weights: int = 0,
    mesh: str | None = None,
    **shape,
) -> dict[str, int]:
    """Raise a one-line ``ValueError`` when :func:`estimate` (plus ``weights`` bytes already
    resident) exceeds ``available`` bytes; it names the biggest parts and the argument whose
    halving saves the most. Returns the estimate's parts otherwise. ``mesh``: the mesh's spec
    (``"data=2,model=4"``) when ``available`` and ``weights`` are one chip's and ``shape`` has
    its :class:`Chips`: the error then speaks of one chip and names the mesh too."""
    shape.setdefault("widths", ())
    shape.setdefault("options", None)
    parts = estimate(target_config, drafter, **shape)
    need = sum(parts.values()) + weights
    if need <= available:
        return parts
    gain = {
        name: need - weights - sum(estimate(target_config, drafter, **smaller).values())
        for name, smaller in _smaller(shape).items()
    }
    order = sorted(gain, key=gain.get, reverse=True)
    # The argument whose halving saves the most, and any other that saves a good part as much.
    lower = [ARGUMENTS[name] for name in order if gain[name] >= gain[order[0]] / 4][:3]
    biggest = sorted(parts, key=parts.get, reverse=True)[:2]
    detail = ", ".join(f"{name} {_gib(parts[name])}" for name in biggest)
    nodes, replicas, _ = tree_shape(shape["num_drafts"], shape["num_draft_tokens"], shape["widths"])
    what = f"{shape['batch']} rows"
    if _method(shape["method"]) is not None and drafter is not None:
        what += f", {nodes} tree nodes"
        if drafter.replicated:
            what += f", {replicas} draft replicas per row"
    if mesh is None:
        raise ValueError(
            f"this call needs about {_gib(need)} ({what}; {detail}) but the device has "
            f"{_gib(available)}: lower {' or '.join(lower) or 'the model size'}"
        )
    raise ValueError(
        f"this call needs about {_gib(need)} per chip on mesh {mesh} ({what}; weights "
        f"{_gib(weights)} per chip, {detail}) but one chip has {_gib(available)}: lower "
        f"{' or '.join(lower + ['the weights per chip with a larger model axis (mesh, --mesh)'])}"
    )


def weight_bytes(*models) -> int:
    """Bytes of the models' parameters (None entries skipped)."""
    import jax

    return sum(
        int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        for model in models
        if model is not None
        for leaf in jax.tree.leaves(model.params)
    )
