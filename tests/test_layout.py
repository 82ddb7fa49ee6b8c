"""The dependency rule of the architecture (docs/architecture.md), checked on the source: `cluster/`
composes the roles; a role (learner, rollout workers, reward service) imports nothing of `cluster/`,
of the demos or benchmarks, and of no other role, except the shared kernel (`kernel/`: the registry
type, token and mask alignment) and the pure, stateless `learner.algorithms` and `learner.registry` (the names
of the algorithm parts), which any role may use. Every import counts, lazy ones inside functions too."""

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
    ("data", "evaluate", "submit", "scale", "export", "watch", "plot", "examples", "serve"),
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


def role_descriptions(root: Path) -> set[Path]:
    """The modules of `root/cluster` that describe a role (a `Role(...)` call: the registry's module and any
    role's own module), and `cluster/roles/role.py`, where `CallKind` spells the call kinds."""
    found = {root / "cluster" / "roles" / "role.py"}
    for f in sorted((root / "cluster").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Role":
                found.add(f)
    return found


def role_name_literals(root: Path, names: set[str], descriptions: set[Path]) -> list[str]:
    """`file:line 'name'` for every string constant equal to a role's name in a module under
    `root/cluster` other than the `descriptions` (the places a role is described)."""
    found = []
    for f in sorted((root / "cluster").rglob("*.py")):
        if f in descriptions:
            continue
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                found.append(f"{f.relative_to(root)}:{node.lineno} {node.value!r}")
    return found


def test_no_module_of_cluster_but_the_roles_descriptions_names_a_role():
    """Placement, control, scaling, the collector, the stream loop, telemetry and the run folder loop
    over `cluster.roles.registry.ROLES`: a role's name is spelled in its descriptor only (in the
    registry's module, or in the role's own module listed there by `"module:Role"`), so adding a role
    is a descriptor, its actor class and its config section."""
    from cluster.roles.registry import ROLES

    names = {r.name for r in ROLES}
    assert names >= {
        "learner",
        "rollout",
        "reference",
        "reward",
        "judge",
    }  # a role added later: no change here
    assert ROOT / "cluster" / "roles" / "registry.py" in role_descriptions(ROOT)
    assert role_name_literals(ROOT, names, role_descriptions(ROOT)) == []


def test_the_role_name_check_sees_a_name_in_any_module(tmp_path):
    (tmp_path / "cluster" / "pipeline").mkdir(parents=True)
    (tmp_path / "cluster" / "pipeline" / "x.py").write_text('KINDS = {"rollout": 1}\nlabel = "rollouts"\n')
    registry = tmp_path / "cluster" / "registry.py"
    registry.write_text('NAME = "rollout"\n')
    own = tmp_path / "cluster" / "own_role.py"
    own.write_text('OWN = Role(name="rollout")\n')
    assert role_descriptions(tmp_path) == {own, tmp_path / "cluster" / "roles" / "role.py"}
    found = role_name_literals(tmp_path, {"rollout"}, {registry, own})
    assert found == ["cluster/pipeline/x.py:1 'rollout'"]


KIND_TAKERS = {
    "add",
    "submit",
    "pending",
    "live",
    "prepare",
    "track",
}  # methods whose arguments include a call kind


def _names_kind(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "kind") or (
        isinstance(node, ast.Attribute) and node.attr == "kind"
    )


def _strings(node: ast.AST) -> list[ast.Constant]:
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [n for n in items if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def call_kind_literals(root: Path, kinds: set[str], descriptions: set[Path]) -> list[str]:
    """`file:line 'kind'` for every call kind spelled as a string where a kind is meant, in a module of
    `root/cluster` other than the `descriptions` (where `CallKind` and the roles spell them): compared
    with a `kind` (`call.kind == "generate"`, `kind in ("start", ...)`), handed to a method that takes
    one (`tracker.add(name, ref, "train", ...)`) or as a `kind=` argument, a key (`pools["generate"]`,
    `{"generate": 0.0}`), assigned to a `kind` (`kind = "judge"`, `call.kind = "judge"`) or a `kind`
    parameter's default."""
    found = []
    for f in sorted((root / "cluster").rglob("*.py")):
        if f in descriptions:
            continue
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            spelled: list[ast.Constant] = []
            if isinstance(node, ast.Compare) and any(map(_names_kind, [node.left, *node.comparators])):
                for side in [node.left, *node.comparators]:
                    spelled += _strings(side)
            elif isinstance(node, ast.Call):
                if isinstance(node.func, ast.Attribute) and node.func.attr in KIND_TAKERS:
                    for arg in [*node.args, *(k.value for k in node.keywords)]:
                        spelled += _strings(arg)
                spelled += [s for k in node.keywords if k.arg == "kind" for s in _strings(k.value)]
            elif isinstance(node, ast.Subscript):
                spelled += _strings(node.slice)
            elif isinstance(node, ast.Dict):
                spelled += [s for key in node.keys if key is not None for s in _strings(key)]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(map(_names_kind, targets)):
                    spelled += _strings(node.value)
            elif isinstance(node, ast.arguments):
                positional = [*node.posonlyargs, *node.args]
                pairs = list(
                    zip(positional[len(positional) - len(node.defaults) :], node.defaults, strict=True)
                )
                pairs += [
                    (a, d) for a, d in zip(node.kwonlyargs, node.kw_defaults, strict=True) if d is not None
                ]
                spelled += [s for a, d in pairs if a.arg == "kind" for s in _strings(d)]
            found += [f"{f.relative_to(root)}:{c.lineno} {c.value!r}" for c in spelled if c.value in kinds]
    return sorted(set(found))


def test_no_module_of_cluster_but_the_roles_descriptions_spells_a_call_kind():
    """A call's kind is `cluster.roles.role.CallKind` (or the kind a role in a module of its own names
    there): the collector, the stream loop, the learner's step and the publishers compare and hand out
    its members, never the raw text, and the trackers refuse a kind none of them declares, so a kind
    cannot be misspelled into a call nobody waits for."""
    from cluster.roles.registry import CallKind, call_kinds

    kinds = {str(k) for k in call_kinds()}
    assert kinds >= {k.value for k in CallKind}
    assert call_kind_literals(ROOT, kinds, role_descriptions(ROOT)) == []


def test_the_call_kind_check_sees_comparisons_arguments_keys_assignments_and_defaults(tmp_path):
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "x.py").write_text(
        'if call.kind in ("start", "other"):\n    pass\n'
        'tracker.add(name, ref, "train", 1.0)\n'
        'busy["generate"] += 1\n'
        'label = "train"\n'
        'busy = {"judge": 0.0, "score": 0.0}\n'
        'Call(ref, name, kind="export")\n'
        'call.kind = "prepare"\n'
        'def f(a, kind="reward", *, other="reward"):\n    pass\n'
    )
    kinds = {"start", "train", "generate", "judge", "export", "prepare", "reward"}
    found = call_kind_literals(tmp_path, kinds, {tmp_path / "cluster" / "r.py"})
    assert found == [
        "cluster/x.py:1 'start'",
        "cluster/x.py:3 'train'",
        "cluster/x.py:4 'generate'",
        "cluster/x.py:6 'judge'",
        "cluster/x.py:7 'export'",
        "cluster/x.py:8 'prepare'",
        "cluster/x.py:9 'reward'",
    ]


def reward_kind_literals(
    root: Path, kinds: set[str], mention: str = "kind", skip: tuple[str, ...] = ()
) -> list[str]:
    """`file:line 'kind'` for every string constant equal to a reward kind's name on one side of a
    comparison whose other side's source mentions `kind` (`cfg.reward.kind == "rule"`,
    `kind in ("rule", "environment")`), in any module of `root/cluster` but those in `skip` (paths
    relative to `root`). With another `mention` and names, the same for another registry's names."""
    found = []
    for f in sorted((root / "cluster").rglob("*.py")):
        if str(f.relative_to(root)) in skip:
            continue
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            for k, side in enumerate(sides):
                if not any(mention in ast.unparse(other) for j, other in enumerate(sides) if j != k):
                    continue
                found += [
                    f"{f.relative_to(root)}:{c.lineno} {c.value!r}"
                    for c in ast.walk(side)
                    if isinstance(c, ast.Constant) and c.value in kinds
                ]
    return sorted(set(found))


def test_no_module_of_cluster_compares_a_reward_kind_by_name():
    """What cluster/ asks of a reward kind (which role scores, what its scores mean, which held-out
    metrics exist, what it needs) is a field of its entry in `reward_service.backends.REWARD_KINDS`,
    never a comparison with the kind's name, so a new kind is its backend and its entry. Messages may
    name a kind (reward.kind='judge'): they compare nothing."""
    from reward_service.backends import REWARD_KINDS

    kinds = set(REWARD_KINDS.names())
    assert kinds >= {"model", "rule", "remote", "judge", "environment"}
    assert reward_kind_literals(ROOT, kinds) == []


def test_the_reward_kind_check_sees_comparisons_with_any_kind(tmp_path):
    (tmp_path / "cluster" / "roles").mkdir(parents=True)
    (tmp_path / "cluster" / "roles" / "x.py").write_text(
        'runs = lambda c: c.reward.kind != "judge"\n'
        'if cfg.reward.kind in ("rule", "environment"):\n'
        "    pass\n"
        'if "model" == kind:\n'
        "    pass\n"
        'label = "judge"\n'
        'if role.name == "judge":\n'
        "    pass\n"
        "msg = f\"reward.kind='judge' needs {x}\"\n"
    )
    found = reward_kind_literals(tmp_path, {"judge", "rule", "environment", "model"})
    assert found == [
        "cluster/roles/x.py:1 'judge'",
        "cluster/roles/x.py:2 'environment'",
        "cluster/roles/x.py:2 'rule'",
        "cluster/roles/x.py:4 'model'",
    ]


def test_no_module_of_cluster_but_the_judges_engines_compares_an_engine_by_name():
    """What placement and the config ask of an engine (the GPUs it spans, its sequence limit) is a field
    of its entry in `rollout_workers.engines.ENGINES`; `cluster/roles/judge_engines.py`, which builds
    the judge's model on an engine, is the one module that names them."""
    from rollout_workers.engines import ENGINES

    names = set(ENGINES.names())
    assert names >= {"hf", "vllm"}
    skip = ("cluster/roles/judge_engines.py",)
    assert reward_kind_literals(ROOT, names, mention="engine", skip=skip) == []


def test_the_engine_check_sees_a_comparison_with_an_engine(tmp_path):
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "x.py").write_text(
        'if r.engine != "vllm" or cfg.rollout.engine in ("hf",):\n    pass\n'
    )
    found = reward_kind_literals(tmp_path, {"hf", "vllm"}, mention="engine")
    assert found == ["cluster/x.py:1 'hf'", "cluster/x.py:1 'vllm'"]


def kind_section_reads(root: Path, sections: set[str], skip: tuple[str, ...] = ()) -> list[str]:
    """`file:line reward.<section>` for every read of a reward kind's section as an attribute of a
    `reward` (`cfg.reward.judge.num_replicas`, `reward.judge.engine`) in a module of `root/cluster` but
    those in `skip` (paths relative to `root`)."""
    found = []
    for f in sorted((root / "cluster").rglob("*.py")):
        if str(f.relative_to(root)) in skip:
            continue
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if not (isinstance(node, ast.Attribute) and node.attr in sections):
                continue
            parent = node.value
            if (isinstance(parent, ast.Attribute) and parent.attr == "reward") or (
                isinstance(parent, ast.Name) and parent.id == "reward"
            ):
                found.append(f"{f.relative_to(root)}:{node.lineno} reward.{node.attr}")
    return sorted(set(found))


def test_no_module_of_cluster_but_the_judges_engines_reads_a_reward_kinds_section():
    """A reward kind's section (`reward.<kind>`) is declared by its entry (`RewardKind.section`) and read
    by the role that scores the kind, which `cluster.roles.registry.reward_role` builds from the entry
    (by the kind's name, never spelled), so a kind scored by a role of its own is its module and its
    line in `REWARD_KINDS`. `cluster/roles/judge_engines.py`, which builds the judge's model on its
    engine, is the one module that reads one (the judge's)."""
    from reward_service.backends import REWARD_KINDS

    sections = {k.name for k in REWARD_KINDS if k.section is not None}
    assert "judge" in sections
    skip = ("cluster/roles/judge_engines.py",)
    assert kind_section_reads(ROOT, sections, skip=skip) == []


def test_the_section_check_sees_a_section_read_through_any_reward(tmp_path):
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "x.py").write_text(
        "n = c.reward.judge.num_replicas\nm = reward.judge.engine\nk = c.judge.x\nr = c.reward.url\n"
    )
    found = kind_section_reads(tmp_path, {"judge"})
    assert found == ["cluster/x.py:1 reward.judge", "cluster/x.py:2 reward.judge"]
