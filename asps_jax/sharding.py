"""Device meshes and the placement of the decoding loop's inputs on them (docs/api.md §3 ``mesh=``).

A mesh has two axes: ``"data"`` splits the batch (rows never talk to each other), ``"model"``
splits the parameters along their head / MLP / vocabulary axes (tensor parallelism). Every
parameter declares logical axis names next to its shape (``param_axes``); a
:class:`ShardingRules` maps those names to mesh axes. Only the *inputs* of the jitted loop are
placed: ``jax.jit`` propagates their shardings through prefill, the while loop and the caches, so
``decode.py`` is the same program on one device and on a mesh, plus a few activation constraints at
known points (:func:`constrain`, the identity without a mesh). Step-wise streaming (``Session``)
also fixes the layout of the state between two compiled steps (:func:`state_shardings`).

Tokens do not depend on the mesh: a row's randomness comes from its own key (``decode.py``), and
the arithmetic is the same up to the order of the float32 sums that a sharded contraction
all-reduces (heads, MLP, vocabulary) — a last-bit difference that could flip a sampled token only
when a uniform lands within ~1e-7 of a decision boundary. The exact draws keep that bound: their
bits -> token map does not jump when a normalised law's float sum falls on the other side of 1
(``asps_jax.draws``).

Several processes (multi-host, docs/api.md §3): :func:`init_distributed` joins them
(``jax.distributed.initialize``) and :func:`make_mesh` then spans every process's devices, with
``"data"`` across processes. Every process runs the same program with the *same* arguments — the
full list of prompts and the same key — so a row's key is ``fold_in(key, global row)`` exactly as
in one process; :func:`put` builds each global input from that host copy (each process fills only
the shards its devices hold), :func:`check_same_everywhere` refuses arguments that differ between
processes, and :func:`to_local` gathers the outputs so that every process gets all rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import weakref

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from asps_jax.checks import known_keywords
from asps_jax.controls.stopping import StopStrings
from asps_jax.kv_cache import CACHE_AXES, KVCache
from asps_jax.models import family_for_config

MESH_AXES = ("data", "model")


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis name -> mesh axis name (None: replicated).

    A logical axis whose size the mesh axis does not divide is replicated instead (e.g. 2 KV
    heads on ``model=4``): correct everywhere, only less memory-efficient.
    """

    batch: str | None = "data"
    layers: str | None = None
    embed: str | None = None
    heads: str | None = "model"
    kv_heads: str | None = "model"
    head_dim: str | None = None
    mlp: str | None = "model"
    vocab: str | None = "model"
    cache_seq: str | None = None
    positions: str | None = None  # learned position tables (OPT, GPT-2, GPT-Neo): replicated

    def partition_spec(self, axes: tuple[str, ...], shape: tuple[int, ...], mesh_shape) -> P:
        """The ``PartitionSpec`` of an array of this ``shape`` whose dims are named ``axes``.

        ``mesh_shape``: ``{mesh axis: size}`` (``dict(mesh.shape)``). A mesh axis is used at most
        once per array (a second logical axis mapped to it stays replicated); a ``None`` name is
        replicated.
        """
        if len(axes) != len(shape):
            raise ValueError(f"axes {axes} do not match shape {shape}")
        used: set[str] = set()
        spec = []
        for name, size in zip(axes, shape, strict=True):
            if name is None:
                spec.append(None)
                continue
            if not hasattr(self, name):
                raise ValueError(f"no sharding rule for logical axis {name!r}")
            target = getattr(self, name)
            mesh_size = mesh_shape.get(target, 0) if target is not None else 0
            if mesh_size > 1 and size % mesh_size == 0 and target not in used:
                used.add(target)
                spec.append(target)
            else:
                spec.append(None)
        return P(*spec)


def parse_mesh_spec(spec: str | dict) -> dict[str, int]:
    """``"data=2,model=4"`` (or ``{"data": 2, "model": 4}``) -> ``{"data": 2, "model": 4}``.

    An axis left out has size 1.
    """
    if isinstance(spec, str):
        items = []
        for part in spec.split(","):
            name, eq, size = part.partition("=")
            if not eq:
                raise ValueError(
                    f"mesh: {spec!r} is not of the form data=D,model=M (bad part {part!r})"
                )
            items.append((name.strip(), size.strip()))
    elif isinstance(spec, dict):
        items = list(spec.items())
    else:
        raise ValueError(f"mesh: expected a string like 'data=2,model=4' or a dict, got {spec!r}")
    sizes = dict.fromkeys(MESH_AXES, 1)
    seen = set()
    for name, size in items:
        if name not in MESH_AXES:
            raise ValueError(f"mesh: unknown axis {name!r}; the axes are {', '.join(MESH_AXES)}")
        if name in seen:
            raise ValueError(f"mesh: axis {name!r} is given twice in {spec!r}")
        seen.add(name)
        try:
            value = int(size)
        except (TypeError, ValueError):
            value = 0
        if isinstance(size, bool) or value < 1 or str(value) != str(size).strip():
            raise ValueError(
                f"mesh: size of axis {name!r} must be a positive integer, got {size!r}"
            )
        sizes[name] = value
    return sizes


def init_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: int = 300,
) -> tuple[int, int]:
    """Join a multi-process run (``jax.distributed.initialize``); returns ``(process, count)``.

    Call it in every process before anything else uses JAX. With no arguments JAX detects them
    where it can (Cloud TPU pod slices, Slurm, Open MPI; ``JAX_COORDINATOR_ADDRESS`` for the
    address); otherwise give all three: ``coordinator_address`` ``"host:port"`` of process 0,
    ``num_processes`` and this ``process_id`` in ``[0, num_processes)``. On CPU the processes
    exchange data through gloo (JAX's default ``jax_cpu_collectives_implementation``).
    ``timeout_s``: how long to wait for the other processes to join.
    """
    given = [v is not None for v in (coordinator_address, num_processes, process_id)]
    if any(given) and not all(given[1:]):
        raise ValueError(
            "distributed: give both the number of processes and this process's id "
            f"(got num_processes={num_processes!r}, process_id={process_id!r})"
        )
    if num_processes is not None:
        count, index = int(num_processes), int(process_id)
        if count < 1 or not 0 <= index < count:
            raise ValueError(
                f"distributed: process id must lie in [0, {count}) and the number of processes "
                f"be >= 1, got process_id={process_id!r}, num_processes={num_processes!r}"
            )
    if coordinator_address is not None and (
        not isinstance(coordinator_address, str)
        or not coordinator_address.rpartition(":")[0]
        or not coordinator_address.rpartition(":")[2].isdigit()
    ):
        raise ValueError(
            f"distributed: coordinator address must be HOST:PORT, got {coordinator_address!r}"
        )
    if jax.distributed.is_initialized():
        return jax.process_index(), jax.process_count()
    try:
        jax.distributed.initialize(
            coordinator_address,
            num_processes,
            process_id,
            initialization_timeout=int(timeout_s),
        )
    except (ValueError, RuntimeError) as err:
        message = " ".join(str(err).split())
        raise ValueError(
            f"distributed: could not join the other processes ({message}); pass the coordinator "
            "address, the number of processes and this process's id, or run where JAX detects "
            "them (TPU pod slice, Slurm, Open MPI)"
        ) from None
    return jax.process_index(), jax.process_count()


def is_multiprocess(mesh: Mesh | None) -> bool:
    """True when ``mesh`` holds devices of other processes (a multi-host run)."""
    return mesh is not None and mesh.is_multi_process


@known_keywords()
def make_mesh(spec: str | dict, devices=None) -> Mesh:
    """A ``("data", "model")`` mesh from ``"data=2,model=4"`` over the first D*M devices.

    With several processes it must use every process's devices (each process runs its share of
    every step); they are ordered by process, so ``"model"`` stays inside a process when it fits
    there and ``"data"`` goes across processes.
    """
    sizes = parse_mesh_spec(spec)
    devices = jax.devices() if devices is None else list(devices)
    if jax.process_count() > 1:
        devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    need = math.prod(sizes.values())
    if jax.process_count() > 1 and need != jax.device_count():
        total = jax.device_count()
        raise ValueError(
            f"mesh: {spec!r} has {need} devices but the {jax.process_count()} processes hold "
            f"{total}: with several processes the mesh must use all of them "
            f"(e.g. data={max(total // sizes['model'], 1)},model={sizes['model']})"
        )
    if need > len(devices):
        raise ValueError(
            f"mesh: {spec!r} needs {need} devices but only {len(devices)} "
            f"{'is' if len(devices) == 1 else 'are'} available ({devices[0].platform}); on CPU, "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts fakes N devices"
        )
    grid = np.asarray(devices[:need], dtype=object).reshape(tuple(sizes.values()))
    # Auto axes: jit propagates the input shardings (no sharding-in-types in the model code).
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def check_mesh(mesh) -> Mesh:
    """Validate a user's mesh; returns it with Auto axis types (``jax.make_mesh`` defaults to
    Explicit ones, which would make every model op check shardings in its types)."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh (see make_mesh), got {mesh!r}")
    unknown = [a for a in mesh.axis_names if a not in MESH_AXES]
    if unknown:
        raise ValueError(
            f"mesh: axes must be named among {MESH_AXES}, got {tuple(mesh.axis_names)}"
        )
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def batch_multiple(mesh: Mesh, rules: ShardingRules = ShardingRules()) -> int:
    """The batch must be a multiple of this to split evenly over the batch's mesh axis."""
    return int(dict(mesh.shape).get(rules.batch, 1)) if rules.batch else 1


def param_specs(config, mesh: Mesh, rules: ShardingRules = ShardingRules()):
    """``PartitionSpec`` per parameter, from the family's ``param_shapes`` (shape, axes)."""
    family = family_for_config(config)
    shapes = family.param_shapes(config)
    mesh_shape = dict(mesh.shape)

    def is_leaf(x):
        return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], tuple)

    return jax.tree.map(
        lambda s: rules.partition_spec(s[1], s[0], mesh_shape), shapes, is_leaf=is_leaf
    )


def _param_spec(axes: tuple, shape: tuple, mesh_shape, rules: ShardingRules) -> P:
    """The ``PartitionSpec`` of one parameter array named ``axes`` (whole where the rank
    differs: e.g. a quantized matrix's scalar field)."""
    if len(shape) != len(axes):
        return P()
    return rules.partition_spec(axes, shape, mesh_shape)


def _map_params(fn, params, config):
    """``fn(axes, array)`` for every array of ``params``, by the logical axes of the family's
    ``param_shapes``. A parameter that is a pytree of arrays of its rank (a quantized matrix:
    integer values and scales, ``models/quant.py``) has each array mapped with the same axes: a
    scale's size-1 or group axis that a mesh axis does not divide stays whole, one that it divides
    is split with its values' blocks."""
    shapes = family_for_config(config).param_shapes(config)

    def is_leaf(x):
        return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], tuple)

    return jax.tree.map(
        lambda s, x: jax.tree.map(lambda a: fn(s[1], a), x), shapes, params, is_leaf=is_leaf
    )


def shard_params(params, config, mesh: Mesh, rules: ShardingRules = ShardingRules()):
    """``device_put`` every parameter with its ``NamedSharding`` on ``mesh``, by its logical
    axes and its own shape (:func:`_map_params`)."""
    mesh_shape = dict(mesh.shape)

    def place(axes, a):
        return put(a, NamedSharding(mesh, _param_spec(axes, a.shape, mesh_shape, rules)))

    return _map_params(place, params, config)


def chip_bytes(params, config, mesh_shape, rules: ShardingRules = ShardingRules()) -> int:
    """The bytes of ``params`` that *each* chip holds once :func:`shard_params` placed them on a
    mesh of ``mesh_shape`` (``{axis: size}``): a split array's share, a replicated one (the
    embedding or a norm whose axes no rule splits, KV heads the model axis does not divide) whole.
    ``params`` may be arrays or ``jax.ShapeDtypeStruct`` values."""
    sizes = []

    def count(axes, a):
        spec = _param_spec(axes, tuple(a.shape), mesh_shape, rules)
        split = math.prod(mesh_shape[n] for n in spec if n is not None)
        sizes.append(-(-math.prod(a.shape) // split) * np.dtype(a.dtype).itemsize)
        return a

    _map_params(count, params, config)
    return sum(sizes)


# Models whose parameters were already placed: a second sample() call on the same mesh reuses
# them instead of copying every weight again. Weak keys (a Model compares by identity): dropping
# the Model frees its placed copy.
_PLACED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def place_model_params(model, mesh: Mesh, rules: ShardingRules = ShardingRules()):
    """``shard_params`` of ``model.params``, remembered per model for the last mesh used."""
    key = (id(model.params), mesh, rules)
    cached = _PLACED.get(model)
    if cached is None or cached[0] != key:
        # A view of another model's parameters (draft="self:L", the target's first layers):
        # that model's placed parameters, viewed the same way.
        view = getattr(model, "view_of_placed", None)
        placed = (
            shard_params(model.params, model.config, mesh, rules)
            if view is None
            else view(lambda source: place_model_params(source, mesh, rules))
        )
        cached = (key, placed)
        _PLACED[model] = cached
    return cached[1]


# The layouts a dataclass field of the loop's inputs declares in its ``dataclasses.field``
# metadata "sharding" (SamplingParams, StopStrings, sampler.DecodeInputs): a field that declares
# none is refused, so a new field cannot go unplaced.
ROWS = "rows"  # one entry per row: split along the leading batch axis
REPLICATED = "replicated"  # one value for all rows: whole on every device
FIELDS = "fields"  # a dataclass (or None) whose own fields declare their layouts
PARAMS = "params"  # a model's parameters: by its param_axes (shard_inputs' ``models``)
LAYOUTS = (ROWS, REPLICATED, FIELDS, PARAMS)


def _rows(a, mesh: Mesh, rules: ShardingRules) -> NamedSharding:
    """Split along the leading (batch) axis; a scalar is replicated."""
    spec = rules.partition_spec(("batch",), a.shape[:1], dict(mesh.shape)) if a.ndim else ()
    return NamedSharding(mesh, P(*spec, *([None] * (a.ndim - 1))))


def layout(obj, name: str) -> str:
    """The layout the dataclass field ``name`` of ``obj`` declares (one of :data:`LAYOUTS`)."""
    field = {f.name: f for f in dataclasses.fields(obj)}[name]
    value = field.metadata.get("sharding")
    if value not in LAYOUTS:
        raise TypeError(
            f"{type(obj).__name__}.{name} declares no layout: give the field "
            f"metadata={{'sharding': one of {LAYOUTS}}} so that it is placed on a mesh"
        )
    return value


def field_shardings(obj, mesh: Mesh, rules: ShardingRules = ShardingRules()):
    """``obj`` (a dataclass of arrays, or of their ``eval_shape``) with a ``NamedSharding`` in
    place of each array, as its fields declare (:data:`LAYOUTS`); a ``"params"`` field is left
    as it is (placed by :func:`shard_inputs`), a None field stays None."""
    changes = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if field.metadata.get("static") or value is None:
            continue
        how = layout(obj, field.name)
        if how == ROWS:
            changes[field.name] = jax.tree.map(lambda a: _rows(a, mesh, rules), value)
        elif how == REPLICATED:
            changes[field.name] = jax.tree.map(lambda _: NamedSharding(mesh, P()), value)
        elif how == FIELDS:
            changes[field.name] = field_shardings(value, mesh, rules)
    return dataclasses.replace(obj, **changes)


def state_shardings(state, mesh: Mesh, rules: ShardingRules = ShardingRules()):
    """A ``NamedSharding`` per leaf of a decode state (or of its ``eval_shape``): KV caches by
    ``CACHE_AXES``, the stop strings as their fields declare (:func:`field_shardings`), every
    other array along its leading batch axis.

    The state between two compiled steps needs *one* fixed layout: an ahead-of-time compiled step
    only accepts the shardings it was compiled for, and jit alone may pick a different layout for
    its output than for its input.
    """
    mesh_shape = dict(mesh.shape)

    def place(x):
        if isinstance(x, KVCache):
            kv = NamedSharding(mesh, rules.partition_spec(CACHE_AXES, x.shape, mesh_shape))
            if x.per_layer:  # each layer's buffer as the stacked cache's slice
                kv = NamedSharding(mesh, P(*kv.spec[1:]))
                kv = (kv,) * x.shape[0]
            return KVCache(k=kv, v=kv, lengths=_rows(x.lengths, mesh, rules))
        if isinstance(x, StopStrings):
            return field_shardings(x, mesh, rules)
        return _rows(x, mesh, rules)

    return jax.tree.map(place, state, is_leaf=lambda x: isinstance(x, KVCache | StopStrings))


def constrain(x, axes: tuple, mesh: Mesh | None, rules: ShardingRules = ShardingRules()):
    """An activation sharding constraint by logical axis names (None: replicated) inside a jitted
    program; the identity without a mesh, so the one-device program is unchanged.

    Placed at a few known points of the decoding loop (the scored logits, the draft logits) so that
    a profile of a sharded run shows where activations are laid out, not only the inputs.
    """
    if mesh is None:
        return x
    spec = rules.partition_spec(tuple(axes), x.shape, dict(mesh.shape))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def constrain_state(state, mesh: Mesh | None, rules: ShardingRules = ShardingRules()):
    """A decode state laid out by :func:`state_shardings` inside a jitted program (the identity
    without a mesh). At the end of prefill: the loop's carry (and a step's input) then splits
    its caches by rows and KV heads on every chip, where propagation alone left the new caches
    whole on each chip (the compiled per-chip peak, ``plan.py``)."""
    if mesh is None:
        return state
    return jax.lax.with_sharding_constraint(state, state_shardings(state, mesh, rules))


def shard_state(state, mesh: Mesh, rules: ShardingRules = ShardingRules()):
    """``device_put`` a decode state with :func:`state_shardings` (a no-op once it is there).

    The state is the output of a compiled step, already global on a multi-process mesh."""
    return jax.device_put(state, state_shardings(state, mesh, rules))


def sharded_shapes(state_shape, mesh: Mesh, rules: ShardingRules = ShardingRules()):
    """``ShapeDtypeStruct``s of a state with :func:`state_shardings`, for ``jit(...).lower``."""
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        state_shape,
        state_shardings(state_shape, mesh, rules),
    )


def put(x, sharding: NamedSharding):
    """``jax.device_put(x, sharding)``, also when ``sharding`` spans other processes' devices.

    There ``x`` is this process's host copy of the whole array (every process passes the same
    value) and each process fills only the shards its own devices hold; a typed PRNG key array
    travels as its key data.
    """
    if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = put(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def to_local(tree, mesh: Mesh | None):
    """On a multi-process mesh, every array of ``tree`` whole on this process's first device
    (an all-gather every process must join); otherwise ``tree`` itself."""
    if not is_multiprocess(mesh):
        return tree
    whole = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))(tree)
    return jax.tree.map(lambda a: a.addressable_data(0), whole)


def check_same_everywhere(mesh: Mesh | None, what: str, *values) -> None:
    """On a multi-process mesh, refuse ``values`` (host arrays) that are not the same in every
    process: the processes must pass the same arguments (one small all-gather of a digest)."""
    if not is_multiprocess(mesh):
        return
    from jax.experimental import multihost_utils

    digest = hashlib.sha256()
    for value in values:
        if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            value = jax.random.key_data(value)
        arr = np.asarray(value)
        digest.update(f"{arr.dtype}{arr.shape}".encode())
        digest.update(np.ascontiguousarray(arr).tobytes())
    mine = np.frombuffer(digest.digest(), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine))
    differ = [p for p in range(every.shape[0]) if not np.array_equal(every[p], every[0])]
    if differ:
        raise ValueError(
            f"{what} differ between processes (process {differ[0]} vs process 0): with several "
            "processes every one must pass the same full list of prompts, key and sampling "
            "arguments"
        )


def pad_batch(prompts_BP: np.ndarray, lengths_B: np.ndarray, multiple: int):
    """Append rows of length 0 (they start done) until the batch is a multiple of ``multiple``."""
    rows = prompts_BP.shape[0]
    extra = -rows % multiple
    if extra == 0:
        return prompts_BP, lengths_B
    prompts_BP = np.concatenate([prompts_BP, np.zeros((extra,) + prompts_BP.shape[1:], np.int32)])
    return prompts_BP, np.concatenate([lengths_B, np.zeros(extra, lengths_B.dtype)])


def pad_to_mesh(prompts_BP: np.ndarray, lengths_B: np.ndarray, mesh: Mesh | None):
    """:func:`pad_batch` to a multiple of the mesh's batch axis (:func:`batch_multiple`), so
    that the batch splits evenly over it; unchanged without a mesh."""
    if mesh is None:
        return prompts_BP, lengths_B
    return pad_batch(prompts_BP, lengths_B, batch_multiple(mesh))


def shard_inputs(inputs, mesh: Mesh, models: dict, rules: ShardingRules = ShardingRules()):
    """Place the array arguments of ``Decoder.generate`` / ``prefill`` (``sampler.DecodeInputs``,
    or any dataclass whose fields declare their layouts) on ``mesh``, each field as it declares
    (:data:`LAYOUTS`), nested dataclasses field by field: parameters by ``param_axes``, per-row
    arrays along data, the rest whole on every device. A field that declares no layout is refused
    (:func:`layout`), so none goes unplaced.

    ``models``: ``{field name: Model}`` for the ``"params"`` fields (the parameters placed are
    ``model.params``, remembered per model: :func:`place_model_params`).
    """
    shardings = field_shardings(inputs, mesh, rules)
    changes = {}
    for field in dataclasses.fields(inputs):
        value = getattr(inputs, field.name)
        if value is None:
            continue
        if layout(inputs, field.name) == PARAMS:
            changes[field.name] = place_model_params(models[field.name], mesh, rules)
        else:
            changes[field.name] = jax.tree.map(put, value, getattr(shardings, field.name))
    return dataclasses.replace(inputs, **changes)
