"""The user docs hold the contract they are cited for: nothing cites a file that is not in the
repository, docs/cli.md lists every command the CLI has, docs/logs.md every summary key."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from mpilb.cli.main import build_parser
from mpilb.runfiles.summary import SUMMARY_KEYS

ROOT = Path(__file__).resolve().parents[2]
CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def _shipped_files():
    for top in ("mpilb", "docs", "jobs"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".md", ".sh", ".sbatch", ""):
                yield path
    yield ROOT / "README.md"


def test_nothing_cites_a_design_file_the_repository_does_not_have():
    # the contract lives in docs/cli.md, data.md, logs.md and configuration.md
    citing = [str(p.relative_to(ROOT)) for p in _shipped_files()
              if "DESIGN.md" in p.read_text(errors="replace")]
    assert citing == []


def commands(parser: argparse.ArgumentParser, prefix: str = "mpilb") -> list[str]:
    """Every runnable command path of the parser: 'mpilb prepare csv', 'mpilb train', ..."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [prefix]
    return [path for name, sub in subs[0].choices.items()
            for path in commands(sub, f"{prefix} {name}")]


def test_cli_md_lists_every_command():
    text = (ROOT / "docs" / "cli.md").read_text()
    block = text.split("## Commands", 1)[1].split("```")[1]   # the command list
    found = commands(build_parser())
    assert {"mpilb prepare csv", "mpilb prepare hdf5", "mpilb export", "mpilb evaluate",
            "mpilb simulate", "mpilb bench ps"} <= set(found)
    missing = [c for c in found if not re.search(rf"^(mpiexec -n P )?{c}\b", block, re.M)]
    assert missing == []


def test_logs_md_names_every_summary_key():
    text = (ROOT / "docs" / "logs.md").read_text()
    table = text.split("## Summary keys", 1)[1].split("\n## ", 1)[0]
    assert [k for k in SUMMARY_KEYS if f"`{k}`" not in table] == []


@pytest.mark.parametrize("page", ["README.md", "docs/models.md"])
def test_the_cpu_only_torch_install_is_given(page):
    assert CPU_TORCH in (ROOT / page).read_text()


@pytest.mark.parametrize("page", ["docs/models.md", "docs/quickstart.md", "README.md"])
def test_how_to_pages_carry_no_generated_tables(page):
    # measurements are on the benchmark pages (docs/benchmarks.md, docs/benchmarks/*.md)
    assert "BEGIN generated" not in (ROOT / page).read_text()


def test_the_readme_demo_is_the_command_its_benchmark_runs():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import readme_demo

    readme = (ROOT / "README.md").read_text()
    for b in ("load", "static"):
        assert readme_demo.DEMO.format(b=b) in readme
