"""The NCNN conversion cache key follows the rewrite code itself, not only its version number."""
import importlib

from edgepack.backends.ncnn import rewrite

convert = importlib.import_module("edgepack.backends.ncnn.convert")  # the package exports a function of that name


def test_an_edited_rewrite_module_changes_the_conversion_key(tmp_path, monkeypatch):
    copy = tmp_path / "rewrite.py"
    copy.write_bytes(open(rewrite.__file__, "rb").read())
    monkeypatch.setattr(rewrite, "__file__", str(copy))
    before = convert.graph_code_digest()
    assert convert.graph_code_digest() == before  # deterministic
    copy.write_text(copy.read_text() + "\n# an edit that keeps VERSION\n")
    assert convert.graph_code_digest() != before


def test_an_edited_list_of_speed_rewrites_changes_the_conversion_key(tmp_path, monkeypatch):
    # convert.py lists the speed rewrites (_batched) and memory.py marks the .param: both key it too
    from edgepack.backends.ncnn import memory
    for module in (convert, memory):
        copy = tmp_path / f"{module.__name__.rsplit('.', 1)[1]}.py"
        copy.write_bytes(open(module.__file__, "rb").read())
        monkeypatch.setattr(module, "__file__", str(copy))
        before = convert.graph_code_digest()
        copy.write_text(copy.read_text() + "\n# an edit that keeps every VERSION\n")
        assert convert.graph_code_digest() != before, module.__name__
