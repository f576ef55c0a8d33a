"""Process-wide state has one owner that sets it through a named function: the spin window of
every wait (mpi/waiting.py, set by cores.start_waits through Backoff.poll_first) and the
objects handed to mpilb.train (models/user.py, registered by model_spec)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mpilb.mpi.waiting import Backoff
from mpilb.models import user

ROOT = Path(__file__).resolve().parents[2] / "mpilb"


def _assigned_attributes(path: Path) -> set[str]:
    """`X.attr` targets of assignments in a module, as "X.attr"."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                found.add(f"{t.value.id}.{t.attr}")
    return found


def test_no_module_sets_the_spin_window_but_its_owner():
    setters = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
               if any(a.endswith(".spin_s") for a in _assigned_attributes(p))}
    assert setters <= {"mpi/waiting.py"}


def test_no_module_reaches_into_the_model_registry():
    users = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if "OBJECTS" in p.read_text()}
    assert users == {"models/user.py"}


def test_poll_first_sets_every_wait_of_the_process(monkeypatch):
    monkeypatch.setattr(Backoff, "spin_s", 0.0)
    before = Backoff()
    Backoff.poll_first(2e-3)
    assert Backoff().spin_s == before.spin_s == 2e-3
    Backoff.poll_first(0.0)
    assert before.spin_s == 0.0


def test_model_spec_registers_an_object_that_load_object_finds():
    class Local:   # not importable: registered for this process
        pass

    spec = user.model_spec(Local)
    assert spec.startswith("python:") and "Local" in spec
    assert user.load_object(spec)[0] is Local
    assert user.model_spec("mlp") == "mlp"
    from mpilb.errors import UsageError   # importable: named by module and name
    assert user.model_spec(UsageError) == "mpilb.errors:UsageError"
    with pytest.raises(user.UsageError, match="not a model handed to mpilb.train"):
        user.load_object("python:Nothing")
