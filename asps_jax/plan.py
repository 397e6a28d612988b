"""The static plan of a sampling call, checked once: the method, the drafter, the draft tree and
its sizes (:func:`resolve`), the context and memory (:func:`check_fits`, :func:`check_memory`),
and the :class:`~asps_jax.decode.Decoder` they lower to (:func:`decoder`).

Every check is a one-line ``ValueError`` naming the argument to change. Methods are read from the
one registry (``verify/registry.py``) by their kind, drafters from ``asps_jax.drafters`` through
their protocol: nothing here names either.
"""

from __future__ import annotations

import math
import operator
import os

import jax
import numpy as np

from asps_jax import decode, drafters, footprint, sharding
from asps_jax.checks import check_int
from asps_jax.verify import registry
from asps_jax.verify.registry import REGISTRY

# What sample / Session / the CLI accept for ``method``: "ar" plus the registry's methods that run
# in the decode loop (all of them: specinfer_wor's K roots are drawn without replacement as the
# siblings of one node, Method.draft_tree).
METHODS: tuple[str, ...] = ("ar",) + tuple(m.name for m in REGISTRY.values() if m.in_sample)

MAX_TREE_NODES = 1024
"""The most draft-tree nodes one step may verify (K chains of n: K * n nodes). A larger step's
program (the per-node laws, the ``N x N`` masks, the verifier's walk) takes minutes to compile
even when it fits the device (``--tree 5000`` did)."""

_CACHE_BUCKET = footprint.BUCKETS[1]


def check_tree(tree, method, num_drafts, num_draft_tokens) -> tuple[int, ...]:
    """The widths of a branching draft tree (``()`` for none), checked against the method (a
    name) and against ``num_drafts`` / ``num_draft_tokens`` when those are given too."""
    if tree is None:
        return ()
    try:
        widths = tuple(operator.index(w) for w in tree)
        if any(isinstance(w, (bool, np.bool_)) for w in tree):
            widths = None
    except TypeError:
        widths = None
    if not widths or any(w < 1 for w in widths):
        raise ValueError(
            f"tree: a branching draft tree is its children per node at each depth, e.g. "
            f"(4, 2, 1, 1), every width >= 1; got {tree!r}"
        )
    entry = REGISTRY.get(method) if isinstance(method, str) else None
    if entry is None or entry.kind != "tree":
        raise ValueError(
            f"tree: a branching draft tree is verified by the tree methods "
            f"({', '.join(registry.names('tree'))}); method {method!r} verifies chains"
        )
    implied = {"num_drafts": math.prod(widths), "num_draft_tokens": len(widths)}
    for name, value in (("num_drafts", num_drafts), ("num_draft_tokens", num_draft_tokens)):
        if value is not None and value != implied[name]:
            raise ValueError(
                f"tree={widths} has {implied['num_drafts']} leaves at depth "
                f"{implied['num_draft_tokens']}; {name}={value} contradicts it (omit it)"
            )
    return widths


def _check_method(method, drafter, num_drafts, options) -> registry.Method | None:
    """The registry entry of ``method`` (None for ``"ar"``), its options validated (once)."""
    if method not in METHODS:
        raise ValueError(f"method: unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "ar":
        if options:
            raise ValueError(f"method 'ar' takes no options, got {sorted(options)}")
        if num_drafts != 1:
            raise ValueError(f"method 'ar' uses no draft; num_drafts must be 1, got {num_drafts}")
        return None
    if drafter is None:
        raise ValueError(
            f"method {method!r} needs a draft model or draft='lookup' (draft=None is only for 'ar')"
        )
    entry = REGISTRY[method]
    if entry.kind == "chain" and num_drafts != 1:
        multi = ", ".join(m for m in METHODS if m in REGISTRY and REGISTRY[m].kind == "drafts")
        raise ValueError(
            f"method {method!r} verifies a single draft chain; use num_drafts=1 or a "
            f"multi-draft method ({multi})"
        )
    entry.validate(options)
    return entry


def resolve(target, draft, *, method, num_drafts, num_draft_tokens, tree, max_new_tokens,
            options, mesh=None, **drafting):  # fmt: skip
    """The call's method, drafter, draft tree and sizes checked: ``(target, drafter, draft model,
    spec, τ)`` with the vocabularies aligned (no drafter for ``"ar"``); ``drafting``: the
    drafter's options (``lookup_ngram``, ``lookup_max``, ``draft_stop``), and ``τ`` the
    confidence stop (None without ``draft_stop``)."""
    widths = check_tree(tree, method, num_drafts, num_draft_tokens)
    target, drafter, model, tau = drafters.resolve(
        draft, target, uses_draft=method != "ar", widths=widths, mesh=mesh, **drafting
    )
    if drafter is not None and num_draft_tokens is None:
        num_draft_tokens = drafter.default_draft_len()
    if widths:
        num_drafts, num_draft_tokens = math.prod(widths), len(widths)
    num_draft_tokens = check_int(
        "num_draft_tokens", 8 if num_draft_tokens is None else num_draft_tokens, 1
    )
    num_drafts = check_int("num_drafts", 1 if num_drafts is None else num_drafts, 1)
    entry = _check_method(method, drafter, num_drafts, options)
    if entry is None:
        num_draft_tokens, num_drafts, drafter, model = 1, 1, None, None
    spec = decode.SpecConfig(
        method=entry,
        num_draft_tokens=num_draft_tokens,
        num_drafts=num_drafts,
        max_new_tokens=max_new_tokens,
        options=tuple(sorted(options.items())),
        widths=widths,
    )
    if drafter is not None:
        drafter.check(target, spec)
    return target, drafter, model, spec, tau


def _check_tree_size(spec: decode.SpecConfig) -> None:
    """Refuse a draft tree of more than :data:`MAX_TREE_NODES` nodes (one line naming the
    arguments), after :func:`check_memory` (which names the one that saves the most memory)."""
    widths = spec.widths
    nodes = (
        sum(math.prod(widths[: d + 1]) for d in range(len(widths)))
        if widths
        else spec.num_drafts * spec.num_draft_tokens
    )
    if nodes > MAX_TREE_NODES:
        lower = (
            "lower tree (--tree)"
            if widths
            else "lower num_drafts or num_draft_tokens (--num-drafts, --num-draft-tokens)"
        )
        raise ValueError(
            f"the draft tree has {nodes} nodes, past the bound of {MAX_TREE_NODES} nodes a step "
            f"verifies (a larger step compiles for minutes): {lower}"
        )


def check_fits(target, drafter, model, spec, lengths_b, budgets, mesh, slot_count=None) -> None:
    """Refuse a call whose prompt, new tokens and draft do not fit the models' context, or whose
    caches and tree do not fit the device memory (``slot_count``: the loop's rows with
    continuous batching); then check a tree method's options against the tree (built only once
    the memory check has passed). ``lengths_b`` / ``budgets``: each prompt's length and
    ``max_new_tokens``."""
    context, cap = target.config.max_position_embeddings, ""
    own = None if drafter is None else drafter.context()
    if own is not None and own < context:
        context, cap = own, f" (the draft's, {drafter.context_source()})"
    over = int(np.argmax(np.asarray(lengths_b) + np.asarray(budgets)))
    if lengths_b[over] + budgets[over] > context:
        raise ValueError(
            f"prompt of {lengths_b[over]} tokens plus max_new_tokens={budgets[over]} exceeds the "
            f"model context of {context} positions{cap}; shorten the prompt or lower "
            "max_new_tokens"
        )
    if own is not None and spec.num_draft_tokens >= context:
        raise ValueError(
            f"num_draft_tokens={spec.num_draft_tokens} does not fit the model context of "
            f"{context} positions{cap}; lower num_draft_tokens"
        )
    batch = len(budgets)
    _memory(
        target, drafter, model, spec, mesh,
        batch=batch if slot_count is None else slot_count,
        num_prompts=None if slot_count is None else batch,
        prompt_len=int(np.max(lengths_b)),
    )  # fmt: skip
    _check_tree_size(spec)
    if spec.uses_draft:  # options that depend on the tree's shape (alive="count")
        spec.method.validate(dict(spec.options), tree=spec.tree.nodes)


def _device_memory_bytes(mesh) -> int:
    """Memory of *one* device (a chip of the mesh): its reported limit, else the host's physical
    memory shared by this process's devices of the mesh (CPU devices share the host's)."""
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    # The first of this process's devices: another process's device reports nothing here.
    mine = [d for d in devices if d.process_index == jax.process_index()]
    local = mine[0] if mine else jax.local_devices()[0]
    stats = local.memory_stats() if hasattr(local, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(len(mine), 1)
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: never refuse


def chips(target_config, mesh, rules=None) -> footprint.Chips | None:
    """How ``mesh`` splits a call's buffers per chip (:class:`asps_jax.footprint.Chips`), by the
    sharding rules the loop's inputs are placed with; None without a mesh."""
    if mesh is None:
        return None
    rules = sharding.ShardingRules() if rules is None else rules
    shape = dict(mesh.shape)
    c = target_config
    heads = getattr(c, "num_attention_heads", None) or c.num_key_value_heads

    def split(axis: str, size: int) -> int:
        (name,) = rules.partition_spec((axis,), (size,), shape)
        return 1 if name is None else shape[name]

    rows = shape.get(rules.batch, 1) if rules.batch else 1
    return footprint.Chips(rows, split("kv_heads", c.num_key_value_heads), split("heads", heads))


def weights(mesh, *models) -> int:
    """The models' weight bytes: all of them on one device, one chip's share on a mesh
    (:func:`asps_jax.sharding.chip_bytes`: a replicated tensor counts whole on every chip)."""
    if mesh is None:
        return footprint.weight_bytes(*models)
    shape = dict(mesh.shape)
    return sum(sharding.chip_bytes(m.params, m.config, shape) for m in models if m is not None)


def _memory(target, drafter, model, spec, mesh, *, batch, prompt_len, num_prompts=None):
    """:func:`asps_jax.footprint.check` of a resolved call (its drafter, draft model, spec): on a
    mesh, what one chip holds (its weights and its share of the buffers) against one chip."""
    dtypes = [jax.tree.leaves(m.params)[0].dtype for m in (target, model) if m is not None]
    label = None
    if mesh is not None:
        label = ",".join(f"{a}={n}" for a, n in dict(mesh.shape).items())
    return footprint.check(
        target.config,
        drafter,
        available=_device_memory_bytes(mesh),
        weights=weights(mesh, target, drafters.own_weights(model)),
        mesh=label,
        chips=chips(target.config, mesh),
        method=spec.method,
        batch=batch,
        prompt_len=prompt_len,
        max_new_tokens=spec.max_new_tokens,
        num_draft_tokens=spec.num_draft_tokens,
        num_drafts=spec.num_drafts,
        widths=tuple(spec.widths),
        options=dict(spec.options),
        target_itemsize=np.dtype(dtypes[0]).itemsize,
        draft_itemsize=np.dtype(dtypes[-1]).itemsize,
        num_prompts=num_prompts,
    )


def check_memory(target, draft, *, batch, prompt_len, max_new_tokens, num_draft_tokens,
                 num_drafts, mesh=None, method=registry.DEFAULT_METHOD, widths=(),
                 options=None,
                 num_prompts=None, drafter=None) -> dict[str, int]:  # fmt: skip
    """Refuse, before anything is built or allocated, a call that cannot fit the device(s): the
    estimate of :func:`asps_jax.footprint.estimate` from the shapes alone (caches, draft
    replicas, the tree and its ``N x N`` masks, laws, verification buffers) plus the weights,
    against the devices' memory. A one-line ``ValueError`` names the argument to lower; returns
    the estimate's parts (bytes) otherwise. ``draft``: a draft model, None, a drafter's name
    (``"lookup"``, ``"self:L"``) or a :class:`~asps_jax.drafters.Drafter` (``drafter="lookup"``
    with ``draft=None`` is a prompt lookup); ``method`` a name."""
    draft = drafter if draft is None and drafter is not None else draft
    uses = method != "ar"
    target, drafter, model, _ = drafters.resolve(draft, target, uses_draft=uses, mesh=mesh)
    spec = decode.SpecConfig(
        method=method if uses else None,
        num_draft_tokens=num_draft_tokens,
        num_drafts=num_drafts,
        max_new_tokens=max_new_tokens,
        options=tuple(sorted((options or {}).items())),
        widths=tuple(widths),
    )
    return _memory(
        target, drafter, model, spec, mesh,
        batch=batch, prompt_len=prompt_len, num_prompts=num_prompts,
    )  # fmt: skip


def decoder(
    target, drafter, spec, prompt_width: int, mesh, diagnostics, top_logprobs, raw_logprobs=False,
    samples=1,
):  # fmt: skip
    """The static :class:`asps_jax.decode.Decoder` of a call, its KV cache length bucketed (with
    the drafter's scratch slots past the committed ones, ``Drafter.cache_slots``); ``samples``:
    the call's n samples per prompt (one target prefill per prompt)."""
    scratch = 0
    if drafter is not None:
        scratch = drafter.cache_slots(spec.num_draft_tokens, spec.tree.num_chains)
    cache_len = footprint.round_up(
        prompt_width + spec.max_new_tokens + spec.num_draft_tokens + 2 + scratch, _CACHE_BUCKET
    )
    return decode.Decoder(
        target_config=target.config,
        drafter=drafter,
        spec=spec,
        cache_len=cache_len,
        mesh=mesh,
        diagnostics=bool(diagnostics),
        top_logprobs=top_logprobs,
        raw_logprobs=bool(raw_logprobs),
        samples=int(samples),
    )
