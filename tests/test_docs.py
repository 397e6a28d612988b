"""The documentation is true to the code and stands on its own: every ``docs/<file>.md §X``
pointer in the tree resolves to a heading of that file, local Markdown links resolve, nothing
points or reads outside the repository, docs/design.md's module map lists exactly the package's
modules, and docs/api.md lists exactly the public names (``__all__``)."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TEXT_SUFFIXES = {".py", ".md", ".toml", ".ipynb", ".cfg", ".txt", ".json", ".yaml", ".yml", ""}
# "algorithms.md §3.5", "docs/api.md §1", "algorithms §3.6, §3.8": a named doc, then its sections.
NAMED = re.compile(
    r"(?:docs/)?\b(algorithms|api|design)(?:\.md)?,?\s+(§\d+(?:\.\d+)*(?:(?:,\s*|\s+and\s+)§\d+(?:\.\d+)*)*)"
)
SECTION = re.compile(r"§(\d+(?:\.\d+)*)")
HEADING = re.compile(r"^#{1,6}\s+§(\d+(?:\.\d+)*)(?=[.\s])", re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout.decode()
        files = [ROOT / name for name in out.split("\0") if name]
    except (OSError, subprocess.SubprocessError):
        files = [p for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]
    return [p for p in files if p.suffix in TEXT_SUFFIXES and p.is_file()]


def _text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def _sections(doc: str) -> set[str]:
    return set(HEADING.findall((DOCS / f"{doc}.md").read_text(encoding="utf-8")))


def _references() -> list[tuple[str, str, str]]:
    """``(file, doc, section)`` for every § pointer. A bare ``§X`` refers to the file itself in
    docs/, and to algorithms.md elsewhere (the code's convention: api.md is always named)."""
    refs = []
    for path in _tracked_files():
        if path.suffix not in (".py", ".md", ".ipynb"):
            continue
        text = _text(path)
        if text is None or "§" not in text:
            continue
        rel = path.relative_to(ROOT).as_posix()
        default = path.stem if rel.startswith("docs/") else "algorithms"
        named_spans = []
        for match in NAMED.finditer(text):
            named_spans.append(match.span(2))
            refs += [(rel, match.group(1), s) for s in SECTION.findall(match.group(2))]
        for match in SECTION.finditer(text):
            if not any(a <= match.start() < b for a, b in named_spans):
                refs.append((rel, default, match.group(1)))
    return refs


def test_docs_exist_with_the_section_numbers_the_code_cites():
    for name in ("algorithms", "api", "design"):
        assert (DOCS / f"{name}.md").is_file()
    wanted = {"0", "1", "2", "2.2", "3", "3.1", "3.5", "3.6", "3.8", "3.10", "4", "5", "6", "7"}
    wanted |= {f"3.{i}" for i in range(11)} | {f"2.{i}" for i in range(1, 9)}
    assert wanted <= _sections("algorithms")
    assert {"1", "2", "3", "4"} <= _sections("api")
    assert re.search(r"^## Models$", (DOCS / "design.md").read_text(), re.M)


def test_every_section_pointer_resolves():
    refs = _references()
    assert len(refs) > 40  # the scan sees the docstrings' pointers
    sections = {page.stem: _sections(page.stem) for page in DOCS.glob("*.md")}
    missing = sorted({(f, d, s) for f, d, s in refs if s not in sections[d]})
    assert missing == [], f"unresolved pointers (file, doc, section): {missing}"


def test_every_docs_file_named_in_the_tree_exists():
    named = set()
    for path in _tracked_files():
        text = _text(path)
        if text is not None:
            named |= set(re.findall(r"\bdocs/([A-Za-z0-9_]+\.md)", text))
    assert named and all((DOCS / name).is_file() for name in named), named


def test_local_markdown_links_resolve():
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            assert dest.exists() and ROOT in dest.parents, f"{page.name}: {target}"
            if anchor and dest.suffix == ".md":
                slugs = {
                    re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                    for h in re.findall(r"^#+\s+(.*)$", dest.read_text(encoding="utf-8"), re.M)
                }
                assert anchor in slugs, f"{page.name}: {target}"


def test_nothing_points_outside_the_repository():
    shared = "/".join(["..", "shared"])
    forbidden = (shared, "/work/" + "shared", "shared/" + "ALGORITHMS", "shared/" + "data")
    offenders = []
    for path in _tracked_files():
        text = _text(path)
        if text is None:
            continue
        rel = path.relative_to(ROOT)
        offenders += [f"{rel}: {s}" for s in forbidden if s in text]
        if path.suffix == ".py":
            # Path literals climbing out of the working directory, and Path(__file__).parents[i]
            # above the repository root (parents[len(parts) - 1] is the root).
            offenders += [f"{rel}: a '..' path" for _ in re.finditer(r"[\"']\.\./", text)]
            for i in map(int, re.findall(r"parents\[(\d+)\]", text)):
                if i > len(rel.parts) - 1:
                    offenders.append(f"{rel}: parents[{i}]")
    assert offenders == []


def test_the_corpus_ships_in_the_repository():
    corpus = ROOT / "data" / "tinyshakespeare.txt"
    assert corpus.is_file() and corpus.stat().st_size > 1_000_000


@pytest.mark.parametrize("doc", ["algorithms", "api", "design", "benchmarks"])
def test_readme_links_the_docs(doc):
    assert f"docs/{doc}.md" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_stays_a_front_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 300
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    assert ci.startswith("python -m pytest") and f'pip install -e ".[test]" && {ci}' in readme


def _section(page: str, heading: str) -> str:
    """The text of ``docs/<page>`` under ``## <heading>``, up to the next level-2 heading."""
    text = (DOCS / page).read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/{page} has no '## {heading}' section"
    return match.group(1)


def test_design_module_map_lists_every_module_of_the_package():
    """The map is the fenced block under '## Module map'; each line starts with a module's path."""
    block = re.search(r"^```\n(.*?)^```", _section("design.md", "Module map"), re.M | re.S)
    assert block, "docs/design.md: the module map is a fenced block"
    listed = re.findall(r"^(asps_jax/\S+\.py)\s", block.group(1), re.M)
    assert len(listed) == len(set(listed)), "a module is listed twice"
    package = {p.relative_to(ROOT).as_posix() for p in (ROOT / "asps_jax").rglob("*.py")}
    assert set(listed) == package, (
        f"docs/design.md's module map: missing {sorted(package - set(listed))}, "
        f"not in the package {sorted(set(listed) - package)}"
    )


# The public namespaces docs/api.md documents, each under '### `<module>`' in '## Public names'.
PUBLIC_MODULES = ("asps_jax", "asps_jax.verify", "asps_jax.models")


def _documented_names() -> dict[str, list[str]]:
    """``{module: names}`` from docs/api.md: the list items ``- `name` — ...`` under each
    ``### `module``` heading of '## Public names'."""
    parts = re.split(r"^### `([\w.]+)`\s*$", _section("api.md", "Public names"), flags=re.M)
    return {
        module: re.findall(r"^- `(\w+)`", body, re.M)
        for module, body in zip(parts[1::2], parts[2::2], strict=True)
    }


def test_api_documents_exactly_the_public_names():
    documented = _documented_names()
    assert sorted(documented) == sorted(PUBLIC_MODULES)
    for module in PUBLIC_MODULES:
        names = documented[module]
        assert len(names) == len(set(names)), f"docs/api.md lists a name twice under {module}"
        public = set(importlib.import_module(module).__all__)
        assert set(names) == public, (
            f"{module}: in __all__ but not in docs/api.md {sorted(public - set(names))}; "
            f"in docs/api.md but not in __all__ {sorted(set(names) - public)}"
        )


def test_public_names_exist():
    for module in PUBLIC_MODULES:
        mod = importlib.import_module(module)
        assert [n for n in mod.__all__ if not hasattr(mod, n)] == [], module


def test_readme_model_table_is_the_cards():
    """The README's model table is made from ``models/*/card.json``: a new card (or a changed
    repo id or pair) shows in the README or this fails; the table's text is printed by
    ``python -c "from asps_jax.models import cards; print(cards.markdown_table())"``."""
    from asps_jax.models import cards

    table = cards.markdown_table()
    assert table in (ROOT / "README.md").read_text(encoding="utf-8")
    for alias in cards.known_aliases():  # every alias in it, independently of how it is made
        assert f"`{alias}`" in table


def test_every_script_help_opens_with_a_whole_sentence():
    """A script's ``--help`` opens with its docstring's first paragraph (not its first line, which
    can stop mid-sentence), and that paragraph ends a sentence."""
    for script in sorted([*(ROOT / "scripts").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]):
        source = script.read_text(encoding="utf-8")
        if "ArgumentParser(" not in source:
            continue
        assert "__doc__.splitlines()[0]" not in source, script.name
        first = ast.get_docstring(ast.parse(source), clean=False).split("\n\n")[0].strip()
        assert first.endswith("."), (script.name, first[-40:])
