"""MetaSchedule tuning databases, keyed by (prepared model, TVM target).

``edgepack tune`` writes a JSONDatabase under ``<cache>/tvm-tuning/<key>/``; builds look there
(or in ``EDGEPACK_TUNING_DB`` / ``--tuning-db``) and apply it. Measuring a candidate means
running it, so targets of another architecture than the build machine are tuned on this
machine with a proxy target of the host's architecture: the schedules are valid anywhere
(MetaSchedule keys records by the workload, which is target-independent at this stage), but
their speed on the device is unmeasured — the database's meta.json says so.

The builder trap (shared notes): MetaSchedule's default builder imports tvm.s_tir.tensor_intrin
in every worker (~27 s under load), over its 30 s timeout, and every candidate then fails as
"Build errors" with no message. edgepack's builder function skips that import and gets a
generous timeout.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ...cache import cache_root, key_of, locked, sha256_bytes
from ...errors import BuildError, UsageError
from ...model import LoadedModel
from ...runner import host_arch
from ...targets import Target
from .runtime_lib import TVM_VERSION
from .target_map import target_dict

DB_FILES = ("database_workload.json", "database_tuning_record.json")
BUILDER_TIMEOUT_S = 600.0


def model_key(model: LoadedModel) -> str:
    return sha256_bytes(model.proto.SerializeToString())


def db_key(model: LoadedModel, target: Target) -> str:
    return key_of({"model": model_key(model), "target": target_dict(target), "tvm": TVM_VERSION})


def default_db_dir(model: LoadedModel, target: Target) -> Path:
    return cache_root() / "tvm-tuning" / f"{model.name}-{target.name}-{db_key(model, target)}"


def is_database(path: Path) -> bool:
    return all((path / f).is_file() for f in DB_FILES)


def find_database(model: LoadedModel, target: Target) -> tuple[Path | None, str]:
    """(database folder or None, why) for a build."""
    env = os.environ.get("EDGEPACK_TUNING_DB")
    if env == "off":
        return None, "tuning database switched off (--tuning-db off): untuned fused pipeline"
    if env:
        p = Path(env)
        if not is_database(p):
            raise UsageError(f"tuning database {p} does not exist or is incomplete (needs {' and '.join(DB_FILES)})",
                             hint="run `edgepack tune MODEL --target T --out-db PATH` first")
        return p, f"tuning database {p} (given)"
    p = default_db_dir(model, target)
    if is_database(p):
        return p, f"tuning database {p.name} (from `edgepack tune`)"
    return None, "no tuning database for this model and target: untuned fused pipeline (run `edgepack tune` for speed)"


def _light_tensor_intrinsics() -> None:
    """MetaSchedule's TuneContext imports tvm.s_tir.tensor_intrin, whose package __init__ also
    registers every CUDA intrinsic: ~100 s on a loaded 2-core machine, for nothing on a CPU.
    Register the package without running its __init__ and import only the CPU intrinsics
    (x86, Arm), ~6 s. Done once per process, before tuning starts."""
    import importlib
    import importlib.util
    import sys
    import types
    name = "tvm.s_tir.tensor_intrin"
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return
    pkg = types.ModuleType(name)
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__package__ = name
    pkg.__spec__ = spec
    sys.modules[name] = pkg
    for sub in ("x86", "arm_cpu"):
        importlib.import_module(f"{name}.{sub}")


def _build_candidate(mod, target, _params):
    """MetaSchedule builder function without the tensor-intrinsics import (see module doc)."""
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock
    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm_build(mod, target=target)


def measuring_target(target: Target) -> tuple[dict, bool]:
    """(TVM target dict candidates are measured with, whether it is a host proxy)."""
    d = target_dict(target)
    if target.arch == host_arch():
        return d, False
    proxy = {"kind": "llvm", "mtriple": f"{host_arch()}-unknown-linux-gnu", "mcpu": "x86-64-v2"
             if host_arch() == "x86_64" else "generic", "num-cores": d["num-cores"]}
    return proxy, True


@dataclass(frozen=True)
class TuneResult:
    path: Path
    trials: int
    tasks: int
    records: int
    seconds: float
    proxy: bool


def tune(model: LoadedModel, target: Target, trials: int, *, out_dir: Path | None = None, workers: int = 2,
         log=print) -> TuneResult:
    from .compile import TVM_LOCK, fuse, import_onnx, import_tvm
    with TVM_LOCK:
        return _tune(model, target, trials, out_dir=out_dir, workers=workers, log=log,
                     fuse=fuse, import_onnx=import_onnx, tvm=import_tvm())


def _tune(model, target, trials, *, out_dir, workers, log, fuse, import_onnx, tvm) -> TuneResult:
    from tvm.s_tir import meta_schedule as ms
    if trials < 1:
        raise UsageError("--trials must be at least 1")
    dest = Path(out_dir) if out_dir else default_db_dir(model, target)
    measure, proxy = measuring_target(target)
    tvm_target = tvm.target.Target(measure)
    if proxy:
        log(f"{target.name} is {target.arch}; candidates are measured here on {host_arch()} as a proxy "
            "(schedules stay valid on the device, their speed there is unmeasured)")
    mod = fuse(import_onnx(model), tvm_target)
    t0 = time.monotonic()
    _light_tensor_intrinsics()
    with locked(cache_root() / "locks" / f"tvm-tune-{dest.name}.lock"):
        work = dest.with_name(dest.name + ".work")
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        builder = ms.builder.LocalBuilder(max_workers=workers, timeout_sec=BUILDER_TIMEOUT_S, f_build=_build_candidate)
        runner = ms.runner.LocalRunner(evaluator_config=ms.runner.EvaluatorConfig(number=3, repeat=1,
                                                                                  min_repeat_ms=0))
        try:
            with tvm.transform.PassContext(opt_level=3):
                database = ms.relax_integration.tune_relax(
                    mod=mod, params={}, target=tvm_target, work_dir=str(work), max_trials_global=trials,
                    num_trials_per_iter=min(64, max(2, trials)), builder=builder, runner=runner, seed=0)
        except Exception as exc:
            raise BuildError(f"tuning failed: {str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__}",
                             hint=f"logs in {work / 'logs'}") from exc
        records = len(database.get_all_tuning_records())
        workloads = sum(1 for _ in open(work / DB_FILES[0])) if (work / DB_FILES[0]).is_file() else 0
        if records == 0:
            raise BuildError(f"tuning produced no valid schedule in {trials} trials",
                             hint=f"raise --trials; builder/runner logs in {work / 'logs'}")
        seconds = time.monotonic() - t0
        meta = {"model": model.name, "model_sha256": model_key(model), "target": target.name,
                "target_dict": target_dict(target), "measured_with": measure, "proxy": proxy, "trials": trials,
                "records": records, "workloads": workloads, "seconds": round(seconds, 1), "tvm": TVM_VERSION}
        (work / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        work.rename(dest)
    return TuneResult(dest, trials, workloads, records, seconds, proxy)
