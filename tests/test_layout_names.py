"""One place for each name: `cluster/` never spells a name a registry owns (docs/architecture.md,
docs/extending.md). A role's name and a call kind are spelled only where the roles are described
(`cluster/roles/`), a reward kind is never compared by name (what cluster/ asks of it is a field of its
`REWARD_KINDS` entry), and an engine's name and a reward kind's section only in the judge's engines
module, so adding a role, a kind or an engine is its own module and its registry line. Each checker is
also run on a small tree it must flag. The import rules are tests/test_layout.py's."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
