"""Builds one token DFA with outlines-core, in a child process of bounded memory and time.

outlines-core's index builder runs in Rust: a pattern whose automaton explodes (a top-level
bounded string of a JSON schema, say, whose unanchored search automaton grows exponentially)
either exhausts the memory or aborts the whole process (``memory allocation ... failed``), and
neither can be caught in Python. :func:`asps_jax.controls.constraints.compile_regex` therefore runs
this file as a script in a child process (``python dfa_worker.py``; it imports nothing of asps_jax,
so the child starts in a fraction of a second) under an address-space limit, and reads the table
back; the parent gives one-line errors for a child that ran out of memory or time. A lower
address-space limit the caller runs under (``ulimit -v``) is inherited and kept, never raised.

Protocol: a pickled ``(pattern, tokens, max_entries, memory_bytes)`` on stdin; on stdout a
pickled ``("ok", classes int32[V], next int32[S, C], final bool[S])`` (the token-class
automaton), ``("size", states, classes)`` when ``S * C`` is past ``max_entries``,
``("compile", message)`` when outlines-core refuses the pattern, or ``("memory", "")`` on a
Python MemoryError. The start state is row 0.
"""

from __future__ import annotations

import pickle
import sys


def state_rows(transitions: dict, ids: dict, vocab: int) -> list:
    """``[(state id, tokens int64[k], next state ids int64[k])]``, one per state with
    transitions, in state id order (tokens past the vocabulary, outlines-core's own end token,
    left out)."""
    import numpy as np

    rows = []
    for s in sorted(transitions, key=ids.__getitem__):
        edges = transitions[s]
        tok = np.fromiter(edges.keys(), np.int64, len(edges))
        nxt = np.fromiter((ids[n] for n in edges.values()), np.int64, len(edges))
        keep = tok < vocab
        rows.append((ids[s], tok[keep], nxt[keep]))
    return rows


def number_classes(keys):
    """``(classes int32[V], representatives int64[C])`` for per-token keys (``[V]`` or ``[V, D]``):
    equal keys share a class, classes numbered in the order of their first token (the
    representative)."""
    import numpy as np

    _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return rank[inverse.reshape(-1)].astype(np.int32), np.sort(first)


def token_classes(rows: list, vocab: int):
    """``(classes int32[V], representatives int64[C])``: tokens that every state treats alike
    (the same next state from each state, or forbidden) share a class, found by hashing each
    token's column state by state (no ``S x V`` table). :func:`class_table` then checks the
    classes exactly; :func:`exact_classes` is the fallback for a hash collision."""
    import numpy as np

    h = np.zeros(vocab, np.uint64)
    for sid, tok, nxt in rows:
        v = (nxt.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        v += np.uint64(sid)
        h[tok] = (h[tok] ^ v) * np.uint64(0x100000001B3) + np.uint64(0xD6E8FEB86659FD93)
    return number_classes(h)


def exact_classes(rows: list, vocab: int):
    """:func:`token_classes` by the columns themselves (each token's ``(state, next)`` pairs):
    slower, and free of collisions."""
    import numpy as np

    columns: list[list] = [[] for _ in range(vocab)]
    for sid, tok, nxt in rows:
        for t, n in zip(tok.tolist(), nxt.tolist()):
            columns[t].append((sid, n))
    seen: dict = {}
    keys = np.array([seen.setdefault(tuple(c), len(seen)) for c in columns], np.int64)
    return number_classes(keys)


def class_table(rows: list, classes, representatives, num_states: int):
    """``next int32[S, C]``: each state's next state for each class's representative (-1:
    forbidden), or None when some token's transition is not its class's (a hash collision):
    each state's dense row is rebuilt and compared in full, so a table returned is exact."""
    import numpy as np

    vocab = classes.shape[0]
    table = np.full((num_states, representatives.size), -1, np.int32)
    dense = np.empty(vocab, np.int64)
    for sid, tok, nxt in rows:
        dense.fill(-1)
        dense[tok] = nxt
        table[sid] = dense[representatives]
        if not np.array_equal(table[sid][classes], dense):
            return None
    return table


def build_table(pattern: str, tokens: list, max_entries: int):
    """``("ok", classes, next, final)``, ``("size", states, classes)`` or ``("compile",
    message)`` for ``pattern`` over the vocabulary ``tokens`` (byte strings, None for ids that
    are never allowed): the token-class automaton, ``next int32[S, C]`` indexed by
    ``classes int32[V]`` (:func:`token_classes`)."""
    import numpy as np
    from outlines_core import Index, Vocabulary

    vocab = len(tokens)
    mapping: dict[bytes, list[int]] = {}
    for i, t in enumerate(tokens):
        if t is not None:
            mapping.setdefault(t, []).append(i)
    eos = vocab  # outlines-core's own end token: an id outside ours (ours are the EOS ids)
    try:
        index = Index(pattern, Vocabulary(eos, mapping))
    except (ValueError, TypeError, RuntimeError) as err:
        return ("compile", " ".join(str(err).split()))
    # outlines-core 0.2 has no cheaper size query than the transitions themselves (its Index
    # offers get_transitions / get_allowed_tokens / get_next_state only): the states are counted
    # on them, after the parent's estimate kept a pattern past the bound from getting here.
    transitions = index.get_transitions()
    finals = set(index.get_final_states())
    start = index.get_initial_state()
    states = {start} | set(transitions) | finals
    for edges in transitions.values():
        states |= set(edges.values())
    ids = {s: i for i, s in enumerate([start] + sorted(states - {start}))}
    rows = state_rows(transitions, ids, vocab)
    for group in (token_classes, exact_classes):  # the second after a hash collision only
        classes, representatives = group(rows, vocab)
        if len(ids) * representatives.size > max_entries:
            return ("size", len(ids), int(representatives.size))
        table = class_table(rows, classes, representatives, len(ids))
        if table is not None:
            break
    final = np.zeros(len(ids), bool)
    final[[ids[s] for s in finals]] = True
    return ("ok", classes, table, final)


def _limit_memory(memory_bytes: int) -> None:
    """Lower the address-space limit to ``memory_bytes``; a lower limit inherited from the
    caller (``ulimit -v``, ``prlimit --as``, a batch scheduler's) is kept as it is: a process may
    lower its limits, never raise them past the hard one."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX: the time limit still holds
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    bound = min(v for v in (soft, hard, 1 << 63) if v != resource.RLIM_INFINITY)
    if 0 < memory_bytes < bound:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, hard))


def inherited_limit() -> int | None:
    """The address-space limit (bytes) this process runs under and its children inherit (the
    soft ``RLIMIT_AS``), None when there is none."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft in (resource.RLIM_INFINITY, -1) else soft


def limit_error(what: str, limit: int, wanted: int, detail: str) -> str:
    """The one-line error of a child that failed under the caller's ``limit``, lower than the
    ``wanted`` bytes: the limit is named as what failed, not the pattern."""
    return (
        f"{what}: outlines-core failed building the constraint's DFA under the address-space "
        f"limit of {limit / (1 << 30):.2f} GiB this process runs under (ulimit -v / RLIMIT_AS, "
        f"below the {wanted / (1 << 30):.1f} GiB the builder may use; {detail}): raise that "
        "limit, or simplify the pattern"
    )


def main() -> None:
    pattern, tokens, max_entries, memory_bytes = pickle.load(sys.stdin.buffer)
    _limit_memory(memory_bytes)
    try:
        result = build_table(pattern, tokens, max_entries)
    except MemoryError:
        result = ("memory", "")
    pickle.dump(result, sys.stdout.buffer, protocol=pickle.HIGHEST_PROTOCOL)
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    main()
