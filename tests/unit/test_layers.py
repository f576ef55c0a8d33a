"""Layer rules, read from the source with `ast` (no imports run): which module may import what.

Every import counts, also those inside functions (a lazy import is still a dependency), and
the rules on mpilb's own modules hold transitively: a pure part that imports a module that
imports MPI is not pure.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "mpilb"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def imports(name: str) -> set[str]:
    """Absolute names of everything module `name` imports (mpilb modules resolved)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            for alias in node.names:   # `from . import comm`: the module itself
                if f"{target}.{alias.name}" in MODULES:
                    found.add(f"{target}.{alias.name}")
    return found


def closure(name: str) -> set[str]:
    """Every mpilb module `name` reaches through imports, and every outside top-level name."""
    seen, todo, outside = set(), [name], set()
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        for imp in imports(mod):
            if imp in MODULES:
                todo.append(imp)
            elif imp.split(".")[0] != "mpilb":
                outside.add(imp.split(".")[0])
    return seen | outside


def test_the_graph_is_read():
    assert "mpilb.server.loop" in MODULES and "mpilb.mpi.wire" in MODULES
    assert "mpilb.mpi.comm" in imports("mpilb.server.receive")
    assert "mpilb.mpi.wire" in imports("mpilb.core.tasks")


def test_only_comm_imports_mpi4py():
    users = {m for m in MODULES if any(i.split(".")[0] == "mpi4py" for i in imports(m))}
    assert users == {"mpilb.mpi.comm"}


def test_only_backend_imports_cupy():
    users = {m for m in MODULES if any(i.split(".")[0] == "cupy" for i in imports(m))}
    assert users <= {"mpilb.backend"}


def test_wire_imports_numpy_only():
    third_party = {i.split(".")[0] for i in imports("mpilb.mpi.wire")} - {"__future__", "enum", "typing"}
    assert third_party == {"numpy"}


@pytest.mark.parametrize("pure", ["mpilb.core.tasks", "mpilb.server.modes", "mpilb.core.sitout",
                                  "mpilb.server.peers", "mpilb.mpi.wire", "mpilb.mpi.waiting",
                                  "mpilb.core.balancer", "mpilb.simulate", "mpilb.simulate.engine",
                                  "mpilb.simulate.netengine", "mpilb.simulate.network",
                                  "mpilb.simulate.cluster"])
def test_pure_parts_reach_no_mpi_log_or_loop(pure):
    reached = closure(pure)
    assert not reached & {"mpilb.mpi.comm", "mpi4py", "mpilb.runfiles.runlog", "h5py", "mpilb.worker.loop",
                          "mpilb.server.loop", "mpilb.server.chores", "mpilb.cli.launch"}, pure


def test_serial_and_server_never_import_each_other():
    server = {m for m in MODULES if m == "mpilb.server" or m.startswith("mpilb.server.")}
    assert not closure("mpilb.run.serial") & server
    for mod in server:
        assert "mpilb.run.serial" not in closure(mod), mod


def test_launch_does_not_import_the_cli():
    assert "mpilb.cli.main" not in closure("mpilb.cli.launch")


def test_the_worker_and_the_server_share_only_the_wire_and_below():
    assert not closure("mpilb.worker.loop") & {"mpilb.server", "mpilb.server.loop", "mpilb.run.serial"}
    assert "mpilb.mpi.wire" in imports("mpilb.worker.loop") and "mpilb.mpi.wire" in imports("mpilb.cli.bench")


def test_only_wire_indexes_headers():
    """Nothing else names the header slot enums (Push./Reply. subscripts)."""
    for mod, path in MODULES.items():
        if mod == "mpilb.mpi.wire":
            continue
        text = path.read_text()
        assert "[Push." not in text and "[Reply." not in text, mod


def package_of(name: str) -> str:
    """The layer a module belongs to: mpilb.core.tasks -> mpilb.core, mpilb.api -> mpilb.api."""
    return ".".join(name.split(".")[:2])


def in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_only_the_mpi_layer_imports_mpi4py():
    users = {m for m in MODULES if any(i.split(".")[0] == "mpi4py" for i in imports(m))}
    assert {package_of(m) for m in users} == {"mpilb.mpi"}, users


@pytest.mark.parametrize("mod", sorted(m for m in MODULES if in_package(m, "mpilb.core")))
def test_the_core_is_pure(mod):
    """The core (task ledger, update rules, batch sizing, rates, ...) runs in the server, the
    serial trainer and the simulator alike: no MPI, no HDF5, nothing of the loops above it."""
    reached = closure(mod)
    above = {m for m in reached if any(in_package(m, p) for p in (
        "mpilb.server", "mpilb.worker", "mpilb.run"))}
    assert not reached & {"mpi4py", "h5py", "mpilb.mpi.comm"} and not above, (
        mod, sorted(reached & {"mpi4py", "h5py", "mpilb.mpi.comm"} | above))


@pytest.mark.parametrize("mod", sorted(m for m in MODULES
                                       if in_package(m, "mpilb.data") or in_package(m, "mpilb.runfiles")))
def test_data_and_run_files_reach_no_mpi(mod):
    """Datasets and the run's files (log, checkpoint, report, export) are read and written
    without MPI: `mpilb prepare`, `report`, `export` never start it."""
    assert "mpi4py" not in closure(mod), mod


def import_circles(graph: dict | None = None) -> list[set[str]]:
    """The strongly connected groups of two or more modules in `graph` (module -> the mpilb
    modules it imports; by default mpilb's, where every import counts, also those inside
    functions), by Tarjan's algorithm, iterative."""
    if graph is None:
        graph = {m: sorted(i for i in imports(m) if i in MODULES) for m in MODULES}
    index, low, on_stack, stack, circles = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    circles.append(group)
    return circles


def test_the_circle_finder_finds_circles():
    graph = {"x": ["y"], "y": ["z"], "z": ["x", "w"], "w": [], "u": ["v"], "v": ["u", "w"]}
    assert sorted(map(sorted, import_circles(graph))) == [["u", "v"], ["x", "y", "z"]]
    assert import_circles({"x": ["y"], "y": []}) == []


def test_no_import_circles():
    """No two mpilb modules import each other, directly or around a circle: a layer reads
    from the layers below it only."""
    circles = import_circles()
    assert not circles, "import circles: " + "; ".join(" <-> ".join(sorted(c)) for c in circles)


def test_importing_the_simulator_does_not_start_mpi():
    """The static rules above read source; this checks what importing really loads (a
    package __init__ that imported the loop once pulled mpi4py into the simulator)."""
    import subprocess
    import sys

    code = ("import sys, mpilb.simulate, mpilb.core.tasks, mpilb.server.modes; "
            "print('mpi4py' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_simulator_reaches_the_core_but_not_the_server_or_mpi():
    """The simulator drives the server's decisions through mpilb.core (decisions, tasks,
    epochs, worker states), never through the server's package or MPI. (`python -m
    mpilb.simulate`, its __main__, is the command line's front, which reaches everything.)"""
    simulator = [m for m in MODULES if m == "mpilb.simulate"
                 or (m.startswith("mpilb.simulate.") and m != "mpilb.simulate.__main__")]
    for mod in simulator:
        reached = closure(mod)
        server = {m for m in reached if m == "mpilb.server" or m.startswith("mpilb.server.")}
        assert not server and not reached & {"mpilb.mpi.comm", "mpi4py"}, (mod, server)
    engine = closure("mpilb.simulate.engine")
    assert {"mpilb.core.decisions", "mpilb.core.tasks", "mpilb.core.epochs",
            "mpilb.core.worker_state"} <= engine


def test_files_and_classes_stay_a_size_a_reader_can_hold():
    """No module over 450 lines, no class over 300 (docs/architecture.md)."""
    long_files = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 450}
    assert not long_files, long_files
    long_classes = {}
    for m, p in MODULES.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                long_classes[f"{m}.{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long_classes, long_classes


def test_the_server_is_composed_not_mixed_in():
    """ParameterServer inherits from nothing and no server class from two of mpilb's classes
    (no mixins): each part is an object the server holds. (A strategy deriving from its one
    base, an update rule from UpdateRule, is not a mixin.)"""
    own = {node.name for p in MODULES.values() for node in ast.walk(ast.parse(p.read_text()))
           if isinstance(node, ast.ClassDef)}
    mixed = {}
    for m, p in MODULES.items():
        if not m.startswith("mpilb.server"):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)} & own
                if len(bases) > 1 or (node.name == "ParameterServer" and node.bases):
                    mixed[f"{m}.{node.name}"] = sorted(bases)
    assert not mixed, mixed
