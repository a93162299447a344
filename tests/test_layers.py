"""The package layout is the architecture: imports point one way, no cycles.

Every import counts, also the ones inside functions (they are how a layer
avoids a heavy dependency at import time, not a licence to point back up).
The map is in docs/runtime.md.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rldsl"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imported_names(path: Path, known: dict[str, Path]) -> set[str]:
    """Every module ``path`` imports: rldsl modules by full name, others by top-level name."""
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known)
    return {name if name.startswith("rldsl") else name.split(".")[0] for name in found}


def import_graph() -> nx.DiGraph:
    known = modules()
    graph = nx.DiGraph()
    for name, path in known.items():
        graph.add_node(name)
        for target in imported_names(path, known):
            if target in known and target != name:
                graph.add_edge(name, target)
            elif not target.startswith("rldsl"):
                graph.add_edge(name, f"external:{target}")
    return graph


GRAPH = import_graph()


def imports_of(prefix: str) -> dict[str, set[str]]:
    """Module under ``prefix`` -> what it imports."""
    return {m: set(GRAPH.successors(m)) for m in GRAPH if m == prefix or m.startswith(prefix + ".")}


def offenders(prefix: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{module} imports {target}" for module, targets in imports_of(prefix).items()
                  for target in targets if any(target == f or target.startswith(f + ".") for f in forbidden))


def test_no_import_cycles():
    cycles = list(nx.simple_cycles(GRAPH.subgraph([n for n in GRAPH if n.startswith("rldsl")])))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + c[:1]) for c in cycles[:5])


@pytest.mark.parametrize(("layer", "forbidden"), [
    # the ExecutionPlan is the one boundary between compiler and runtime
    ("rldsl.compiler", ("rldsl.runtime", "external:torch", "external:ray")),
    ("rldsl.runtime", ("rldsl.compiler", "rldsl.cli")),
    # the control plane knows neither Ray nor an engine nor a lowering
    ("rldsl.runtime.control", ("external:ray", "external:transfer_queue", "rldsl.runtime.engines",
                               "rldsl.runtime.ray_lowering", "rldsl.runtime.inprocess",
                               "rldsl.runtime.dataplane.transferqueue", "rldsl.runtime.dataplane.memory")),
    ("rldsl.runtime.dataplane", ("rldsl.runtime.control", "rldsl.runtime.engines", "rldsl.runtime.ray_lowering",
                                 "rldsl.runtime.inprocess")),
    # engines never import the controller or a lowering
    ("rldsl.runtime.engines", ("rldsl.runtime.control", "rldsl.runtime.ray_lowering", "rldsl.runtime.inprocess",
                               "rldsl.runtime.dataplane")),
    ("rldsl.runtime.inprocess", ("external:ray", "rldsl.runtime.ray_lowering")),
    # the weight transport knows torch only: the lowering forms its groups and wires it to engines
    ("rldsl.runtime.transport", ("external:ray", "rldsl.runtime.control", "rldsl.runtime.engines",
                                 "rldsl.runtime.ray_lowering", "rldsl.runtime.dataplane", "rldsl.runtime.inprocess")),
    ("rldsl.runtime.protocols", ("rldsl.runtime.control", "rldsl.runtime.engines", "rldsl.runtime.ray_lowering",
                                 "rldsl.runtime.dataplane", "rldsl.runtime.inprocess")),
    # models and tasks never import engines
    ("rldsl.models", ("rldsl.runtime.engines", "rldsl.runtime.control", "rldsl.runtime.ray_lowering")),
    ("rldsl.tasks", ("rldsl.runtime.engines", "rldsl.runtime.control", "rldsl.runtime.ray_lowering")),
    # the exporter reads a finished run's files offline: no Ray, no controller, no data plane
    ("rldsl.runtime.export", ("external:ray", "rldsl.runtime.control", "rldsl.runtime.dataplane",
                              "rldsl.runtime.inprocess")),
    ("rldsl.plan", ("rldsl.compiler", "rldsl.runtime")),
    ("rldsl.collective_rule", ("rldsl.compiler", "rldsl.runtime")),
    # what the launcher refuses from a plan: `check` and the launcher ask it, so it knows neither
    ("rldsl.launch_rules", ("rldsl.compiler", "rldsl.runtime", "external:torch", "external:ray")),
    # the bundle layout is the plan's: `check` and the launcher share it, so it knows neither of them
    ("rldsl.layout", ("rldsl.compiler", "rldsl.runtime", "external:ray")),
    # the CLI uses the compiler and the Ray lowering, nothing below it
    ("rldsl.cli", ("rldsl.runtime.control", "rldsl.runtime.engines", "rldsl.runtime.dataplane",
                   "rldsl.runtime.inprocess")),
])
def test_dependencies_point_one_way(layer, forbidden):
    assert not offenders(layer, forbidden)


def test_the_graph_sees_lazy_imports():
    """A guard for the guard: imports inside functions are edges too."""
    assert "rldsl.runtime.ray_lowering.driver" in GRAPH.successors("rldsl.runtime.ray_lowering.launch")
    assert "external:ray" in GRAPH.successors("rldsl.runtime.ray_lowering.cluster")


@pytest.mark.parametrize("order", ["sorted", "reversed"])
def test_every_runtime_module_imports(order):
    """All runtime modules import in a fresh interpreter, in two orders: an
    import-time cycle shows in one of them even where the static graph is clean."""
    names = sorted(m for m in GRAPH if m.startswith("rldsl.runtime"))
    if order == "reversed":
        names.reverse()
    names = [n for n in names if "megatron" not in n or _has("megatron.core")]
    names = [n for n in names if not n.endswith(".vllm_receiver") or _has("vllm")]  # runs in vLLM's workers
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)"
    subprocess.run([sys.executable, "-c", code, *names], check=True, cwd=ROOT)


def _has(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False
