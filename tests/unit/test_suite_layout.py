"""The test tree itself: pytest imports test files by their base name (the directories have
no __init__.py), so two files of one name in different directories stop the whole run at
collection (`import file mismatch`)."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_file_has_a_name_of_its_own():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, k in names.items() if k > 1]
