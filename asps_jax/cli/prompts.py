"""``--prompts FILE`` of ``scripts/sample.py``: the file read (one prompt per line, or JSON lines
with ``"prompt"`` and an optional ``"max_new_tokens"``) and checked line by line, its prompts
sampled through ``--batch-size`` slots of a ``Session`` (continuous batching), and the JSON lines
written in prompt order, then one line of pooled statistics (docs/api.md §4). The command runs the
steps, so that it honours a Ctrl-C at the boundary between two.
"""

from __future__ import annotations

import json
import re
import sys
import time
import types

import jax
import numpy as np

from asps_jax.cli.args import sampling_kwargs
from asps_jax.cli.output import compile_counts, result, timings, write_json
from asps_jax.session import Session


def read_prompts(path) -> list[tuple[int, str, int | None]]:
    """``--prompts FILE``: ``(line number, text, max_new_tokens or None)`` per non-empty line; a
    line that starts with ``{`` is a JSON object with ``prompt`` and an optional
    ``max_new_tokens``. A UTF-8 byte-order mark opening the file is not part of its first line."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        raise ValueError(f"--prompts: cannot read {path} ({why})") from None
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            out.append((number, line, None))
            continue
        where = f"--prompts: {path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not a JSON object ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f'{where}: a JSON line needs a "prompt" string')
        budget = record.get("max_new_tokens")
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int) or budget < 1
        ):
            raise ValueError(f'{where}: "max_new_tokens" must be an integer >= 1, got {budget!r}')
        unknown = sorted(set(record) - {"prompt", "max_new_tokens"})
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown} (prompt, max_new_tokens)")
        out.append((number, record["prompt"], budget))
    if not out:
        raise ValueError(f"--prompts: {path} holds no prompts")
    return out


def check_prompt_sizes(path, records, encoded, budgets, target, draft) -> None:
    """Each prompt of ``--prompts`` against the models' context, before anything is built: a
    one-line error naming the file's line (the library's own check names no line)."""
    context = target.config.max_position_embeddings
    if draft is not None and not isinstance(draft, str):  # a drafter's name: the target's context
        context = min(context, draft.config.max_position_embeddings)
    for (number, _, own_budget), tokens, budget in zip(records, encoded, budgets):
        where = f"--prompts: {path}:{number}"
        if not tokens:
            raise ValueError(f"{where}: the prompt encodes to no tokens")
        if len(tokens) + budget > context:
            lower = '"max_new_tokens"' if own_budget is not None else "--max-new-tokens"
            raise ValueError(
                f"{where}: prompt of {len(tokens)} tokens plus max_new_tokens={budget} exceeds "
                f"the model context of {context} positions; shorten the prompt or lower {lower}"
            )


def prompt_error(err: ValueError, path, records) -> ValueError:
    """A library error naming ``prompts[i]``, with the line of ``--prompts`` FILE named instead."""
    match = re.match(r"prompts\[(\d+)\] (.*)", str(err), re.S)
    if match is None or int(match[1]) >= len(records):
        return err
    return ValueError(f"--prompts: {path}:{records[int(match[1])][0]}: the prompt {match[2]}")


# A finished prompt's statistics, as its JSON line gives them (null for a prompt in flight).
_STATISTICS = {"target_calls": int, "tokens_per_step": float, "acceptance": float, "failed_at": int}


class PromptRun:
    """The prompts of ``--prompts FILE`` through a Session: built from the flags and the loaded
    models (one-line errors naming the file's line), then :meth:`begin`, :meth:`record` of each
    ``(prompt, tokens)`` pair that ``session.steps()`` yields, :meth:`end` and :meth:`write`."""

    def __init__(self, args, target, draft, mesh):
        self.path, self.method = args.prompts, args.method
        self.records = read_prompts(self.path)
        self.tokenizer = target.tokenizer
        self.texts = [t for _, t, _ in self.records]
        encoded = [self.tokenizer.encode(t, verbose=False) for t in self.texts]
        self.budgets = [args.max_new_tokens if b is None else b for _, _, b in self.records]
        check_prompt_sizes(self.path, self.records, encoded, self.budgets, target, draft)
        self.slots = args.batch_size or 8
        kwargs = dict(
            key=jax.random.key(args.seed),
            max_new_tokens=self.budgets,
            batch_size=self.slots,
            mesh=mesh,
            **sampling_kwargs(args),
        )
        try:
            self.session = Session(target, draft, encoded, **kwargs)
        except ValueError as err:
            raise prompt_error(err, self.path, self.records) from None
        self.so_far = [[] for _ in self.records]  # each prompt's tokens as steps() yields them
        self.pairs = self.tokens = 0
        self.progress, self.start = False, 0.0

    def begin(self) -> None:
        """The run starts (with a progress line on stderr where it is a terminal)."""
        self.progress = sys.stderr.isatty()
        self.start = time.perf_counter()

    def record(self, p: int, new: list[int]) -> None:
        """Prompt ``p`` generated the tokens ``new``."""
        self.so_far[p] += new
        self.pairs += 1
        self.tokens += len(new)
        if self.progress:
            rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
            print(
                f"\r[{self.session.prompts_done}/{len(self.records)} prompts, {self.tokens} "
                f"tokens, {rate:.1f} tokens/s]",
                end="",
                file=sys.stderr,
                flush=True,
            )

    def end(self) -> float:
        """The run ended (or was interrupted); returns its seconds."""
        run_s = time.perf_counter() - self.start
        if self.progress:
            print(file=sys.stderr)
        return run_s

    def write(self, stream, interrupted: bool, load_s, compile_s, run_s):
        """One JSON line per prompt, in prompt order, then the pooled statistics; returns ``(the
        NonFiniteLogitsError of a row written or None, what was written)``.

        Interrupted: the lines of the prompts that finished, as a normal run writes them; one per
        prompt in flight with its tokens so far, ``"interrupted": true`` and null statistics (a
        prompt's statistics are handed over when it finishes); nothing for the prompts not
        started; the pooled line with ``"interrupted": true``."""
        out, failure = result(self.session)
        n = len(self.records)
        finished = self.session.finished.copy()  # all of them unless interrupted
        in_flight = (np.arange(n) < self.session.prompts_started) & ~finished
        stats = {k: np.asarray(v) for k, v in out.stats.items()}
        written = []  # the number of tokens of each line written
        for line in self._lines(out, stats, finished, in_flight):
            written.append(len(line["tokens"]))
            write_json(line, stream)
        pooled = self._pooled(out, stats, finished, written, (load_s, compile_s, run_s))
        if interrupted:
            if not finished.any():  # no finished prompt to pool
                pooled["tokens_per_step"] = pooled["acceptance"] = None
            pooled["interrupted"] = True
            pooled["finished"] = int(finished.sum())
            pooled["in_flight"] = int(in_flight.sum())
            failure = _written_failure(failure, finished)
        write_json(pooled, stream)
        what = (
            f"{int(finished.sum())} of {n} prompts ({int(in_flight.sum())} in flight written "
            f"with their tokens so far, {n - len(written)} not started)"
        )
        return failure, what

    def _lines(self, out, stats, finished, in_flight):
        """The JSON line of each prompt finished or in flight, in prompt order."""
        lengths = np.asarray(out.lengths)
        result_tokens = np.asarray(out.tokens)
        for i in range(len(self.records)):
            if finished[i]:
                line = self._line(i, result_tokens[i, : lengths[i]].tolist())
                line.update({k: cast(stats[k][i]) for k, cast in _STATISTICS.items()})
                if out.incomplete is not None:  # cut before its --regex / --json-schema matched
                    line["incomplete"] = bool(out.incomplete[i])
            elif in_flight[i]:
                row = self.so_far[i]
                line = self._line(i, row)
                line.update(dict.fromkeys(_STATISTICS), interrupted=True)
                if self.session.constraint is not None:
                    batch = [row or [-1]]
                    cut = self.session.constraint.incomplete_rows(batch, [len(row)], rows=[i])
                    line["incomplete"] = bool(cut[0])
            else:  # not started
                continue
            yield line

    def _line(self, i: int, row: list[int]) -> dict:
        """The fields every line of prompt ``i`` has, its tokens ``row``."""
        return {
            "index": i,
            "prompt": self.texts[i],
            "text": self.tokenizer.decode(row, skip_special_tokens=True),
            "tokens": row,
            "new_tokens": len(row),
            "max_new_tokens": self.budgets[i],
        }

    def _pooled(self, out, stats, finished, written: list[int], seconds) -> dict:
        """The statistics of the finished prompts (every prompt unless interrupted); ``written``:
        the number of tokens of each line written."""
        new_tokens = sum(written)
        calls = int(stats["target_calls"][finished].sum())
        done_tokens = int(np.asarray(out.lengths)[finished].sum())
        accepted = stats["accepted"][finished].sum()
        return {
            "pooled": True,
            "method": self.method,
            "prompts": len(written),
            "batch_size": self.slots,
            "new_tokens": new_tokens,
            "target_calls": calls,
            "tokens_per_step": float(done_tokens / max(calls, 1)),
            "acceptance": float(accepted / max(stats["decisions"][finished].sum(), 1)),
            "drafted_steps": int(stats["root_steps"][finished].sum()),
            **timings(new_tokens, *seconds),
            **compile_counts(),
        }


def _written_failure(failure, finished):
    """An interrupted run's NonFiniteLogitsError with only the rows of finished prompts (those
    written with their statistics), or None where none is left."""
    if failure is None:
        return None
    kept = [(r, q) for r, q in zip(failure.rows, failure.positions) if finished[r]]
    if not kept:
        return None
    rows, positions = zip(*kept)
    return types.SimpleNamespace(rows=list(rows), positions=list(positions))
