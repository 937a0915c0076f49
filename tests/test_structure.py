"""The module graph: rlhf_core, components and pipelines have no import cycle (module-level
or inside functions, within and across the three); rlhf_core's parts stand on floors and
import only from the floors below them (``FLOORS``); rlhf_core imports nothing from the
Kubeflow / KubeRay side (``components``, ``pipelines``, kfp, kubernetes), and no production
module imports the test helpers (``rlhf_core.testing``); the `rlhf` commands of the
Kubeflow side still reach users through plugins."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ROOT / "rlhf_core"
PACKAGES = (LIBRARY, ROOT / "components", ROOT / "pipelines")
TEST_HELPERS = "rlhf_core.testing"
FORBIDDEN = ("components", "pipelines", "kfp", "kubernetes")

#: rlhf_core's parts (its subpackages and root modules), bottom up. A module may import its
#: own part and any part on a lower floor, never one on its floor or above: the record knows
#: no worker, the data knows no model, the workers know no trainer, the trainer no session.
FLOORS = (
    ("runtime", "protocol", "verl_keys"),       # this machine's processes; the data contract
    ("snapshot", "algorithms", "controller", "distributed"),
    ("rollout",),                                # generation as a service: engines (the config asks their
                                                 # rules), replicas and the manager balancing them
    ("config",),
    ("verl_examples",),                          # what `rlhf config` says of verl's own scripts
    ("checkpoint",),                             # a checkpoint folder's files
    ("record",),                                 # the run's record in the store
    ("data",),                                   # prompts, tasks, inputs fetched from a store
    ("models",),                                 # models built on this machine
    ("workers",),
    ("agent",),                                  # agent loops, tools and their sandbox
    ("trainer",),                                # the algorithm's control flow
    ("session",),                                # the long-lived session and computing ahead
    ("cli_args", "export"),                      # what the commands share and call
    ("demo",),                                   # the demos (the RLHF demo's rounds export policies)
    ("cli",),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, wherever the import statement stands."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return found


def library_graph(packages=PACKAGES) -> dict[str, set[str]]:
    modules = {module_name(p): p for package in packages for p in package.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in imports_of(path):
            # `import a.b.c` depends on a.b.c (and loads its packages, which import nothing
            # that matters here: package __init__ files are re-exports)
            if imported in modules and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle_in_rlhf_core_components_or_pipelines():
    graph = library_graph()
    assert {"rlhf_core.session.session", "components.driver", "pipelines.local"} <= set(graph)
    # a module that imports its own package (`from rlhf_core.protocol import wire` inside
    # rlhf_core.protocol) closes a cycle through the package's __init__: import the
    # submodule itself (`import rlhf_core.protocol.wire as wire`)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def part_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "rlhf_core" and len(parts) > 1 else None


def upward_imports(graph: dict[str, set[str]], floors=FLOORS) -> list[str]:
    """``importer -> imported`` for every import of a part on the importer's floor or above."""
    floor = {part: level for level, parts in enumerate(floors) for part in parts}
    found = []
    for name, targets in sorted(graph.items()):
        here = part_of(name)
        if here is None or here == "testing":
            continue
        for target in sorted(targets):
            there = part_of(target)
            if there is None or there == here:
                continue
            if there == "testing" or floor[there] >= floor[here]:
                found.append(f"{name} -> {target}")
    return found


def test_every_part_of_rlhf_core_has_a_floor():
    parts = {p.stem if p.is_file() else p.name for p in LIBRARY.iterdir()
             if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists())}
    placed = {part for level in FLOORS for part in level}
    assert parts - {"testing"} == placed, (sorted(parts - placed - {"testing"}), sorted(placed - parts))


def test_rlhf_core_imports_only_downwards():
    assert upward_imports(library_graph((LIBRARY,))) == []


def test_the_floor_check_sees_an_upward_import():
    graph = {"rlhf_core.data.builtin": {"rlhf_core.models.qwen2"},          # data -> models: up
             "rlhf_core.data.dataset": {"rlhf_core.workers.modeling"},      # data -> workers: up
             "rlhf_core.record.lease": {"rlhf_core.record.run_layout"},     # within a part: fine
             "rlhf_core.workers.actor": {"rlhf_core.data.dataset"},         # down: fine
             "rlhf_core.trainer.ppo": {"rlhf_core.session.session"},        # up
             "rlhf_core.snapshot.fs": {"rlhf_core.algorithms.core"}}        # the same floor: not allowed
    assert upward_imports(graph) == ["rlhf_core.data.builtin -> rlhf_core.models.qwen2",
                                     "rlhf_core.data.dataset -> rlhf_core.workers.modeling",
                                     "rlhf_core.snapshot.fs -> rlhf_core.algorithms.core",
                                     "rlhf_core.trainer.ppo -> rlhf_core.session.session"]


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_rlhf_core_imports_nothing_of_kubeflow_or_kuberay():
    offenders = []
    for path in LIBRARY.rglob("*.py"):
        for imported in imports_of(path):
            if imported.split(".")[0] in FORBIDDEN:
                offenders.append(f"{path.relative_to(ROOT)}: {imported}")
        if "sys.path" in path.read_text():
            offenders.append(f"{path.relative_to(ROOT)}: edits sys.path")
    assert not offenders, offenders


def test_no_production_module_imports_the_test_helpers():
    offenders = [f"{path.relative_to(ROOT)}: {imported}"
                 for package in PACKAGES for path in package.rglob("*.py")
                 if not module_name(path).startswith(TEST_HELPERS)
                 for imported in imports_of(path) if imported == TEST_HELPERS or imported.startswith(TEST_HELPERS + ".")]
    assert not offenders, offenders


def test_tests_do_not_edit_sys_path():
    """The package is installed (editable); tests import it, and their helpers, as is."""
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("*.py")
                 if p.name != "test_structure.py" and "sys.path." in p.read_text()]
    assert not offenders, offenders


def test_kubeflow_commands_arrive_as_plugins_and_the_library_loads_without_them():
    """`rlhf submit/schedule/compile/manifests` come from the entry points; importing the
    CLI and the trainer loads no kfp/kubernetes/components/pipelines module."""
    from rlhf_core.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    assert {"submit", "schedule", "compile", "manifests", "run", "replay"} <= set(commands)
    probe = ("import sys, rlhf_core.cli, rlhf_core.trainer.run, rlhf_core.session.session, rlhf_core.trainer.replay; "
             "bad = sorted(m for m in sys.modules if m.split('.')[0] in %r); print(bad)" % (FORBIDDEN,))
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout
