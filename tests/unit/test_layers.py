"""The floors of docs/ARCHITECTURE.md, kept true: every import in trnd/ and kernels/ (at module level,
inside functions, under `if`/`try`, TYPE_CHECKING included) goes to its own room or a lower floor, and
the file graph has no circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Lowest floor first. A module imports its own room (the longest prefix below that names it) or a room
# on a lower floor; never one beside it or above it.
FLOORS = [
    ["trnd_kernels", "trnd", "trnd.aio", "trnd.log", "trnd.points", "trnd.parallel", "trnd.procs", "trnd.sampling_params",
     "trnd.snapshot", "trnd.tuning"],
    ["trnd.config"],
    ["trnd.backends", "trnd.daemon", "trnd.http", "trnd.transfer", "trnd.top", "trnd.events"],
    ["trnd.cache", "trnd.model", "trnd.store"],
    ["trnd.engine"],
    ["trnd.api", "trnd.router", "trnd.llm", "trnd.compile_cache"],
    ["trnd.roles", "trnd.bench", "trnd.check", "trnd.points_report"],
    ["trnd.cli"],
    ["trnd.__main__"],
]
FLOOR = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
# Rooms that may import only what is named here (beyond their own room), whatever their floor says.
ONLY = {
    "trnd.daemon": {"trnd.config", "trnd.log"},
    "trnd.http": set(),  # every port's plumbing: it knows no engine, router or config
    "trnd.top": {"trnd.snapshot"},
    "trnd.backends": {"trnd_kernels"},
}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted([*ROOT.glob("trnd/**/*.py"), *ROOT.glob("kernels/**/*.py")]):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts[0] == "kernels":  # the folder installs as trnd_kernels (setup.py's package_dir)
            parts[0] = "trnd_kernels"
        found[".".join(parts)] = path
    return found


MODULES = modules()


def _module_of(name: str) -> str | None:
    """The file an import name lands in (`trnd.engine.request.Req` -> trnd.engine.request)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(mod: str, path: Path) -> list[tuple[int, str]]:
    """(line, module file) for every trnd/kernels import anywhere in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            target = _module_of(name)
            if target is not None:
                out.append((node.lineno, target))
    return out


def room(mod: str) -> str:
    parts = mod.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in FLOOR and (n > 1 or parts[0] != "trnd" or len(parts) == 1):
            return ".".join(parts[:n])  # "trnd" alone is the package's __init__, not a room for the rest
    raise AssertionError(f"{mod}: in no room of FLOORS (add it to tests/unit/test_layers.py and docs/ARCHITECTURE.md)")


def breaks(src: str, dst: str) -> str | None:
    a, b = room(src), room(dst)
    if a == b:
        return None
    if a in ONLY and b not in ONLY[a]:
        return f"{a} imports only {', '.join(sorted(ONLY[a]))}"
    if FLOOR[b] >= FLOOR[a]:
        return f"{b} is on floor {FLOOR[b]}, {a} on floor {FLOOR[a]}"
    return None


def test_every_module_has_a_room():
    for mod in MODULES:
        room(mod)


def test_no_import_runs_across_or_up_the_floors():
    bad = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {t}: {why}"
           for m, p in MODULES.items() for line, t in imports(m, p) if (why := breaks(m, t))]
    assert not bad, "\n".join(bad)


def test_no_import_circle_between_files():
    graph = {m: sorted({t for _, t in imports(m, p) if t != m}) for m, p in MODULES.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in graph[m]:
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join([*stack[stack.index(t):], t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)


@pytest.mark.parametrize("src,dst,ok", [
    ("trnd.engine.engine", "trnd.api.server", False),  # up
    ("trnd.roles.decode", "trnd.bench.tiers", False),  # across
    ("trnd.daemon.lifecycle", "trnd.engine.loop", False),  # below, but the daemon imports only config and log
    ("trnd.top.model", "trnd.snapshot", True),
    ("trnd.engine.scheduler", "trnd.cache.radix", True),
    ("trnd.engine.scheduler", "trnd.engine.parked", True),
    ("trnd.roles.router", "trnd.router.app", True),
    ("trnd.router.app", "trnd.roles.common", False),
    ("trnd.router.app", "trnd.http.admin", True),
    ("trnd.router.app", "trnd.api.server", False),  # the two HTTP fronts share trnd/http, not each other
    ("trnd.http.admin", "trnd.engine.loop", False),
    ("trnd.http.admin", "trnd.config", False),
])
def test_the_rule_itself(src, dst, ok):
    assert (breaks(src, dst) is None) == ok


def test_the_walk_sees_imports_inside_functions(tmp_path):
    f = ROOT / "trnd" / "engine" / "scheduler.py"
    found = {t for _, t in imports("trnd.engine.scheduler", f)}
    assert "trnd.cache.radix" in found
    src = "def f():\n    if True:\n        from trnd.cli import main\n"
    p = tmp_path / "x.py"
    p.write_text(src)
    assert [t for _, t in imports("trnd.engine.x", p)] == ["trnd.cli"]


def test_a_new_top_level_module_needs_a_room():
    with pytest.raises(AssertionError, match="in no room"):
        room("trnd.somewhere_new")


def test_roles_reach_the_engine_only_through_its_contracts():
    """A role drives the engine through Engine's methods and the parked contract (engine/parked.py),
    never by editing the scheduler's queues, the engine's streams or stats, or the loop's private parts."""
    reach = ("engine.scheduler.", "engine.streams", "engine.stats", "loop._", "scheduler.waiting",
             "scheduler.running", "scheduler.parked")
    bad = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in sorted((ROOT / "trnd" / "roles").glob("*.py"))
           for i, line in enumerate(p.read_text().splitlines(), 1) if any(r in line for r in reach)]
    assert not bad, "\n".join(bad)


def test_every_module_imports():
    """A command module nobody imports at test time (a benchmark) still has to import: an import that
    points at a moved name fails here, not in front of an operator."""
    import importlib

    for path in sorted((ROOT / "trnd").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if name.endswith("__main__"):
            continue
        importlib.import_module(name)
