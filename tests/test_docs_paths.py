"""Every repository path the docs name exists: README.md and docs/*.md, so a reader who follows one finds it.

    .venv/bin/python -m pytest tests/test_docs_paths.py

A path is a token that starts at one of the repository's folders (`engine/run/worker.py`,
`tests/test_layout.py::test_no_import_cycles`, `demo/configs/*.toml`), in backticks or in prose; a
`:symbol` or `::test` after it is not part of it, and a glob must match something. What a run writes
(`runs/NAME/...`, `~/...`, `/tmp/...`) never starts at a repository folder, and a path with a placeholder
in capitals (`engine/strategies/NAME/`) is a pattern, not a file: both are left alone. A doc named bare
(`memory.md`, `DESIGN.md`) is at the top or in docs/; relative Markdown links (`[memory](memory.md)`) are
checked from their doc's folder.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("engine", "tests", "docs", "demo", "widgets", "console", r"\.ci")
# not inside another path or a word (`runs/x/docs/`, `~/tests/`, `myengine/`): the token starts here
PATH = re.compile(rf"(?<![\w./~-])((?:{'|'.join(FOLDERS)})/(?:[\w./*-]*[\w/*])?)")
DOC = re.compile(r"(?<![\w./~-])([\w-]+\.md)\b")   # a doc named without its folder
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
PLACEHOLDER = re.compile(r"(?:^|[/._-])[A-Z][A-Z0-9]*(?=$|[/._-])")   # NAME, DIR, N: a segment in capitals


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def named_paths(text: str) -> set[str]:
    return {m.group(1) for m in PATH.finditer(text) if not PLACEHOLDER.search(m.group(1))}


def exists(path: Path) -> bool:
    """A file or folder, or a glob (only ever under ROOT) that matches one."""
    return any(ROOT.glob(str(path.relative_to(ROOT)))) if "*" in str(path) else path.exists()


def missing(doc: Path) -> list[str]:
    text = doc.read_text()
    gone = [p for p in sorted(named_paths(text)) if not exists(ROOT / p)]
    gone += [name for name in sorted(set(DOC.findall(text)))
             if not (exists(ROOT / name) or exists(ROOT / "docs" / name))]
    for target in sorted({m.group(1) for m in LINK.finditer(text)}):
        if "://" not in target and not target.startswith("mailto:") and not exists(doc.parent / target):
            gone.append(f"{target} (a link)")
    return gone


def test_every_path_a_doc_names_exists():
    broken = [f"{doc.relative_to(ROOT)} names {path}, which is not in the repository"
              for doc in docs() for path in missing(doc)]
    assert broken == [], "\n".join(broken)


def test_the_scan_finds_paths_and_leaves_user_paths_alone():
    """The check above is not vacuous: it sees a path in backticks, in prose, before a symbol and as a glob,
    and a doc named bare; it skips what a run writes and placeholders."""
    text = ("`engine/run/worker.py` and engine/runtime/control.py:exchange, tests/test_layout.py::test_x, "
            "demo/configs/*.toml; runs/NAME/docs/x.md, ~/tests/a.py, /tmp/engine/b.py, "
            "engine/strategies/NAME/, docs/gone.md.")
    assert named_paths(text) == {"engine/run/worker.py", "engine/runtime/control.py", "tests/test_layout.py",
                                 "demo/configs/*.toml", "docs/gone.md"}
    assert exists(ROOT / "demo/configs/*.toml") and not exists(ROOT / "docs/gone.md")
    assert set(DOC.findall("memory.md, DESIGN.md and docs/memory.md")) == {"memory.md", "DESIGN.md"}
