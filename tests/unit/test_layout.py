"""The test tree's own rules, checked in the fast tier."""
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_modules_have_unique_basenames():
    # tests/ has no __init__.py: pytest imports each module by its basename, and two modules with one
    # name stop the whole suite at collection ("import file mismatch") although each passes alone
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1], [n for n, c in names.items() if c > 1]
