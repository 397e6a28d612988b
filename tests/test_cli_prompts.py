"""scripts/sample.py --prompts FILE (continuous batching) via main([...]) on the bundled pair."""

from __future__ import annotations

import contextlib
import io
import json
import sys

import jax
import numpy as np
import pytest
from test_cli import cli

import asps_jax
from asps_jax.cli.args import read_schema
from asps_jax.cli.output import print_summary
from asps_jax.session import Session


def _jsonl(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


@pytest.mark.slow
def test_prompts_file_gives_json_lines_in_order_with_per_prompt_budgets(tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "ROMEO:\n"
        + json.dumps({"prompt": "JULIET:", "max_new_tokens": 3})
        + "\n\nKING HENRY:\n"
        + json.dumps({"prompt": "MERCUTIO:", "max_new_tokens": 9})
        + "\n",
        encoding="utf-8",
    )
    argv = ["--prompts", str(path), "--max-new-tokens", "6", "--num-draft-tokens", "3"]
    assert cli.main([*argv, "--batch-size", "2"]) == 0
    lines = _jsonl(capsys)
    rows, pooled = lines[:-1], lines[-1]
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert [r["prompt"] for r in rows] == ["ROMEO:", "JULIET:", "KING HENRY:", "MERCUTIO:"]
    assert [r["max_new_tokens"] for r in rows] == [6, 3, 6, 9]
    for r in rows:
        assert 1 <= r["new_tokens"] <= r["max_new_tokens"] and len(r["tokens"]) == r["new_tokens"]
    assert pooled["pooled"] is True and pooled["prompts"] == 4 and pooled["batch_size"] == 2
    assert pooled["new_tokens"] == sum(r["new_tokens"] for r in rows)
    assert pooled["target_calls"] == sum(r["target_calls"] for r in rows)
    assert pooled["compiles"] + pooled["compile_cache_hits"] >= 1
    # The library's own call with the same settings: the same tokens per prompt.
    # The CLI's default dtype, f32 (the bundled checkpoints are stored bf16, load_model's default)
    target = asps_jax.load_model("tinyshakespeare-target", dtype="float32")
    draft = asps_jax.load_model("tinyshakespeare-draft", dtype="float32")
    encoded = [target.tokenizer.encode(r["prompt"], verbose=False) for r in rows]
    out = asps_jax.sample(
        target,
        draft,
        encoded,
        key=jax.random.key(0),
        max_new_tokens=[6, 3, 6, 9],
        num_draft_tokens=3,
    )
    lengths = np.asarray(out.lengths)
    for b, r in enumerate(rows):
        assert r["tokens"] == np.asarray(out.tokens)[b, : lengths[b]].tolist()


@pytest.mark.parametrize(
    "content, match",
    [
        ("", "holds no prompts"),
        ('{"prompt": 3}\n', 'needs a "prompt" string'),
        ('{"prompt": "a", "max_new_tokens": 0}\n', '"max_new_tokens" must be an integer >= 1'),
        ('{"prompt": "a", "temperature": 1}\n', "unknown keys"),
        ("{not json\n", "not a JSON object"),
    ],
)
def test_bad_prompts_files_are_one_line_errors(tmp_path, capsys, content, match):
    path = tmp_path / "p.txt"
    path.write_text(content, encoding="utf-8")
    assert cli.main(["--prompts", str(path), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sample.py: error: --prompts") and match in err and "\n" not in err


def test_prompts_and_prompt_together_are_refused(tmp_path, capsys):
    path = tmp_path / "p.txt"
    path.write_text("a\n", encoding="utf-8")
    with pytest.raises(SystemExit):
        cli.main(["--prompts", str(path), "--prompt", "b"])
    assert "--prompts and --prompt" in capsys.readouterr().err


@pytest.mark.slow
def test_json_reports_compiles(capsys):
    assert cli.main(["--max-new-tokens", "3", "--num-draft-tokens", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert isinstance(result["compiles"], int) and result["compiles"] >= 0


def test_prompts_file_takes_the_drafter_options(tmp_path, capsys):
    # --prompts builds its call from the same flags as the single batch, the drafter's included:
    # --lookup-ngram with a draft model reaches the library and is refused there (it was once
    # dropped on this path, and the run went ahead without it).
    path = tmp_path / "p.txt"
    path.write_text("ROMEO:\n", encoding="utf-8")
    assert cli.main(["--prompts", str(path), "--lookup-ngram", "2", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "lookup_ngram is an option of draft='lookup'" in err and "\n" not in err, err


# --- a prompt set run step by step; Ctrl-C; byte-order marks; errors naming the file's line ---

# Five prompts through two slots: prompt 0 (budget 1) finishes in the first step, prompt 2 takes
# its slot in the second, prompts 3 and 4 start later still.
SET = [
    {"prompt": "ROMEO:", "max_new_tokens": 1},
    "JULIET:",
    "KING HENRY:",
    "MERCUTIO:",
    {"prompt": "TYBALT:", "max_new_tokens": 5},
]
# The flags of the first test but the budget (its compiled programs: one output bucket, 16).
SET_ARGV = ["--max-new-tokens", "12", "--num-draft-tokens", "3", "--batch-size", "2"]


def _write_set(path):
    lines = [json.dumps(p) if isinstance(p, dict) else p for p in SET]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def full_set(tmp_path_factory):
    """The prompt set's file and the lines of its uninterrupted run (per prompt, then pooled)."""
    path = _write_set(tmp_path_factory.mktemp("set") / "prompts.jsonl")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert cli.main(["--prompts", str(path), *SET_ARGV]) == 0
    lines = [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]
    assert len(lines) == len(SET) + 1 and "interrupted" not in lines[-1]
    return path, lines


@pytest.mark.slow
def test_step_wise_run_gives_the_one_call_tokens_and_statistics(full_set):
    """The CLI runs a prompt set step by step (Session.steps, so that Ctrl-C can stop it); every
    prompt's tokens and statistics are those of the one compiled call (slots.run) it once made."""
    _, lines = full_set
    target = asps_jax.load_model("tinyshakespeare-target", dtype="float32")
    draft = asps_jax.load_model("tinyshakespeare-draft", dtype="float32")
    rows = lines[:-1]
    out = asps_jax.sample(
        target,
        draft,
        [target.tokenizer.encode(r["prompt"], verbose=False) for r in rows],
        key=jax.random.key(0),
        max_new_tokens=[r["max_new_tokens"] for r in rows],
        num_draft_tokens=3,
        batch_size=2,
    )
    lengths, tokens = np.asarray(out.lengths), np.asarray(out.tokens)
    stats = {k: np.asarray(v) for k, v in out.stats.items()}
    for b, r in enumerate(rows):
        assert r["tokens"] == tokens[b, : lengths[b]].tolist(), b
        assert r["new_tokens"] == int(lengths[b])
        assert r["target_calls"] == int(stats["target_calls"][b])
        assert r["tokens_per_step"] == float(stats["tokens_per_step"][b])
        assert r["acceptance"] == float(stats["acceptance"][b])
        assert r["failed_at"] == int(stats["failed_at"][b]) == -1
    assert lines[-1]["target_calls"] == int(stats["target_calls"].sum())


def _ctrl_c_after_step(k, how):
    """``Session.steps`` with Ctrl-C after its ``k``-th compiled step: the CLI's flag set as that
    step's last pair is yielded (as the SIGINT handler would), or KeyboardInterrupt raised by the
    next ``next()`` (as ``steps()`` does when SIGINT is Python's default)."""
    steps = Session.steps

    def interrupted(self):
        done = 0
        for pair in steps(self):
            done += self.step_end
            if how == "flag" and done == k and self.step_end:
                cli._CtrlC.requested = True
            yield pair
            if how == "KeyboardInterrupt" and done == k:
                raise KeyboardInterrupt

    return interrupted


@pytest.mark.slow
@pytest.mark.parametrize(
    "how, tty", [("flag", False), ("flag", True), ("KeyboardInterrupt", False)]
)
def test_ctrl_c_during_prompts_writes_finished_and_in_flight_prompts_exit_130(
    full_set, capsys, monkeypatch, how, tty
):
    """Ctrl-C after the second step: the finished prompt's line as in the full run, the two in
    flight with their tokens so far and "interrupted": true, nothing for the two not started, the
    pooled line marked, one line on stderr, exit 130 (stderr a terminal or not: the run used to be
    one compiled call that ignored Ctrl-C, or, on a terminal, to print every prompt as an empty
    finished generation, exit 0)."""
    path, full = full_set
    monkeypatch.setattr(cli._CtrlC, "requested", False)
    monkeypatch.setattr(Session, "steps", _ctrl_c_after_step(2, how))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    assert cli.main(["--prompts", str(path), *SET_ARGV]) == 130
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    rows, pooled = lines[:-1], lines[-1]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert rows[0] == full[0]  # finished: exactly the full run's line
    for r in rows[1:]:
        want = full[r["index"]]
        assert r["interrupted"] is True and r["prompt"] == want["prompt"]
        assert 1 <= r["new_tokens"] == len(r["tokens"]) < want["new_tokens"]
        assert r["tokens"] == want["tokens"][: r["new_tokens"]]  # the same draws, so far
        assert r["text"] == want["text"][: len(r["text"])] and r["text"]
        assert r["max_new_tokens"] == want["max_new_tokens"]
        for name in ("target_calls", "tokens_per_step", "acceptance", "failed_at"):
            assert r[name] is None
    assert pooled["pooled"] is True and pooled["interrupted"] is True
    assert pooled["prompts"] == 3 and pooled["finished"] == 1 and pooled["in_flight"] == 2
    assert pooled["new_tokens"] == sum(r["new_tokens"] for r in rows)
    assert pooled["target_calls"] == full[0]["target_calls"]
    err = captured.err.strip().splitlines()
    assert err[-1] == (
        "sample.py: interrupted after 1 of 5 prompts (2 in flight written with their tokens so "
        "far, 2 not started)"
    )
    assert ("prompts," in captured.err) is tty  # the progress line only on a terminal
    assert "Traceback" not in captured.err


@pytest.mark.slow
def test_ctrl_c_before_the_first_step_of_prompts_writes_nothing(full_set, capsys, monkeypatch):
    path, _ = full_set

    def interrupted(self):
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr(Session, "steps", interrupted)
    assert cli.main(["--prompts", str(path), *SET_ARGV]) == 130
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines()[-1] == (
        "sample.py: interrupted before the first step; nothing was generated"
    )


def test_byte_order_mark_does_not_make_the_first_json_line_text(tmp_path, capsys):
    """A file saved with a UTF-8 byte-order mark: its first line is still a JSON record (it used
    to be sampled as the literal text '\\ufeff{"prompt": ...}' with --max-new-tokens)."""
    path = tmp_path / "bom.jsonl"
    record = json.dumps({"prompt": "ROMEO:", "max_new_tokens": 4})
    path.write_bytes(b"\xef\xbb\xbf" + f"{record}\nJULIET:\n".encode())
    assert cli.main(["--prompts", str(path), *SET_ARGV[2:], "--max-new-tokens", "2"]) == 0
    rows = _jsonl(capsys)[:-1]
    assert [r["prompt"] for r in rows] == ["ROMEO:", "JULIET:"]
    assert [r["max_new_tokens"] for r in rows] == [4, 2]


def test_byte_order_mark_is_not_part_of_a_json_schema_file(tmp_path):
    """(It was read into the schema, which JSON then refused: "Unexpected UTF-8 BOM".)"""
    path = tmp_path / "schema.json"
    schema = json.dumps({"type": "integer"})
    path.write_bytes(b"\xef\xbb\xbf" + schema.encode())
    assert read_schema(str(path)) == schema


def test_json_schema_file_not_utf8_is_one_line_naming_flag_and_file(tmp_path, capsys):
    path = tmp_path / "schema.json"
    path.write_bytes(b'{"type": "str\xffing"}')
    assert cli.main(["--json-schema", str(path), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"sample.py: error: --json-schema: cannot read {path} (not UTF-8 text)"


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "line, where",
    [
        ("x " * 200, "--max-new-tokens"),  # 401 tokens: over the context of 256 by itself
        (json.dumps({"prompt": "ROMEO:", "max_new_tokens": 300}), '"max_new_tokens"'),
    ],
    ids=["long-prompt", "large-budget"],
)
def test_prompt_over_the_context_names_the_file_and_line(tmp_path, capsys, line, where):
    path = tmp_path / "p.txt"
    path.write_text(f"ROMEO:\n\n{line}\nJULIET:\n", encoding="utf-8")
    assert cli.main(["--prompts", str(path), "--max-new-tokens", "2"]) == 2
    err = _one_line(capsys)
    assert err.startswith(f"sample.py: error: --prompts: {path}:3: prompt of "), err
    assert "exceeds the model context of 256 positions" in err and err.endswith(where), err


def test_prompt_of_no_tokens_names_the_file_and_line(tmp_path, capsys, monkeypatch):
    target = asps_jax.load_model("tinyshakespeare-target")
    tokenizer_class = type(target.tokenizer)  # the bundled tokenizer always adds a BOS token
    encode = tokenizer_class.encode
    monkeypatch.setattr(
        tokenizer_class,
        "encode",
        lambda self, text, **kw: [] if text == "NOTHING" else encode(self, text, **kw),
    )
    path = tmp_path / "p.txt"
    path.write_text('ROMEO:\n{"prompt": "NOTHING"}\n', encoding="utf-8")
    assert cli.main(["--prompts", str(path), "--max-new-tokens", "2"]) == 2
    err = _one_line(capsys)
    assert err == f"sample.py: error: --prompts: {path}:2: the prompt encodes to no tokens"


@pytest.mark.slow
def test_prompt_lines_flag_text_cut_before_the_regex_matched(tmp_path, capsys):
    """``--regex`` with a budget too short for a match: that prompt's line says
    ``"incomplete": true``; Python's ``re`` on each line's text is the reference."""
    import re

    pattern = r"(ROMEO|JULIET): [a-z ]{5,20}\."
    path = tmp_path / "set.jsonl"
    records = [{"prompt": "ROMEO:", "max_new_tokens": 1}, {"prompt": "JULIET:"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = ["--prompts", str(path), *SET_ARGV[2:], "--max-new-tokens", "48", "--regex", pattern]
    assert cli.main(argv) == 0
    rows = _jsonl(capsys)[:-1]
    assert [r["incomplete"] for r in rows] == [
        re.fullmatch(pattern, r["text"]) is None for r in rows
    ]
    assert rows[0]["incomplete"] is True


def test_statistics_block_names_the_incomplete_rows():
    out = io.StringIO()
    summary = dict(
        method="asps", num_draft_tokens=4, num_drafts=1, new_tokens=9, batch_size=3,
        target_calls=4, tokens_per_step=2.0, tokens_per_step_stderr=0.1, acceptance=0.5,
        tokens_per_second=10.0, load_seconds=1, compile_seconds=2, run_seconds=3,
    )  # fmt: skip
    print_summary(dict(summary, incomplete=[False, True, True]), out)
    assert "constraint incomplete: rows [1, 2] (cut before the end)" in out.getvalue()
    out = io.StringIO()
    print_summary(dict(summary, incomplete=[False] * 3), out)
    assert "constraint incomplete: none" in out.getvalue()
    out = io.StringIO()
    print_summary(summary, out)  # no constraint: no line
    assert "constraint" not in out.getvalue()
