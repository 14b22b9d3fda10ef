"""Pre/post-processing spec strings and sidecar tables: parsed strictly, errors name the setting."""
import pytest

from edgepack.errors import UsageError
from edgepack.prepost import load_config, parse_postprocess, parse_preprocess


def test_preprocess_string(tmp_path):
    pre = parse_preprocess("image:size=224x160,layout=nchw,dtype=float32,mean=0.5,std=0.25,resize=nearest", tmp_path)
    assert (pre.size, pre.layout, pre.dtype, pre.resize) == ((224, 160), "nchw", "float32", "nearest")
    assert pre.mean == (0.5,) and pre.std == (0.25,)


def test_preprocess_table_equals_string(tmp_path):
    a = parse_preprocess("image:layout=nhwc,dtype=uint8,channels=3", tmp_path)
    b = parse_preprocess({"kind": "image", "layout": "nhwc", "dtype": "uint8", "channels": 3}, tmp_path)
    assert a == b


@pytest.mark.parametrize("spec,needle", [
    ("audio:rate=16000", "kind 'audio'"),
    ("image:layout=hwc", "layout"),
    ("image:dtype=int16", "dtype"),
    ("image:resize=cubic", "resize"),
    ("image:channels=4", "channels"),
    ("image:colour=rgb", "unknown preprocess setting 'colour'"),
    ("image:std=0", "std must not contain 0"),
])
def test_preprocess_rejects(tmp_path, spec, needle):
    with pytest.raises(UsageError, match=needle):
        parse_preprocess(spec, tmp_path)


def test_postprocess_string_and_labels(tmp_path):
    (tmp_path / "labels.txt").write_text("cat\ndog\n\n")
    post = parse_postprocess("softmax,topk=2,labels=labels.txt", tmp_path)
    assert post.softmax and post.topk == 2 and post.labels == ["cat", "dog"]


@pytest.mark.parametrize("spec,needle", [("topk=0", "1..1000"), ("topk=x", "expected a number"),
                                         ("argmax", "unknown postprocess setting 'argmax'"),
                                         ("labels=missing.txt", "not found")])
def test_postprocess_rejects(tmp_path, spec, needle):
    with pytest.raises(UsageError, match=needle):
        parse_postprocess(spec, tmp_path)


def test_sidecar_is_read_and_command_line_wins(tmp_path):
    model = tmp_path / "m.onnx"
    model.write_bytes(b"")
    (tmp_path / "m.edgepack.toml").write_text('[preprocess]\nlayout = "nchw"\n[postprocess]\ntopk = 3\n')
    pre, post = load_config(model, None, None)
    assert pre.layout == "nchw" and post.topk == 3
    pre, post = load_config(model, "image:layout=nhwc", "topk=1")
    assert pre.layout == "nhwc" and post.topk == 1


def test_sidecar_unknown_section_is_named(tmp_path):
    model = tmp_path / "m.onnx"
    model.write_bytes(b"")
    (tmp_path / "m.edgepack.toml").write_text("[postproces]\ntopk = 3\n")
    with pytest.raises(UsageError, match="m.edgepack.toml: unknown section"):
        load_config(model, None, None)
