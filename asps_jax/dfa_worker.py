"""Builds one token DFA with outlines-core, in a child process of bounded memory and time.

outlines-core's index builder runs in Rust: a pattern whose automaton explodes (a top-level
bounded string of a JSON schema, say, whose unanchored search automaton grows exponentially)
either exhausts the memory or aborts the whole process (``memory allocation ... failed``), and
neither can be caught in Python. :func:`asps_jax.constraints.compile_regex` therefore runs this
file as a script in a child process (``python dfa_worker.py``; it imports nothing of asps_jax,
so the child starts in a fraction of a second) under an address-space limit, and reads the table
back; the parent gives one-line errors for a child that ran out of memory or time.

Protocol: a pickled ``(pattern, tokens, max_entries, memory_bytes)`` on stdin; on stdout a
pickled ``("ok", next int32[S, V], final bool[S])``, ``("size", states)`` when ``S * V`` is past
``max_entries``, ``("compile", message)`` when outlines-core refuses the pattern, or
``("memory", "")`` on a Python MemoryError. The start state is row 0.
"""

from __future__ import annotations

import pickle
import sys


def build_table(pattern: str, tokens: list, max_entries: int):
    """``("ok", next, final)``, ``("size", states)`` or ``("compile", message)`` for ``pattern``
    over the vocabulary ``tokens`` (byte strings, None for ids that are never allowed)."""
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
    if len(states) * vocab > max_entries:
        return ("size", len(states))
    ids = {s: i for i, s in enumerate([start] + sorted(states - {start}))}
    table = np.full((len(ids), vocab), -1, np.int32)
    for s, edges in transitions.items():
        for token, nxt in edges.items():
            if token < vocab:
                table[ids[s], token] = ids[nxt]
    final = np.zeros(len(ids), bool)
    final[[ids[s] for s in finals]] = True
    return ("ok", table, final)


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
