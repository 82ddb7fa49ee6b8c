"""The dependency rule of the architecture (docs/architecture.md), checked on the source: `cluster/`
composes the roles; a role (learner, rollout workers, reward service) imports nothing of `cluster/`,
of the demos or benchmarks, and of no other role, except the shared kernel (`kernel/`: the registry
type, token and mask alignment) and the pure, stateless `learner.algorithms` and `learner.registry` (the names
of the algorithm parts), which any role may use. Every import counts, lazy ones inside functions too.
No file imports itself back through others, and `cluster/`'s parts stand in floors. Where a
registry's names may be spelled is tests/test_layout_names.py's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("learner", "rollout_workers", "reward_service", "agent_runners")
PROJECT = (*ROLES, "cluster", "kernel", "demos", "bench")
# pure modules any role may import: the shared kernel (`kernel/`, the registry type) and the learner's
# stateless math and part names
SHARED = ("kernel", "learner.algorithms", "learner.registry")


def project_imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import of a project package in `path` (relative ones resolved)."""
    package = path.parent.name
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # `from .x import y` inside a role stays in that role
                base = f"{package}.{base}" if base else package
            names = [base] if node.module or node.level else []
            # `from learner import algorithms` names the module in the alias
            names += [f"{base}.{alias.name}" for alias in node.names if base in PROJECT]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in PROJECT]
    return found


def allowed(role: str, module: str) -> bool:
    top = module.split(".")[0]
    if top == role or module in SHARED or any(module.startswith(f"{s}.") for s in SHARED):
        return True
    return module == "learner"  # `from learner import algorithms` names the module in the alias


def test_the_shared_kernel_imports_nothing_of_the_project():
    """`kernel/` is what every package may import, so it imports none of them (not even lazily)."""
    files = sorted((ROOT / "kernel").glob("*.py"))
    assert files
    bad = [
        f"{f.relative_to(ROOT)}:{line} imports {module}"
        for f in files
        for line, module in project_imports(f)
        if module.split(".")[0] != "kernel"
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("role", ROLES)
def test_a_role_imports_no_cluster_code_and_no_other_role_but_the_pure_modules(role):
    files = sorted((ROOT / role).glob("*.py"))
    assert files
    bad = [
        f"{f.relative_to(ROOT)}:{line} imports {module}"
        for f in files
        for line, module in project_imports(f)
        if not allowed(role, module)
    ]
    assert not bad, "\n".join(bad)


def test_the_checker_sees_lazy_relative_and_from_package_imports(tmp_path):
    role = tmp_path / "rollout_workers"
    role.mkdir()
    src = role / "x.py"
    src.write_text(
        "from kernel import sequences\n"
        "def f():\n"
        "    import cluster.records.calls\n"
        "    from learner.rank import LearnerRank\n"
        "    from . import engine\n"
    )
    found = project_imports(src)
    assert [m for _l, m in found if not allowed("rollout_workers", m)] == [
        "cluster.records.calls",
        "learner.rank",
    ]
    assert ("kernel.sequences" in [m for _l, m in found]) and allowed("rollout_workers", "kernel.sequences")


def test_cluster_reaches_the_demos_only_through_its_one_hook():
    """`cluster/` imports `demos` in `cluster/demo_assets.py` only (building a config's demo assets)."""
    hook = ROOT / "cluster" / "demo_assets.py"
    users = sorted(
        f"{f.relative_to(ROOT)}:{line}"
        for f in (ROOT / "cluster").rglob("*.py")
        for line, module in project_imports(f)
        if module.split(".")[0] in ("demos", "bench") and f != hook
    )
    assert not users, f"import demos through cluster/demo_assets.py: {users}"
    assert any(m.startswith("demos") for _l, m in project_imports(hook))


def module_graph(root: Path) -> dict[str, set[str]]:
    """Each project module under `root` -> the project modules it imports (lazy and type-checking
    imports too; a `from package import name` counts as the package's module where `name` is no module)."""
    files = {
        ".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): f
        for package in PROJECT
        for f in (root / package).rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, f in files.items():
        deps = set()
        for _line, module in project_imports(f):
            parts = module.split(".")
            while parts and ".".join(parts) not in files:
                parts.pop()
            if parts and ".".join(parts) != name:
                deps.add(".".join(parts))
        graph[name] = deps
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                cycles.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_module_imports_itself_back_through_others():
    """Every import counts (lazy ones inside functions and `if TYPE_CHECKING` ones too): a cycle is a
    responsibility in the wrong place (a factory in its base class's module, a registry that imports
    what registers into it, a part that reaches back into its owner)."""
    assert import_cycles(module_graph(ROOT)) == []


def test_the_cycle_checker_finds_a_lazy_cycle(tmp_path):
    pkg = tmp_path / "cluster"
    pkg.mkdir()
    (pkg / "a.py").write_text("from cluster import b\n")
    (pkg / "b.py").write_text("def f():\n    from cluster.c import x\n")
    (pkg / "c.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from cluster.a import y\n")
    (pkg / "d.py").write_text("import cluster.a\n")
    assert import_cycles(module_graph(tmp_path)) == [["cluster.a", "cluster.b", "cluster.c"]]


# `cluster/`'s floors, from the ground up: each part imports only parts on lower floors (never a sibling
# on its own floor); a part is a package of cluster/ or one of its top-level modules. Where a module
# belongs is in docs/architecture.md ("Floors inside cluster/").
CLUSTER_FLOORS: tuple[tuple[str, ...], ...] = (
    ("demo_assets",),  # the one hook to the demos (the config's allowed demo names)
    ("config",),  # schema, sections, the tables the config checks names against (sinks, filters)
    ("prompts",),  # prompt files, chat rendering, tokenized prompts, how a run prompted
    ("records",),  # chunks, calls, deadlines, groups, a rank's parts, Ray's failures
    ("roles",),  # role descriptors and actor classes
    ("placement", "weights", "reporting"),  # where actors go; how weights reach them; the run's reports
    ("pipeline",),  # the run loop and the two pipelines
    ("train",),  # the main entry point; the others reuse its arguments and preflight
    ("data", "evaluate", "submit", "scale", "export", "watch", "plot", "examples"),
    ("serve",),  # the Tinker-API service; it is submitted as a Ray job with submit's parts
)


def cluster_part(module: str) -> str | None:
    """The floor-part of a dotted module of `cluster` (its package or top-level module), None outside."""
    parts = module.split(".")
    return parts[1] if parts[0] == "cluster" and len(parts) > 1 else None


def floor_violations(root: Path, floors: tuple[tuple[str, ...], ...]) -> list[str]:
    """`file:line part -> part` for every import (lazy ones too) from a part of `root/cluster` to a part on
    its own floor or above; a part listed on no floor is itself a violation."""
    level = {part: i for i, floor in enumerate(floors) for part in floor}
    bad = []
    for f in sorted((root / "cluster").rglob("*.py")):
        rel = f.relative_to(root / "cluster").parts
        if rel == ("__init__.py",):
            continue
        here = rel[0].removesuffix(".py")
        if here not in level:
            bad.append(f"{f.relative_to(root)}: {here!r} stands on no floor")
            continue
        for line, module in project_imports(f):
            there = cluster_part(module)
            if there is None or there == here:
                continue
            if there not in level or level[there] >= level[here]:
                bad.append(f"{f.relative_to(root)}:{line} {here} -> {there}")
    return sorted(set(bad))


def test_cluster_stands_in_floors_each_importing_only_the_floors_below():
    """No package cycles inside `cluster/` (not only no file cycles): config < prompts < records < roles <
    placement | weights | reporting < pipeline < entry points. A record two parts exchange lives on the
    records floor; a table the config checks names against lives in config; a part that needs something
    of a higher floor is handed a small protocol (the async publisher's `StreamDispatch`)."""
    assert floor_violations(ROOT, CLUSTER_FLOORS) == []


def test_the_floor_checker_sees_lazy_upward_and_sideways_imports(tmp_path):
    pkg = tmp_path / "cluster"
    for part in ("config", "roles", "weights", "placement"):
        (pkg / part).mkdir(parents=True)
    (pkg / "config" / "a.py").write_text("def f():\n    from cluster.roles.r import x\n")
    (pkg / "roles" / "r.py").write_text("from cluster.config import a\n")
    (pkg / "weights" / "w.py").write_text("import cluster.placement.p\n")
    (pkg / "placement" / "p.py").write_text("from cluster.roles import r\n")
    (pkg / "stray.py").write_text("")
    floors = (("config",), ("roles",), ("placement", "weights"))
    assert floor_violations(tmp_path, floors) == [
        "cluster/config/a.py:2 config -> roles",
        "cluster/stray.py: 'stray' stands on no floor",
        "cluster/weights/w.py:1 weights -> placement",
    ]
