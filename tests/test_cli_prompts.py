"""scripts/sample.py --prompts FILE (continuous batching) via main([...]) on the bundled pair."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from test_cli import cli

import asps_jax


def _jsonl(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


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
