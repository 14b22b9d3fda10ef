"""The test tree's own rules, checked in the fast tier."""
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_modules_have_unique_basenames():
    # tests/ has no __init__.py: pytest imports each module by its basename, and two modules with one
    # name stop the whole suite at collection ("import file mismatch") although each passes alone
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1], [n for n, c in names.items() if c > 1]


def test_every_runtime_source_ships_in_the_package():
    # a non-editable install only carries what package-data names (ep_ncnn_pool.cc was once left out:
    # an installed edgepack could not build any NCNN artifact, while the editable CI install could)
    import fnmatch
    import tomllib
    repo = TESTS.parent
    data = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    missing = []
    for path in (repo / "runtimes").rglob("*"):
        if not path.is_file() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(repo / "runtimes")
        package = "edgepack._runtimes." + rel.parts[0] if len(rel.parts) > 1 else "edgepack._runtimes"
        inner = "/".join(rel.parts[1:])
        if not any(fnmatch.fnmatch(inner, pat) for pat in data.get(package, [])):
            missing.append(str(rel))
    assert not missing, missing
