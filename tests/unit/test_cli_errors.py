"""The CLI's error contract, in-process: one `error:` line, a hint, a distinct exit code, no traceback."""
import pytest
from click.testing import CliRunner

from edgepack import errors
from edgepack.cli import cli, main


def _run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _main(capsys, *args) -> tuple[int, str]:
    """The real entry point (its error handler included); returns (exit code, stderr)."""
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    return exc.value.code, capsys.readouterr().err


def test_exit_codes_are_distinct():
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.EdgepackError)
               and c is not errors.EdgepackError]
    codes = [c.exit_code for c in classes]
    assert len(codes) == len(set(codes)), {c.__name__: c.exit_code for c in classes}
    assert all(1 < code < 64 for code in codes)


def _one_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_unknown_target_suggests_nearest(tmp_path, capsys):
    model = tmp_path / "m.onnx"
    model.write_bytes(b"not read: the target is checked first")
    code, err = _main(capsys, "build", str(model), "--target", "jetson-orn")
    assert code == errors.TargetError.exit_code, err
    assert "jetson-orn" in _one_error(err) and "jetson-orin" in err


def test_targets_json_lists_the_matrix():
    import json
    res = _run("targets", "--json")
    assert res.exit_code == 0
    names = {row["name"] for row in json.loads(res.output)}
    assert {"x86_64", "arm64", "jetson-orin", "jetson-xavier", "android-arm64"} <= names


def test_missing_model_file(tmp_path, capsys):
    code, err = _main(capsys, "build", str(tmp_path / "nope.onnx"), "--target", "x86_64")
    assert code == errors.ModelError.exit_code, err
    assert "nope.onnx" in _one_error(err)


def test_unknown_backend_is_refused_before_the_model_is_read(tmp_path, capsys):
    code, err = _main(capsys, "build", str(tmp_path / "never-read.onnx"), "--target", "x86_64", "--backend", "tmv")
    assert code == errors.UsageError.exit_code
    assert "unknown backend 'tmv'" in _one_error(err) and "ncnn" in err and "never-read" not in err


def test_debug_is_accepted_after_the_subcommand(tmp_path):
    from edgepack.cli import _hoist_global_flags
    assert _hoist_global_flags(["build", "m.onnx", "--debug"]) == ["--debug", "build", "m.onnx"]
    assert _hoist_global_flags(["run", "a", "--", "--debug"]) == ["run", "a", "--", "--debug"]
    with pytest.raises(errors.ModelError):  # with --debug the error propagates (the traceback is shown)
        main(["build", str(tmp_path / "nope.onnx"), "--target", "x86_64", "--debug"])


def test_fail_fast_with_ansible_is_refused_not_ignored(tmp_path, capsys):
    artifact = tmp_path / "m-x86_64"
    artifact.write_bytes(b"not read: the option pair is checked first")
    code, err = _main(capsys, "deploy", str(artifact), "-d", "root@127.0.0.1", "--via", "ansible", "--fail-fast")
    assert code == errors.UsageError.exit_code, err
    assert "--fail-fast applies to --via ssh only" in _one_error(err) and "--max-fail" in err


def _decode_loop_model(path):
    """y = x doubled until its sum passes a limit computed from x (at most 50 steps), with an If in the
    loop's body, as an autoregressive decoder's early stop has. The body reads the limit from outside
    itself, which the artifact's loop engine does not take (edgepack/loops.py): refused, with why."""
    from onnx import TensorProto, helper
    t = lambda name, shape=(): helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))  # noqa: E731
    branch = lambda name, op: helper.make_graph([helper.make_node(op, ["v_in", "v_in"], [name])], name, [],  # noqa: E731
                                                 [t(name, [4])])
    body = helper.make_graph(
        [helper.make_node("ReduceSum", ["v_in"], ["s"], keepdims=0),
         helper.make_node("Greater", ["s", "zero"], ["pos"]),
         helper.make_node("If", ["pos"], ["v_out"], then_branch=branch("t", "Add"), else_branch=branch("e", "Sub")),
         helper.make_node("ReduceSum", ["v_out"], ["s2"], keepdims=0),
         helper.make_node("Less", ["s2", "limit"], ["go"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("c", TensorProto.BOOL, []), t("v_in", [4])],
        [helper.make_tensor_value_info("go", TensorProto.BOOL, []), t("v_out", [4])],
        [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])])
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x"], ["xs"], keepdims=0), helper.make_node("Abs", ["xs"], ["limit"]),
         helper.make_node("Loop", ["steps", "cond", "x"], ["y"], body=body)], "decode", [t("x", [4])], [t("y", [4])],
        [helper.make_tensor("steps", TensorProto.INT64, [], [50]), helper.make_tensor("cond", TensorProto.BOOL, [], [True])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    import onnx
    onnx.save(model, path)


def test_a_data_dependent_loop_is_named_with_what_to_do(tmp_path, capsys):
    model = tmp_path / "decode.onnx"
    _decode_loop_model(model)
    code, err = _main(capsys, "build", str(model), "--target", "x86_64", "--out", str(tmp_path / "out"))
    assert code == errors.UnsupportedOpError.exit_code, err
    # the Loop is named, not the If inside its body (which sorts first)
    assert "cannot build op Loop" in err and "cannot build op If" not in err, err
    assert "step it from your code" in err and "reads 'limit' from outside it" in err, err
    assert not (tmp_path / "out" / "decode-x86_64").exists()
