"""engine/ reads like the architecture (README, Layout): no import cycles between its modules, no module
over MAX_LINES without its reason written at its top, and every package says what lives in it and what it
may import."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "engine"
MAX_LINES = 500
LONG_REASON = "Longer than 500 lines because"


def module_name(path: Path) -> str:
    parts = path.relative_to(ENGINE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ENGINE.rglob("*.py")}


def imports(path: Path, known: set[str]) -> set[str]:
    """The engine modules `path` imports, anywhere in it (a late import inside a function counts too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {name for name in found if name in known and name != "engine"}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    mods = modules()
    # a package's __init__ re-exporting its own modules is how a package is read, not a cycle
    graph = {name: {m for m in imports(path, set(mods)) if not (path.name == "__init__.py" and m.startswith(name + "."))}
             for name, path in mods.items()}
    assert cycles(graph) == []


def test_long_modules_say_why_at_their_top():
    long = {name: len(path.read_text().splitlines()) for name, path in modules().items()
            if len(path.read_text().splitlines()) > MAX_LINES}
    unexplained = [f"{name} ({n} lines)" for name, n in long.items()
                   if LONG_REASON not in (ast.get_docstring(ast.parse(modules()[name].read_text())) or "")]
    assert unexplained == []


def test_every_package_says_what_lives_there_and_what_it_may_import():
    for path in ENGINE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert doc and "import" in doc.lower(), f"{path.relative_to(ENGINE.parent)} needs a docstring: what lives here, " \
                                        f"what it may import"


# (package, what no module in it may import): the layers the package docstrings state
FORBIDDEN = [
    ("engine.config", ("engine.runtime", "engine.strategies", "engine.techniques", "engine.telemetry", "engine.models",
                       "engine.data", "engine.optim", "engine.bench")),
    ("engine.models", ("engine.runtime", "engine.strategies", "engine.techniques", "engine.telemetry")),
    ("engine.techniques", ("engine.strategies", "engine.runtime.worker", "engine.runtime.launch", "engine.telemetry")),
    ("engine.strategies", ("engine.runtime.worker", "engine.runtime.launch")),
    ("engine.telemetry", ("engine.runtime", "engine.strategies", "engine.techniques")),
    ("engine.telemetry.protocol", ("engine.",)),
]


def test_packages_import_only_the_layers_below_them():
    mods = modules()
    broken = []
    for name, path in mods.items():
        for package, forbidden in FORBIDDEN:
            if name == package or name.startswith(package + "."):
                broken += [f"{name} imports {m}" for m in sorted(imports(path, set(mods)))
                           if m.startswith(forbidden) and not m.startswith(package)]
    assert broken == []


def test_the_console_and_widgets_import_nothing_of_the_engine_but_its_protocol():
    """DESIGN.md: the console and widgets read `engine.protocol` alone, so a console never pulls torch in and
    nothing in the engine waits on the console's code (`trainyard demo`, which needs both, is demo/launch.py)."""
    broken = []
    for folder in ("console", "widgets"):
        for path in (ENGINE.parent / folder).rglob("*.py"):
            if path.name == "bench.py":   # `trainyard bench console`: its child serves the feed through the real hub
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
                if isinstance(node, ast.ImportFrom) and node.module == "engine":
                    names = [f"engine.{a.name}" for a in node.names]
                broken += [f"{path.relative_to(ENGINE.parent)} imports {n}" for n in names
                           if n.startswith("engine") and n not in ("engine.protocol",)]
    assert broken == []
