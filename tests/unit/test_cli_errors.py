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
