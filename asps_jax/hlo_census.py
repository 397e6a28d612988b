"""What a compiled program does per call, read from its optimized HLO text (``compiled.as_text()``):
the bytes it moves through device memory, its collectives by kind and size, its loops, and what
an accelerator program must not hold (64-bit types, host transfers).

XLA's own ``cost_analysis()`` is no figure for a decoding step: it counts a ``while`` body once
whatever its trip count, and charges an async or fused slice of a weight the whole source (1.3 to
2.7x the real traffic of a TPU step). :func:`census` walks the program as it runs: every top-level
instruction of a computation that executes (the entry; a ``while`` body times its trip count; the
larger branch of a ``conditional``; a ``call``) is charged the bytes it reads plus those it writes,
where

* a fusion operand that the fused computation only slices (``slice``, ``dynamic-slice``,
  ``gather``) is charged the slices, not the operand, and so is an async ``slice-start`` (a
  TPU's prefetch of a weight's slice into VMEM);
* an in-place update (a ``dynamic-update-slice`` or ``scatter`` at the root of a fusion, or
  alone) is charged the update, not the buffer it updates;
* an array in an on-chip memory space (a TPU layout's ``S(n)``, n > 0: VMEM, SMEM) costs nothing,
  and neither do parameters, constants, tuples, bitcasts and the ``*-done`` half of async pairs.

A ``while`` loop's trip count is XLA's ``known_trip_count`` where it gives one, else read from the
loop's condition (``i < N`` with ``i`` starting at a constant); a loop whose count neither gives
(a data-dependent loop: the redraw of an exact draw) is counted once and listed in
``Census.unknown_trips``, unless its op name holds a scope given in ``census``'s ``trips`` (the
length-aware attention's ``cache_blocks``: the caller says how many blocks a step reads, e.g.
the mean over a generation's lengths), which then gives its count. The result is a model of HBM
traffic (reuse inside a fusion assumed, across fusions not), made to compare programs and hold
them within bounds, not a profile.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

# Bytes per element of each HLO element type (sub-byte types as fractions).
ELEMENT_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
    "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3b11fnuz": 1, "f8e5m2fnuz": 1,
    "f8e4m3fnuz": 1, "token": 0,
}  # fmt: skip
WIDE_TYPES = ("s64", "u64", "f64", "c128")  # 64-bit types: emulated or refused on a TPU
COLLECTIVES = (
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
    "collective-broadcast", "ragged-all-to-all",
)  # fmt: skip
HOST_OPS = ("send", "recv", "infeed", "outfeed")
FREE_OPS = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "while",
    "conditional", "call",
}  # fmt: skip
SLICING_OPS = ("slice", "dynamic-slice", "gather")
IN_PLACE_OPS = ("dynamic-update-slice", "scatter")

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_COMP = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


@dataclasses.dataclass
class Instr:
    name: str
    shape: str  # the result's shape text (a tuple's in parentheses), layouts included
    opcode: str
    operands: list  # the operands' instruction names (a parameter: its index as text)
    attrs: str  # the text after the operand list
    root: bool = False

    def called(self, key: str) -> list[str]:
        """The computations attribute ``key`` names (``calls``, ``body``, ``to_apply``...)."""
        m = re.search(rf"\b{key}=(\{{[^}}]*\}}|%?[\w.\-]+)", self.attrs)
        return [] if m is None else re.findall(r"[\w.\-]+", m.group(1).replace("%", ""))


def shape_bytes(shape: str, hbm_only: bool = False) -> float:
    """Bytes of a shape text (the arrays of a tuple summed); ``hbm_only``: arrays whose layout
    puts them in an on-chip memory space (``S(n)``, n > 0) count 0."""
    total = 0.0
    for dtype, dims, layout in _ARRAY.findall(shape):
        if dtype not in ELEMENT_BYTES or (hbm_only and re.search(r"S\([1-9]", layout or "")):
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * ELEMENT_BYTES[dtype]
    return total


def _split_operands(rest: str) -> tuple[str, str]:
    """``rest`` (the text after ``opcode(``) as (operands, attributes), parentheses matched."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return rest[:i], rest[i + 1 :]
    return rest, ""


def parse(text: str) -> tuple[dict[str, dict[str, Instr]], str]:
    """``({computation: {instruction: Instr}}, the entry's name)`` of an HLO module's text."""
    comps: dict[str, dict[str, Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = _COMP.match(line)
            if m and not line.startswith("HloModule"):
                current = comps.setdefault(m.group(2), {})
                entry = m.group(2) if m.group(1) else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if m is None:
            continue
        operands, attrs = _split_operands(m.group(5))
        names = re.findall(r"%([\w.\-]+)", operands)
        if m.group(4) == "parameter" or not names:
            names = [t.split()[-1] for t in operands.split(",") if t.strip()]
        current[m.group(2)] = Instr(m.group(2), m.group(3), m.group(4), names, attrs, bool(m[1]))
    if entry is None:
        raise ValueError("hlo_census: the text holds no ENTRY computation (not an HLO module?)")
    return comps, entry


def _root(comp: dict[str, Instr]) -> Instr | None:
    return next((i for i in comp.values() if i.root), None)


def _constant(comp: dict[str, Instr], name: str) -> int | None:
    """The integer a scalar ``constant`` (or a ``copy`` of one) holds, else None."""
    ins = comp.get(name)
    while ins is not None and ins.opcode == "copy":
        ins = comp.get(ins.operands[0])
    if ins is None or ins.opcode != "constant":
        return None
    m = re.fullmatch(r"-?\d+", ins.operands[0] if ins.operands else "")
    return None if m is None else int(m.group(0))


def trip_count(comps: dict, comp: dict[str, Instr], loop: Instr) -> int | None:
    """A ``while`` loop's trip count: XLA's ``known_trip_count``, else ``N - i0`` from a condition
    ``i < N`` (``i`` a tuple element starting at the constant ``i0``); None when neither."""
    m = _TRIP.search(loop.attrs)
    if m is not None:
        return int(m.group(1))
    cond, init = comps.get(loop.called("condition")[0], {}), comp.get(loop.operands[0])
    root = _root(cond)
    if root is None or root.opcode != "compare" or "direction=LT" not in root.attrs:
        return None
    index, bound = (cond.get(n) for n in root.operands[:2])
    if index is None or index.opcode != "get-tuple-element" or init is None:
        return None
    limit = _constant(cond, bound.name) if bound is not None else None
    k = int(re.search(r"index=(\d+)", index.attrs).group(1))
    start = _constant(comp, init.operands[k]) if init.opcode == "tuple" else None
    return None if limit is None or start is None else max(limit - start, 0)


def _uses(body: dict[str, Instr]) -> tuple[dict[str, list[Instr]], dict[int, str]]:
    """A computation's users of each name, and its parameters by number."""
    users: dict[str, list[Instr]] = {}
    params: dict[int, str] = {}
    for i in body.values():
        for op in i.operands:
            users.setdefault(op, []).append(i)
        if i.opcode == "parameter" and i.operands and i.operands[0].isdigit():
            params[int(i.operands[0])] = i.name
    return users, params


def _sliced(comps: dict, users: dict[str, list[Instr]], param: str) -> float | None:
    """Bytes read of a fused computation's parameter ``param`` when every use only slices it,
    also through nested fusions (their parameter sliced in turn: a scanned layer's weight is a
    dynamic slice of the stacked one); None when some use reads it whole."""
    uses = users.get(param, [])
    if not uses:
        return None
    total = 0.0
    for u in uses:
        if u.opcode in SLICING_OPS and u.operands[0] == param:
            total += shape_bytes(u.shape)  # read from the source, wherever the slice lands
            continue
        if u.opcode != "fusion":
            return None
        inner_users, inner_params = _uses(comps.get(u.called("calls")[0], {}))
        parts = [_sliced(comps, inner_users, inner_params.get(k, ""))
                 for k, op in enumerate(u.operands) if op == param]  # fmt: skip
        if not parts or any(x is None for x in parts):
            return None
        total += sum(parts)
    return total


def _in_hbm(comp: dict[str, Instr], name: str) -> bool:
    return name in comp and shape_bytes(comp[name].shape, True) > 0


def _fusion_bytes(comps: dict, comp: dict[str, Instr], ins: Instr, called: str) -> float:
    """One fusion (or async computation) call: each operand as the fused computation reads it,
    plus the result; an in-place root update is charged its update only."""
    body = comps.get(called, {})
    users, params = _uses(body)
    root = _root(body)
    roots = [body[n] for n in root.operands] if root and root.opcode == "tuple" else [root]
    updates = [r for r in roots if r is not None and r.opcode in IN_PLACE_OPS]
    total = 0.0
    for k, op in enumerate(ins.operands):
        uses = users.get(params.get(k, ""), [])
        sliced = _sliced(comps, users, params.get(k, ""))
        if sliced is not None:  # a slice of an HBM array reads its bytes from HBM
            total += sliced if _in_hbm(comp, op) else 0.0
        elif uses and all(u in updates and u.operands[0] == params[k] for u in uses):
            continue  # the buffer updated in place
        elif op in comp:
            total += shape_bytes(comp[op].shape, True)
    written = shape_bytes(ins.shape, True)
    for r in updates:  # charged the update, not the updated buffer
        update = body.get(r.operands[-1] if r.opcode == "scatter" else r.operands[1])
        written += (shape_bytes(update.shape) if update else 0) - shape_bytes(r.shape)
    return total + max(written, 0.0)


def _bytes(comps: dict, comp: dict[str, Instr], ins: Instr) -> float:
    """Bytes one top-level instruction moves (0 for the free ones)."""
    op = ins.opcode
    if op in FREE_OPS or op.endswith("-done") or op == "async-update":
        return 0.0
    if op == "fusion" or op == "async-start":
        return _fusion_bytes(comps, comp, ins, ins.called("calls")[0])
    if op in IN_PLACE_OPS:
        update = comp.get(ins.operands[-1] if op == "scatter" else ins.operands[1])
        return 2 * shape_bytes(update.shape, True) if update else 0.0
    if op in SLICING_OPS:  # reads the slice from its source (HBM: even into VMEM), writes it
        read = shape_bytes(ins.shape, not _in_hbm(comp, ins.operands[0]))
        return read + shape_bytes(ins.shape, True)
    if op.endswith("-start"):  # ((operands), result, context...): the result is the 2nd array
        arrays = ["".join((a[0], f"[{a[1]}]", a[2])) for a in _ARRAY.findall(ins.shape)]
        result = arrays[1] if ins.shape.startswith("(") and len(arrays) > 1 else arrays[0]
        if op in ("slice-start", "dynamic-slice-start"):  # reads only the slice
            read = shape_bytes(result, not _in_hbm(comp, ins.operands[0]))
            return read + shape_bytes(result, True)
    else:
        result = ins.shape
    read = sum(shape_bytes(comp[o].shape, True) for o in ins.operands if o in comp)
    return read + shape_bytes(result, True)


@dataclasses.dataclass
class Census:
    """One program's figures per call (:func:`census`)."""

    traffic_bytes: float = 0.0  # modelled device-memory bytes read + written
    collectives: Counter = dataclasses.field(default_factory=Counter)  # (kind, shape) -> count
    collective_bytes: Counter = dataclasses.field(default_factory=Counter)  # kind -> bytes
    loops: Counter = dataclasses.field(default_factory=Counter)  # (trip count, op name) -> runs
    unknown_trips: int = 0  # loops whose trip count is unknown (counted once)
    host_transfers: list = dataclasses.field(default_factory=list)  # instructions that reach host
    wide_types: list = dataclasses.field(default_factory=list)  # 64-bit types found
    lines: int = 0  # optimized-HLO lines
    fusions: int = 0  # fusion instructions in the module

    def collectives_of(self, kind: str) -> int:
        """Collectives of ``kind`` (e.g. ``"all-reduce"``; async ``-start`` halves included)."""
        return sum(n for (k, _), n in self.collectives.items() if k == kind)


def _kind(op: str) -> str | None:
    base = op[: -len("-start")] if op.endswith("-start") else op
    return base if base in COLLECTIVES else None


def _collective_shape(comps: dict, ins: Instr) -> tuple:
    """(type, dims) of a collective's result: an async ``-start``'s is its tuple's second array
    (operand, result, context...), an ``async-start``'s that of the collective it wraps."""
    if ins.opcode == "async-start":
        inner = comps.get(ins.called("calls")[0], {}).values()
        ins = next(i for i in inner if _kind(i.opcode))
    arrays = _ARRAY.findall(ins.shape)
    tuple_result = ins.opcode.endswith("-start") and ins.shape.startswith("(") and len(arrays) > 1
    return arrays[1] if tuple_result else arrays[0]


def _walk(comps: dict, name: str, times: int, out: Census, given: dict) -> None:
    comp = comps.get(name, {})
    for ins in comp.values():
        out.traffic_bytes += times * _bytes(comps, comp, ins)
        kind = _kind(ins.opcode)
        if ins.opcode == "async-start":  # an async wrapper: the collective inside
            inner = comps.get(ins.called("calls")[0], {}).values()
            kind = next((_kind(i.opcode) for i in inner if _kind(i.opcode)), None)
        if kind:
            shape = _collective_shape(comps, ins)
            out.collectives[(kind, f"{shape[0]}[{shape[1]}]")] += times
            out.collective_bytes[kind] += times * shape_bytes(f"{shape[0]}[{shape[1]}]")
        if ins.opcode in HOST_OPS or (
            ins.opcode == "custom-call" and re.search(r"callback|host", ins.attrs, re.I)
        ):
            out.host_transfers.append(f"{ins.opcode} {ins.name}")
        if ins.opcode == "while":
            trips = trip_count(comps, comp, ins)
            m = re.search(r'op_name="([^"]*)"', ins.attrs)
            if trips is None and m:
                trips = next((n for scope, n in given.items() if f"/{scope}/" in m.group(1)), None)
            out.loops[(trips, m.group(1) if m else ins.name)] += times
            out.unknown_trips += trips is None
            _walk(comps, ins.called("body")[0], times * (1 if trips is None else trips), out, given)
        elif ins.opcode == "conditional":
            branches = [b for key in ("branch_computations", "true_computation",
                        "false_computation") for b in ins.called(key)]  # fmt: skip
            costs = []
            for b in branches:
                part = Census()
                _walk(comps, b, times, part, given)
                costs.append(part)
            if costs:
                best = max(costs, key=lambda c: c.traffic_bytes)
                _merge(out, best)
        elif ins.opcode == "call":
            _walk(comps, ins.called("to_apply")[0], times, out, given)


def _merge(out: Census, part: Census) -> None:
    out.traffic_bytes += part.traffic_bytes
    out.collectives.update(part.collectives)
    out.collective_bytes.update(part.collective_bytes)
    out.loops.update(part.loops)
    out.unknown_trips += part.unknown_trips
    out.host_transfers += part.host_transfers


def census(text: str, trips: dict[str, int] | None = None) -> Census:
    """The figures of one call of the program whose optimized HLO is ``text``; ``trips``: the
    trip count of a data-dependent loop by a scope its op name holds (``{"cache_blocks": 3}``)."""
    comps, entry = parse(text)
    out = Census()
    _walk(comps, entry, 1, out, dict(trips or {}))
    out.wide_types = sorted(set(re.findall(rf"\b({'|'.join(WIDE_TYPES)})\[", text)))
    out.lines = text.count("\n") + 1
    out.fusions = sum(i.opcode == "fusion" for c in comps.values() for i in c.values())
    return out


def source_loops(c: Census, scope: str = "") -> dict:
    """The loops the program's source wrote (``lax.while_loop`` / ``fori_loop``: an op name
    ending in ``/while``), not those XLA made (a scatter or sort expanded into a loop keeps its
    own op name), whose op name holds ``scope`` (e.g. ``"commit"``): ``{(trips, name): runs}``."""
    return {k: n for k, n in c.loops.items() if k[1].endswith("/while") and scope in k[1]}
