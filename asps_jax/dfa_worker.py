"""Builds one token DFA with outlines-core, in a child process of bounded memory and time.

outlines-core's index builder runs in Rust: a pattern whose automaton explodes (a top-level
bounded string of a JSON schema, say, whose unanchored search automaton grows exponentially)
either exhausts the memory or aborts the whole process (``memory allocation ... failed``), and
neither can be caught in Python. :func:`asps_jax.constraints.compile_regex` therefore runs this
file as a script in a child process (``python dfa_worker.py``; it imports nothing of asps_jax,
so the child starts in a fraction of a second) under an address-space limit, and reads the table
back; the parent gives one-line errors for a child that ran out of memory or time.

Protocol: a pickled ``(pattern, tokens, max_entries, memory_bytes)`` on stdin; on stdout a
pickled ``("ok", classes int32[V], next int32[S, C], final bool[S])`` (the token-class
automaton), ``("size", states, classes)`` when ``S * C`` is past ``max_entries``,
``("compile", message)`` when outlines-core refuses the pattern, or ``("memory", "")`` on a
Python MemoryError. The start state is row 0.
"""

from __future__ import annotations

import pickle
import sys


def token_classes(transitions: dict, ids: dict, vocab: int):
    """``(classes int32[V], representatives int64[C])``: tokens that every state treats alike
    (the same next state from each state, or forbidden) share a class; classes are numbered in
    the order of their first token, whose id is the class's representative. Found by hashing
    each token's column state by state (no ``S x V`` table), then checked exactly: a hash
    collision (never seen) falls back to grouping the columns themselves."""
    import numpy as np

    h = np.zeros(vocab + 1, np.uint64)  # one spare slot: outlines-core's own end token
    for s in sorted(transitions, key=ids.__getitem__):
        edges = transitions[s]
        tok = np.fromiter(edges.keys(), np.int64, len(edges))
        nxt = np.fromiter((ids[n] for n in edges.values()), np.uint64, len(edges))
        v = (nxt + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(ids[s])
        h[tok] = (h[tok] ^ v) * np.uint64(0x100000001B3) + np.uint64(0xD6E8FEB86659FD93)
    _, first, inverse = np.unique(h[:vocab], return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # classes by their first token
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    classes, representatives = rank[inverse].astype(np.int32), np.sort(first)
    if not _exact(transitions, ids, classes, representatives):
        columns: dict = {}
        for s in sorted(transitions, key=ids.__getitem__):
            for t, n in transitions[s].items():
                if t < vocab:
                    columns.setdefault(t, []).append((ids[s], ids[n]))
        seen: dict = {}
        classes = np.array(
            [seen.setdefault(tuple(columns.get(t, ())), len(seen)) for t in range(vocab)],
            np.int32,
        )
        representatives = np.unique(classes, return_index=True)[1]
    return classes, representatives


def _exact(transitions: dict, ids: dict, classes, representatives) -> bool:
    """Every token's transitions are its class representative's: per state, the same next
    state for each allowed token, and as many allowed tokens as the allowed classes hold."""
    import numpy as np

    vocab = classes.shape[0]
    sizes = np.bincount(classes, minlength=representatives.size)
    rep_of = representatives[classes]
    for edges in transitions.values():
        tok = np.fromiter((t for t in edges if t < vocab), np.int64)
        nxt = np.fromiter((ids[edges[t]] for t in tok.tolist()), np.int64, tok.size)
        reps = {t: ids[edges[t]] for t in representatives.tolist() if t in edges}
        rep_next = np.array([reps.get(t, -1) for t in rep_of[tok].tolist()], np.int64)
        allowed = sum(int(sizes[classes[t]]) for t in reps)
        if not np.array_equal(rep_next, nxt) or allowed != tok.size:
            return False
    return True


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
    classes, representatives = token_classes(transitions, ids, vocab)
    if len(ids) * representatives.size > max_entries:
        return ("size", len(ids), int(representatives.size))
    table = np.full((len(ids), representatives.size), -1, np.int32)
    for s, edges in transitions.items():
        row = table[ids[s]]
        for c, t in enumerate(representatives.tolist()):
            if t in edges:
                row[c] = ids[edges[t]]
    final = np.zeros(len(ids), bool)
    final[[ids[s] for s in finals]] = True
    return ("ok", classes, table, final)


def _limit_memory(memory_bytes: int) -> None:
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX: the time limit still holds
        return
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))


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
