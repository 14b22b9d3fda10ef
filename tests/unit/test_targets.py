import json

import pytest

from edgepack.errors import TargetError
from edgepack.targets import TargetMatrix, parse_target, verify_only_on
from edgepack.triple import parse_triple
from pathlib import Path

from edgepack.cli import main


def _cli(capsys, *args) -> tuple[int, str, str]:
    """edgepack's real entry point, in-process (the unit tier starts no processes)."""
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    cap = capsys.readouterr()
    return exc.value.code, cap.out, cap.err


@pytest.mark.parametrize("text,arch,abi,glibc", [
    ("aarch64-linux-musl", "aarch64", "musl", None),
    ("aarch64-linux-gnu.2.31", "aarch64", "gnu", "2.31"),
    ("x86_64-linux-musl", "x86_64", "musl", None),
    ("arm-linux-musleabihf", "arm", "musleabihf", None),
])
def test_parse_triple_valid(text, arch, abi, glibc):
    t = parse_triple(text)
    assert (t.arch, t.abi, t.glibc) == (arch, abi, glibc)
    assert t.zig == text


@pytest.mark.parametrize("text,needle", [
    ("aarch64-linux-musl.2.31", "gnu ABI"),
    ("riscv64-linux-musl", "unknown architecture"),
    ("aarch64-windows-gnu", "unsupported OS"),
    ("aarch64-linux-gnueabihf", "does not fit"),
    ("aarch64-linux-gnu.1.5", "out of range"),
    ("aarch64 linux musl", "invalid target string"),
    ("aarch64-linux-gnu.2", "invalid target string"),
])
def test_parse_triple_invalid(text, needle):
    with pytest.raises(TargetError) as e:
        parse_triple(text)
    assert needle in str(e.value)


def test_builtin_matrix_has_required_targets():
    m = TargetMatrix.load()
    for name in ("x86_64", "arm64", "jetson-orin", "jetson-xavier", "android-arm64"):
        assert name in m.names()
    assert m.get("jetson").name == "jetson-orin"
    android = m.get("android-arm64")
    assert android.link == "static-pie" and android.page_size == 16384
    assert m.get("jetson-orin").cpu == "cortex_a78ae"
    assert m.get("jetson-xavier").cpu == "carmel"


def test_resolve_comma_repeat_and_all():
    m = TargetMatrix.load()
    got = [t.name for t in m.resolve(["x86_64,arm64", "jetson", "arm64"])]
    assert got == ["x86_64", "arm64", "jetson-orin"]
    assert len(m.resolve([], all_targets=True)) == len(m.names())


def test_unknown_target_suggests_nearest():
    with pytest.raises(TargetError) as e:
        TargetMatrix.load().get("jetson-orn")
    assert "jetson-orin" in e.value.hint


@pytest.mark.parametrize("data,needle", [
    ({"name": "x", "triple": "aarch64-linux-musl"}, "verify_cpus is required"),
    ({"name": "x", "triple": "aarch64-linux-musl", "qemu_cpu": "max", "cpu": "cortex-a72"}, "underscores"),
    ({"name": "x", "triple": "aarch64-linux-musl", "qemu_cpu": "max", "page_size": 1000}, "power of two"),
    ({"name": "x", "triple": "aarch64-linux-musl", "qemu_cpu": "max", "link": "dynamic"}, "glibc"),
    ({"name": "x", "triple": "aarch64-linux-gnu.2.31", "qemu_cpu": "max"}, "link = \"dynamic\""),
    ({"name": "x", "triple": "aarch64-linux-musl", "qemu_cpu": "max", "cpus": "a"}, "did you mean 'cpu'"),
    ({"triple": "aarch64-linux-musl"}, "missing key 'name'"),
    ({"name": "x", "triple": "aarch64-linux-musl", "qemu_cpu": "max", "toolchain": "gcc"}, "unknown toolchain 'gcc'"),
])
def test_target_validation_errors(data, needle):
    with pytest.raises(TargetError) as e:
        parse_target(data, Path("t.toml"))
    assert needle in str(e.value)


def test_user_target_folder(tmp_path, capsys):
    (tmp_path / "rpi4.toml").write_text(
        'name = "rpi4"\ntriple = "aarch64-linux-musl"\ncpu = "cortex_a72"\nqemu_cpu = "cortex-a72"\n'
        'aliases = ["raspberrypi4"]\n')
    m = TargetMatrix.load([tmp_path])
    assert m.get("raspberrypi4").cpu == "cortex_a72"
    code, out, err = _cli(capsys, "targets", "--json", "--targets-dir", str(tmp_path))
    assert code == 0, err
    names = [t["name"] for t in json.loads(out)]
    assert "rpi4" in names and "jetson-orin" in names


def test_invalid_user_target_file_is_one_clear_line(tmp_path, capsys):
    (tmp_path / "bad.toml").write_text('name = "bad"\ntriple = "aarch64-linux-musl"\nqemu_cpu = "max"\nlink = "weird"\n')
    code, _, err = _cli(capsys, "targets", "--targets-dir", str(tmp_path))
    assert code == 3
    assert "bad.toml" in err and "link must be one of" in err
    assert "Traceback" not in err


def test_builtin_targets_verify_on_every_cpu_kind_they_may_meet():
    m = TargetMatrix.load()
    # generic Arm builds meet CPUs without and with fp16 arithmetic (ncnn switches it on by itself)
    assert m.get("arm64").verify_cpus == ("cortex-a53", "max")
    assert m.get("android-arm64").verify_cpus == ("cortex-a53", "max")
    assert m.get("jetson-orin").verify_cpus == ("max",) and m.get("jetson-xavier").verify_cpus == ("max",)
    # x86_64: this machine, an AVX2 CPU without AVX-512 and an Atom without AVX or F16C under qemu
    assert m.get("x86_64").verify_cpus == ("native", "Haswell-noTSX", "Denverton")
    assert m.get("arm64").qemu_cpu == "cortex-a53" and m.get("x86_64").qemu_cpu is None
    assert m.get("arm64").summary()["verify_cpus"] == ["cortex-a53", "max"]


@pytest.mark.parametrize("extra,needle", [
    ({"verify_cpus": []}, "non-empty list"),
    ({"verify_cpus": "max"}, "non-empty list"),
    ({"verify_cpus": ["max", "max"]}, "lists a CPU twice"),
    ({"verify_cpus": ["native"]}, "only for targets this machine runs natively"),
    ({"verify_cpus": ["cortex a53"]}, "not a qemu CPU model name"),
    ({"verify_cpus": ["max"], "qemu_cpu": "max"}, "give verify_cpus only"),
    ({"qemu_cpu": 3}, "must be str"),
    ({"verify_cpu": ["max"]}, "did you mean 'verify_cpus'"),
])
def test_verify_cpus_validation(extra, needle):
    with pytest.raises(TargetError) as e:
        parse_target({"name": "x", "triple": "aarch64-linux-musl"} | extra, Path("t.toml"))
    assert needle in str(e.value)


def test_legacy_qemu_cpu_still_names_the_one_verification_cpu():
    t = parse_target({"name": "x", "triple": "aarch64-linux-musl", "qemu_cpu": "cortex-a72"}, Path("t.toml"))
    assert t.verify_cpus == ("cortex-a72",) and t.qemu_cpu == "cortex-a72"
    x = parse_target({"name": "x", "triple": "x86_64-linux-musl"}, Path("t.toml"))
    assert x.verify_cpus == ("native",)
    assert parse_target({"name": "x", "triple": "x86_64-linux-musl", "verify_cpus": ["native", "Nehalem"]},
                        Path("t.toml")).verify_cpus == ("native", "Nehalem")


def test_every_builtin_target_names_a_toolchain_file_the_build_loads():
    from edgepack.toolchains import Toolchain
    m = TargetMatrix.load()
    for name in m.names():
        t = m.get(name)
        assert Toolchain.load(t.toolchain).name == t.toolchain


def test_verify_on_narrows_each_target_to_the_named_cpus_it_promises():
    m = TargetMatrix.load()
    x86, arm = m.get("x86_64"), m.get("arm64")
    got = verify_only_on([x86, arm], ("native", "cortex-a53"))
    assert [t.verify_cpus for t in got] == [("native",), ("cortex-a53",)]
    assert got[0].summary()["verify_cpus"] == ["native"]   # the manifest records where it was verified
    assert verify_only_on([x86], ()) == [x86]


@pytest.mark.parametrize("cpus, needle", [
    (("Skylake-Server",), "--verify-on Skylake-Server: no target built here verifies on it"),
    (("native",), "leaves target arm64 no CPU to verify on"),
])
def test_verify_on_refuses_a_cpu_no_target_names_or_a_target_left_without_one(cpus, needle):
    m = TargetMatrix.load()
    with pytest.raises(TargetError) as exc:
        verify_only_on([m.get("x86_64"), m.get("arm64")], cpus)
    assert needle in exc.value.message and exc.value.hint
