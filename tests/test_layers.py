"""The import rules of the architecture (docs/pages/architecture.md), checked over the source.

An AST walk over every module of the project: imports at module level, inside functions and
under `if TYPE_CHECKING:` all count, because a deferred import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("peer", "protocol", "stages", "store", "tui")
NS = "tessera"

# peer/'s layers, lowest first: a layer imports only layers of a lower rank (and itself).
# Layers of one rank never import each other (serve/request, http/sim).
LAYER_RANK = {"base": 0, "plan": 1, "net": 2, "serve": 3, "request": 3, "weights": 3, "node": 4, "http": 5, "sim": 5, "cli": 6}
HEAVY_FOR_PLAN = ("torch", "trio", "libp2p", "numpy.random", "time", "socket", "sqlite3", "sqlite_utils")
# stages/'s subpackages, lowest first (stages/__init__.py): the same rule as peer/'s layers. The
# kernels are under both the layers and the weights; the weights (files) and the layers (modules)
# never import each other; assembly, which builds a Stage from a folder, is the one place both meet.
STAGES_RANK = {"errors": 0, "families": 1, "text": 1, "kernels": 2, "layers": 3, "weights": 3, "engine": 4,
               "assembly": 5, "shards": 6, "decoding": 6}
PURE_STAGES = ("families", "text")  # no torch: what a model is, and text
# pairs the ranks allow but the architecture does not: the runtime never reads weights (a Stage is
# given its Blocks: stages/assembly/ loads them)
STAGES_NEVER = {("engine", "weights")}


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """`tessera.peer.plan.routing` -> its file, for every module of the project."""
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([NS, *parts])] = path
    return mods


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """Every module `module` imports (eager, deferred and TYPE_CHECKING alike): project modules by
    their full name, third-party ones by their dotted name as written."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in known else base)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = project_modules(root)
    known = set(mods)
    return {m: imports_of(m, p, known) for m, p in mods.items()}


def layer_of(module: str) -> str | None:
    """`tessera.peer.request.client` -> "request"; None outside peer/ (or for peer/__init__)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "peer" else None


def stages_part(module: str) -> str | None:
    """`tessera.stages.layers.moe` -> "layers"; `tessera.stages.errors` -> "errors"; None outside stages/."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == [NS, "stages"] else None


def top_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if parts[0] == NS and len(parts) > 1 else parts[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(t for t in graph[start] if t in graph)))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(t for t in graph[child] if t in graph))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every broken rule, one line each (empty when the architecture holds)."""
    bad: list[str] = []
    for module, targets in sorted(graph.items()):
        top, layer = top_of(module), layer_of(module)
        if top == "peer" and module != f"{NS}.peer" and layer not in LAYER_RANK:
            bad.append(f"{module}: not in any layer of peer/ ({sorted(LAYER_RANK)})")
        if top == "stages" and module != f"{NS}.stages" and stages_part(module) not in STAGES_RANK:
            bad.append(f"{module}: not in any subpackage of stages/ ({sorted(STAGES_RANK)})")
        for target in sorted(targets):
            target_top, target_layer = top_of(target), layer_of(target)
            is_ours = target.startswith(f"{NS}.")
            if not is_ours and target.split(".")[0] in PACKAGES:
                bad.append(f"{module} imports {target}: import project modules as tessera.{target}")
            if is_ours and target_top == "tui" and top != "tui" and layer != "cli":
                bad.append(f"{module} imports {target}: only peer/cli/ may import tui/")
            if top == "tui" and target_layer == "cli":
                bad.append(f"{module} imports {target}: tui/ is below the CLI")
            if top in ("protocol", "stages", "store") and target_top in ("peer", "tui") and is_ours:
                bad.append(f"{module} imports {target}: {top}/ never imports peer/ or tui/")
            if target.split(".")[0] == "libp2p" and layer != "net" and module != f"{NS}.peer.base.ids":
                bad.append(f"{module} imports {target}: libp2p only in peer/net/ (and peer/base/ids.py)")
            if layer == "plan" and any(target == h or target.startswith(h + ".") for h in HEAVY_FOR_PLAN):
                bad.append(f"{module} imports {target}: peer/plan/ is pure (no torch, trio, time or I/O)")
            if top == "peer" and target_top == "peer" and layer in LAYER_RANK and target_layer in LAYER_RANK:
                if target_layer != layer and LAYER_RANK[target_layer] >= LAYER_RANK[layer]:
                    bad.append(f"{module} imports {target}: layer {layer} may not import layer {target_layer}")
            part, target_part = stages_part(module), stages_part(target)
            if part in STAGES_RANK and target_part in STAGES_RANK and target_part != part:
                if STAGES_RANK[target_part] >= STAGES_RANK[part] or (part, target_part) in STAGES_NEVER:
                    bad.append(f"{module} imports {target}: stages/{part} may not import stages/{target_part}")
            if part in PURE_STAGES and target.split(".")[0] == "torch":
                bad.append(f"{module} imports {target}: stages/{part}/ is pure (no torch)")
    for component in cycles(graph):
        bad.append(f"import cycle: {' -> '.join(component)}")
    return bad


def test_import_rules_hold() -> None:
    assert violations(import_graph()) == []


def test_the_rules_catch_what_they_forbid() -> None:
    """Each rule fires on a graph that breaks it (so the test above can fail)."""
    graph = import_graph()
    bad = {m: set(t) for m, t in graph.items()}
    bad["tessera.peer.plan.routing"] |= {"torch", "tessera.peer.request.client"}
    bad["tessera.peer.serve.server"].add("tessera.peer.request.chain")
    bad["tessera.peer.node.peer_node"] |= {"tessera.tui.app", "libp2p.peer.id"}
    bad["tessera.protocol.codec"].add("tessera.peer.base.errors")
    bad["tessera.peer.request.client"].add(".".join(("peer", "request", "client")))  # not tessera.-qualified
    bad["tessera.stages.layers.moe"].add("tessera.stages.engine.stage")
    bad["tessera.stages.families.spec"].add("torch")
    bad["tessera.stages.engine.stage"].add("tessera.stages.weights.folder")
    bad["tessera.stages.weights.folder"].add("tessera.stages.layers.block")
    bad["tessera.stages.kernels.quant"].add("tessera.stages.layers.block")
    found = "\n".join(violations(bad))
    assert "plan.routing imports torch" in found
    assert "layer plan may not import layer request" in found
    assert "layer serve may not import layer request" in found
    assert "only peer/cli/ may import tui/" in found
    assert "libp2p only in peer/net/" in found
    assert "protocol/ never imports peer/" in found
    assert "import project modules as tessera." in found
    assert "import cycle:" in found  # plan.routing -> request.client -> ... -> plan.routing
    assert "stages/layers may not import stages/engine" in found
    assert "stages/families/ is pure (no torch)" in found
    assert "stages/engine may not import stages/weights" in found  # below it by rank, and still not
    assert "stages/weights may not import stages/layers" in found  # the same rank: neither imports the other
    assert "stages/kernels may not import stages/layers" in found


def test_deferred_and_type_checking_imports_count(tmp_path: Path) -> None:
    (tmp_path / "peer" / "plan").mkdir(parents=True)
    (tmp_path / "peer" / "net").mkdir(parents=True)
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "peer" / "plan" / "__init__.py").write_text("")
    (tmp_path / "peer" / "net" / "__init__.py").write_text("")
    (tmp_path / "peer" / "plan" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tessera.peer.net.b import B\n")
    (tmp_path / "peer" / "net" / "b.py").write_text("def f():\n    from ..plan import a\n")
    graph = import_graph(tmp_path)
    assert "tessera.peer.net.b" in graph["tessera.peer.plan.a"]
    assert "tessera.peer.plan.a" in graph["tessera.peer.net.b"]
    found = violations(graph)
    assert any("layer plan may not import layer net" in line for line in found)
    assert any(line.startswith("import cycle:") for line in found)


def test_importing_the_planner_loads_no_torch_or_trio() -> None:
    import subprocess
    import sys

    code = ("import sys, tessera.peer.plan.routing, tessera.peer.plan.placement, tessera.peer.plan.audit; "
            "print(sorted(m for m in ('torch', 'trio', 'libp2p') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


def test_the_install_has_one_top_level_package(tmp_path: Path) -> None:
    """`pip install` puts `tessera` on the path, not `protocol`, `peer`, ... (run away from the
    checkout and without PYTHONPATH, so that only the installation can answer)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import importlib.util as u; "
            "print([n for n in ('peer', 'protocol', 'stages', 'store', 'tui') if u.find_spec(n)], "
            "[n for n in ('tessera.peer', 'tessera.protocol', 'tessera.stages', 'tessera.store', 'tessera.tui') "
            "if u.find_spec(n)])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                          cwd=tmp_path, env=env)
    assert done.stdout.strip() == ("[] ['tessera.peer', 'tessera.protocol', 'tessera.stages', 'tessera.store', "
                                   "'tessera.tui']")
