"""Weight-only quantization (``load_model(..., quantize="int8")``, ``draft="quant:int8"``).

Every projection matrix of a family (``wq wk wv wo``, the MLP matrices, OPT's ``project_in/out``)
is stored as a Qwix :class:`qwix.QArray`: symmetric integer values and float scales,

* ``"int8"``: one scale per output channel (per layer), absmax / 127.5 (Qwix's convention: the
  largest magnitude rounds to 127);
* ``"int4"`` / ``"int4:G"``: one scale per output channel and per group of ``G`` consecutive
  inputs, absmax / 7.5. ``"int4"`` takes the largest group of at most 128 inputs that divides
  every matrix of the model (128 where it does; 16 on the bundled pair, whose attention heads are
  48 wide and MLPs 512); a given ``G`` that does not divide a matrix's inputs is a one-line error
  naming the model, the matrix and the group that would.

The embedding, learned position tables, norms, biases and the LM head stay in float: the
embedding is a row lookup (nothing to multiply), and the head sets the logits' precision, which
the draft's acceptance and a quantized target's law depend on most (vLLM and tpu-inference keep
it unquantized by default too).

The forward reads a quantized matrix through :func:`einsum`: Qwix's ``einsum``, which multiplies by
the integer values converted to the activations' dtype and applies the scales (per channel after
the product, per group inside it). So a quantized model's logits are those of its dequantized
float weights (:func:`dequantize_params`) up to float rounding: sampling from it samples exactly
the quantized model's law. As a draft (:func:`quantized_copy`, ``draft="quant:int8"``) it is just
another draft law, so every verifier keeps the full-precision target's law.

On accelerators XLA fuses the integer-to-float conversion into the matrix product, so the
integer bytes are what is read per token. XLA:CPU does not: it converts the whole matrix before
the product, so on CPU a quantized forward is *slower* than a float32 one (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref

import jax
import jax.numpy as jnp

PREFIX = "quant:"  # draft="quant:int8": the target's own quantized copy
DEFAULT_GROUP = 128
_BITS = {"int8": jnp.int8, "int4": jnp.int4}
_FLOAT = ("embed", "positions", "lm_head")  # the tensors kept in float, see the docstring


@dataclasses.dataclass(frozen=True)
class Scheme:
    """How to quantize: ``mode`` ("int8" / "int4") and, for int4, the input group size."""

    mode: str
    group: int | None = None
    auto: bool = False  # "int4": the largest group <= DEFAULT_GROUP that divides every matrix

    @property
    def name(self) -> str:
        return self.mode if self.group is None or self.auto else f"{self.mode}:{self.group}"


class QuantizeError(ValueError):
    """A scheme that does not fit a model's matrices: ``detail`` without the argument's name, for
    a caller that names its own flag (the CLI's ``--quantize`` / ``--draft-quantize``)."""

    def __init__(self, what: str, detail: str):
        super().__init__(f"{what}: {detail}")
        self.detail = detail


def parse(spec, what: str = "quantize", given=None) -> Scheme:
    """``"int8"``, ``"int4"`` or ``"int4:G"`` as a :class:`Scheme`; a one-line error naming
    ``what={given}`` (default ``spec``) otherwise."""
    text = spec if isinstance(spec, str) else ""
    mode, _, group = text.partition(":")
    if mode == "int8" and not group:
        return Scheme("int8")
    if mode == "int4":
        if not group:
            return Scheme("int4", DEFAULT_GROUP, auto=True)
        # ASCII digits only: int() would read other scripts' digits ('٣' as 3).
        size = int(group) if group.isascii() and group.isdigit() else 0
        if size >= 1:
            return Scheme("int4", size)
    raise ValueError(
        f"{what}={spec if given is None else given!r}: weight-only quantization is 'int8' (per "
        "channel) or 'int4' / 'int4:G' (per channel and group of G inputs, G in ASCII digits; "
        f"default the largest group <= {DEFAULT_GROUP} that divides every matrix)"
    )


def _is_q(x) -> bool:
    """A quantized matrix (a ``qwix.QArray``; told by its fields, so that ``import asps_jax``
    does not import Qwix and Flax: 0.5 s, paid only by a quantized call)."""
    return hasattr(x, "qvalue") and hasattr(x, "scale")


def is_quantized(tree) -> bool:
    """Whether any leaf of ``tree`` is a quantized matrix."""
    return any(_is_q(x) for x in jax.tree.leaves(tree, is_leaf=_is_q))


def einsum(spec: str, x: jax.Array, w) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` for a float ``w``; for a quantized one Qwix's ``einsum``: the
    product with the integers converted to ``x``'s dtype, the scales applied after it (per
    channel) or inside it (per group).

    On CPU a one-row product was also tried as one fused multiply-and-sum over the integers (XLA
    fuses the conversion into a reduce, not into a dot): faster in an isolated forward, but 1.4x
    slower than this in the AR loop at both benchmark shapes (docs/benchmarks.md)."""
    if not _is_q(w):
        return jnp.einsum(spec, x, w)
    import qwix

    return qwix.einsum(spec, x, w, preferred_element_type=x.dtype).astype(x.dtype)


def merge(w, shape: tuple):
    """``w.reshape(shape)`` where ``shape`` merges runs of consecutive axes (e.g. ``[E, NH, H]``
    -> ``[E, NH * H]``); a quantized matrix merges its scale axes the same way (its groups are
    contiguous runs of inputs, so the merged scales are in order)."""
    if not _is_q(w):
        return w.reshape(shape)
    scale, old, merged, i = w.scale.shape, w.qvalue.shape, [], 0
    for size in shape:
        start, run = i, 1
        while run < size:
            run *= old[i]
            i += 1
        if run != size:
            raise ValueError(f"quant.merge: {old} does not merge into {shape}")
        merged.append(math.prod(scale[start:i]))
    return dataclasses.replace(w, qvalue=w.qvalue.reshape(shape), scale=w.scale.reshape(merged))


def _is_matrix(name: str, axes: tuple) -> bool:
    """A projection matrix: an ``embed`` or ``mlp`` axis among two or more non-layer axes."""
    own = [a for a in axes if a != "layers"]
    return name not in _FLOAT and len(own) >= 2 and bool({"embed", "mlp"} & set(own))


def _inputs(axes: tuple) -> tuple[int, ...]:
    """The contracted (input) axes of a stored ``x @ W`` matrix ``[layers?, in..., out...]``:
    ``heads, head_dim`` for an attention output, else the first non-layer axis."""
    first = 1 if axes[0] == "layers" else 0
    return (first, first + 1) if axes[first] == "heads" else (first,)


def _tiles(shape: tuple, inputs: tuple, group: int):
    """Qwix's ``tiled_axes`` for groups of ``group`` inputs of one matrix, None if they do not
    divide its inputs: along the last input axis, or for an attention output (inputs ``heads,
    head_dim``) whole heads per group."""
    size, last = math.prod(shape[a] for a in inputs), inputs[-1]
    if shape[last] % group == 0:  # an attention output's heads are groups apart
        return (*((a, 1) for a in inputs[:-1]), (last, group))
    if len(inputs) == 2 and group % shape[last] == 0 and size % group == 0:
        return ((inputs[0], group // shape[last]),)
    return None


def _how(name: str, shape: tuple, axes: tuple, scheme: Scheme) -> dict:
    """Qwix's ``channelwise_axes`` (and ``tiled_axes``) for one matrix."""
    inputs = _inputs(axes)
    channels = tuple(a for a in range(len(shape)) if a not in inputs)
    if scheme.group is None:
        return dict(channelwise_axes=channels)
    tiles = _tiles(shape, inputs, scheme.group)
    if tiles is None:
        size = "x".join(str(shape[a]) for a in inputs)
        raise _GroupError(
            f"{name} has {math.prod(shape[a] for a in inputs)} inputs per output ({size}), "
            f"which groups of {scheme.group} do not divide"
        )
    return dict(channelwise_axes=channels, tiled_axes=tiles)


class _GroupError(ValueError):
    """An int4 group that does not divide a matrix's inputs (:func:`plan` words the error)."""


def _axes_of(config) -> dict:
    from asps_jax.models.base import family_for_config

    family = family_for_config(config)
    if not hasattr(family, "param_axes"):
        raise ValueError(
            f"quantize: {type(config).__name__} models do not say which of their tensors are "
            "matrices (no param_axes); quantize the weights of your own model yourself"
        )
    return family.param_axes(config)


def _matrices(config, params) -> dict:
    """``{path: (name, shape, axes)}`` of every matrix of ``params`` (stored layout) to quantize;
    one-line errors for a layout it does not know."""
    axes = _axes_of(config)
    flat = dict(jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_q)[0])
    out = {}
    for path, names in jax.tree_util.tree_flatten_with_path(
        axes, is_leaf=lambda x: isinstance(x, tuple)
    )[0]:
        name = str(path[-1].key)
        if path not in flat:
            raise ValueError(
                f"quantize: the parameters have no {jax.tree_util.keystr(path)}; quantize "
                "the stored layout load_model returns, once"
            )
        leaf = flat[path]
        if _is_q(leaf):
            raise ValueError(f"quantize: {name} is quantized already; quantize float weights")
        if _is_matrix(name, names):
            out[path] = (name, tuple(leaf.shape), names)
    return out


def _largest_group(matrices: dict, at_most: int) -> int:
    """The largest group <= ``at_most`` that divides every matrix (1 always does)."""
    return next(
        g
        for g in range(at_most, 0, -1)
        if all(_tiles(shape, _inputs(names), g) for _, shape, names in matrices.values())
    )


def fitted(config, params, scheme: Scheme) -> Scheme:
    """``scheme`` with plain ``"int4"``'s group chosen for the model (see the module
    docstring); any other scheme as it is."""
    if not scheme.auto:
        return scheme
    return Scheme("int4", _largest_group(_matrices(config, params), DEFAULT_GROUP))


def plan(config, params, scheme: Scheme, *, what: str = "", model: str = "") -> dict:
    """``{path: qwix keyword arguments}`` of every matrix of ``params`` (stored layout) to
    quantize; one-line errors for a layout it does not know or a group that does not divide
    (a :class:`QuantizeError` naming ``what`` and ``model``)."""
    matrices = _matrices(config, params)
    if scheme.auto:
        scheme = Scheme("int4", _largest_group(matrices, DEFAULT_GROUP))
    try:
        return {path: _how(*spec, scheme) for path, spec in matrices.items()}
    except _GroupError as err:
        fits = _largest_group(matrices, scheme.group - 1) if scheme.group > 1 else None
        hint = f"'int4:{fits}'" if fits else "none does"
        whose = f"{model}'s " if model else ""
        raise QuantizeError(
            what or f"quantize={scheme.name!r}",
            f"{whose}{err}; give a group size that divides every matrix (here {hint}) or 'int8' "
            "(plain 'int4' picks the largest such group)",
        ) from None


def quantize_params(config, params, spec, *, what: str = "", model: str = "") -> dict:
    """``params`` (the stored layout of ``config``'s family) with every projection matrix a
    :class:`qwix.QArray` of ``spec`` (see the module docstring); the rest unchanged. ``what``
    and ``model`` name the argument and the model in errors."""
    scheme = parse(spec) if not isinstance(spec, Scheme) else spec
    how = plan(config, params, scheme, what=what, model=model)
    qtype = _BITS[scheme.mode]
    leaves = jax.tree_util.tree_flatten_with_path(params)
    flat = [
        _quantize(leaf, qtype, tuple(sorted(how[path].items()))) if path in how else leaf
        for path, leaf in leaves[0]
    ]
    return jax.tree.unflatten(leaves[1], flat)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize(w: jax.Array, qtype, how: tuple):
    import qwix

    kw = dict(how)
    tiled = kw.get("tiled_axes")
    if tiled is not None:
        kw["tiled_axes"] = dict(tiled)
    return qwix.quantize(w, qtype, **kw)


def dequantize_params(params) -> dict:
    """``params`` with every quantized matrix replaced by its float value (scale x integer)."""
    import qwix

    return jax.tree.map(lambda x: qwix.dequantize(x) if _is_q(x) else x, params, is_leaf=_is_q)


def quantize_model(model, spec, *, what: str = ""):
    """``model`` with quantized weights (its name marked ``[int8]``, ``[int4:16]``: the group
    used), a new Model; ``what`` names the argument in errors (default ``quantize=...``)."""
    from asps_jax.models.base import Model

    if not isinstance(model, Model):
        raise ValueError(f"quantize: expected a Model, got {type(model).__name__}")
    scheme = parse(spec) if not isinstance(spec, Scheme) else spec
    quantize = functools.partial(
        quantize_params, model.config, spec=scheme, what=what, model=model.name
    )
    # Abstract parameters (ShapeDtypeStruct, benchmarks/bench_tpu.py) give the quantized shapes.
    abstract = any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(model.params))
    params = jax.eval_shape(quantize, model.params) if abstract else quantize(model.params)
    scheme = fitted(model.config, model.params, scheme)
    return dataclasses.replace(model, name=f"{model.name}[{scheme.name}]", params=params)


# One quantized copy per (target, scheme) while the target lives (its params do not change: a
# new weight set is a new Model, ``Sampler.update_params``, so the copy is made again).
_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def quantized_copy(target, spec: str):
    """The draft model of ``draft="quant:int8"`` (or ``"quant:int4[:G]"``): the target's own
    weights quantized, one object per target and scheme."""
    scheme = parse(spec[len(PREFIX) :], what="draft", given=spec)
    if is_quantized(target.params):
        raise ValueError(
            f"draft={spec!r}: the target {target.name} is quantized already, and its copy is "
            "made from float weights; load the target without quantize=, or give a draft model"
        )
    per_target = _COPIES.setdefault(target, {})
    if scheme not in per_target:
        copy = quantize_model(target, scheme, what=f"draft={spec!r}")
        per_target[scheme] = dataclasses.replace(copy, name=f"{target.name}[{PREFIX}{scheme.name}]")
    return per_target[scheme]
