"""engine/ reads like the architecture (README, Layout): no import cycles between its modules, no module
over MAX_LINES (400) in engine/, console/ or widgets/, and every package says what lives in it and what it
may import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "engine"
MAX_LINES = 400


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


def test_no_module_is_over_the_line_limit():
    root = ENGINE.parent
    paths = [p for folder in ("engine", "console", "widgets") for p in (root / folder).rglob("*.py")]
    long = [f"{p.relative_to(root)} ({n} lines)" for p in paths if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert long == [], f"over {MAX_LINES} lines: split along a seam (a collaborator that owns its state)"


def test_every_package_says_what_lives_there_and_what_it_may_import():
    for path in ENGINE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert doc and "import" in doc.lower(), f"{path.relative_to(ENGINE.parent)} needs a docstring: what lives here, " \
                                        f"what it may import"


# The floors, lowest first (README, Layout): a module imports its own package and the floors below it, never one
# above. A name is its package, or its module where a package's modules sit on different floors; a `*` stands
# for one part of a name (engine.strategies.*.spec: every strategy's spec.py, on the config's floor).
FLOORS = [
    ("engine.telemetry.protocol", "engine.protocol",   # engine.protocol: the consoles' door to it
     "engine.telemetry.figures",                       # every per-rank figure, declared once: the protocol's
     "engine.telemetry.records",                       # a record's compact forms and the log's parts: the same
     "engine.runtime.disk"),                           # a leaf: what every writer says of a full disk
    ("engine.config", "engine.strategies.specs",   # specs: the registry of every strategy, torch-free, for the
     "engine.strategies.*.spec"),                  # config; each strategy's spec.py: its settings and checks
    ("engine.training.precision", "engine.training.timing", "engine.training.loss", "engine.training.evaluation",
     "engine.training.optim", "engine.training.data", "engine.training.token_scan",
     "engine.training.throughput", "engine.models"),
    ("engine.telemetry",),
    ("widgets",),                                  # the console's panels: plain data, no engine
    ("console",),                                  # engine.protocol alone; its bench serves a feed through the hub
    ("engine.runtime",),                           # the ground: devices, ledger, topology, checkpoint, control...
    ("engine.processes", "engine.techniques"),
    ("engine.strategies",),
    ("engine.run",),                               # launch, the step loop, rank setup, handover
    ("engine.bench", "engine.cli", "engine.worker", "engine.ctl", "engine", "demo"),
]
PACKAGES = ("engine", "console", "widgets", "demo")   # what the floors order: every module of the product


def product_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ENGINE.parent / package).rglob("*.py")}


def within(module: str, name: str) -> bool:
    """`module` is `name` or inside it; a `*` in `name` matches any one part of `module`."""
    parts, pattern = module.split("."), name.split(".")
    return len(parts) >= len(pattern) and all(p in ("*", m) for p, m in zip(pattern, parts))


def floor_of(module: str) -> int | None:
    """The floor of the longest name that holds `module`."""
    best, found = -1, None
    for level, names in enumerate(FLOORS):
        for name in names:
            if within(module, name) and len(name) > best:
                best, found = len(name), level
    return found


CONFIG_FLOOR = floor_of("engine.config")


def test_every_module_has_a_floor():
    assert [name for name in product_modules() if floor_of(name) is None] == []


def test_no_module_imports_a_floor_above_its_own():
    """Imports anywhere in a module count (a late import inside a function too), and so does a module named in a
    string (the fork server's preload, `trainyard bench console`'s registry): a name a module hands to an
    importer is an import."""
    mods = product_modules()
    broken = []
    for name, path in mods.items():
        named = {node.value for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in mods}
        for m in sorted(imports(path, set(mods)) | named):
            if floor_of(m) > floor_of(name) and not m.startswith(name + "."):
                broken.append(f"{name} (floor {floor_of(name)}) imports {m} (floor {floor_of(m)})")
    assert broken == []


def test_the_layout_test_sees_an_arrow_up():
    """The check above is not vacuous: the runtime naming the run, or a technique a strategy, is caught."""
    assert floor_of("engine.run.worker") > floor_of("engine.runtime.devices")
    assert floor_of("engine.strategies.ddp") > floor_of("engine.techniques.updates.updater")
    assert floor_of("engine.telemetry.hub") < floor_of("engine.runtime.control")
    assert floor_of("console.bench") < floor_of("engine.bench") and floor_of("console.app") > floor_of("widgets.stages")
    # a strategy's spec.py sits on the config's floor, the rest of its package above: its spec importing its own
    # strategy is an arrow up, and only a part named `spec` is placed there
    assert floor_of("engine.strategies.sharded.spec") == floor_of("engine.strategies.ddp.spec") == CONFIG_FLOOR
    assert floor_of("engine.strategies.sharded.strategy") == floor_of("engine.strategies.sharded") > CONFIG_FLOOR
    assert floor_of("engine.strategies.sharded.specs") == floor_of("engine.strategies.sharded.spec_plan") > CONFIG_FLOOR
    assert floor_of("engine.strategies.specs.registry") == CONFIG_FLOOR < floor_of("engine.strategies.interface")
    assert "console.bench" in {node.value for node in ast.walk(ast.parse((ENGINE / "bench" / "__init__.py").read_text()))
                               if isinstance(node, ast.Constant)}   # seen as engine.bench's arrow to the console


def test_the_console_and_widgets_import_nothing_of_the_engine_but_its_protocol():
    """docs/architecture.md: the console and widgets read `engine.protocol` alone, so a console never pulls torch in and
    nothing in the engine waits on the console's code (`trainyard demo`, which needs both, is demo/launch.py)."""
    broken = []
    for folder in ("console", "widgets"):
        for path in (ENGINE.parent / folder).rglob("*.py"):
            # `trainyard bench console`: its child serves a feed through the real hub and log, and nothing else
            allowed = ("engine.protocol", "engine.telemetry.hub", "engine.telemetry.log", "engine.telemetry.outlets") \
                if path.relative_to(ENGINE.parent).as_posix() == "console/bench.py" else ("engine.protocol",)
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
                if isinstance(node, ast.ImportFrom) and node.module == "engine":
                    names = [f"engine.{a.name}" for a in node.names]
                broken += [f"{path.relative_to(ENGINE.parent)} imports {n}" for n in names
                           if n.startswith("engine") and n not in allowed]
    assert broken == []


def torch_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        found += [n for n in names if n == "torch" or n.startswith("torch.")]
    return found


def test_nothing_on_the_configs_floor_or_below_imports_torch():
    """The config, the registry and every strategy's spec.py (its settings and checks) are read by the launcher, the
    consoles' checks and `python -m engine.config` without torch: not even a late import."""
    low = {name: path for name, path in product_modules().items() if floor_of(name) <= CONFIG_FLOOR}
    assert {"engine.strategies.specs.registry", "engine.strategies.ddp.spec", "engine.config.check"} <= set(low)
    assert [f"{name} imports {', '.join(found)}" for name, path in low.items() if (found := torch_imports(path))] == []
    assert torch_imports(ENGINE / "strategies" / "ddp" / "strategy.py")   # the check is not vacuous


def test_reading_the_registry_loads_nothing_above_the_configs_floor():
    """Importing a strategy's spec.py runs its package's __init__ (and engine.strategies'), which sit above the
    config's floor: they load nothing when imported but their spec.py (a torch-heavy export loads when first asked
    for). So the config and every spec load in a fresh interpreter with no module above their floor but those
    packages, and no torch."""
    code = ("import sys, engine.config, engine.strategies.specs as s; engine.config.config_from_dict({}); "
            "[spec.settings for spec in s.STRATEGIES.values()]; print(' '.join(sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                            cwd=ENGINE.parent).stdout.split()
    assert "torch" not in loaded
    ours = [m for m in loaded if floor_of(m) is not None and (m.startswith("engine.") or m == "engine")]
    on_the_floor = [m for m in ours if floor_of(m) <= CONFIG_FLOOR]
    assert {"engine.strategies.specs.registry", "engine.strategies.pipeline.spec"} <= set(on_the_floor)
    ways_in = {".".join(m.split(".")[:i]) for m in on_the_floor for i in range(1, m.count(".") + 1)}
    assert [m for m in ours if floor_of(m) > CONFIG_FLOOR and m not in ways_in] == []
