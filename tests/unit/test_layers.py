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
                          "mpilb.server.loop", "mpilb.server.chores", "mpilb.run.launch"}, pure


def test_serial_and_server_never_import_each_other():
    server = {m for m in MODULES if m == "mpilb.server" or m.startswith("mpilb.server.")}
    assert not closure("mpilb.run.serial") & server
    for mod in server:
        assert "mpilb.run.serial" not in closure(mod), mod


def test_launch_does_not_import_the_cli():
    assert "mpilb.cli.main" not in closure("mpilb.run.launch")


def test_the_worker_and_the_server_share_only_the_wire_and_below():
    assert not closure("mpilb.worker.loop") & {"mpilb.server", "mpilb.server.loop", "mpilb.run.serial"}
    assert "mpilb.mpi.wire" in imports("mpilb.worker.loop") and "mpilb.mpi.wire" in imports("mpilb.run.bench")


def test_only_wire_indexes_headers():
    """Nothing else names the header slot enums (Push./Reply. subscripts)."""
    for mod, path in MODULES.items():
        if mod == "mpilb.mpi.wire":
            continue
        text = path.read_text()
        assert "[Push." not in text and "[Reply." not in text, mod


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
