"""Per-device results: one frozen record per device, shown as a table (tables.print_table) or JSON for CI."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..tables import Cell

DEPLOYED, NO_CHANGE, ROLLED_BACK = "deployed", "no change", "rolled back"
FAILED, UNREACHABLE, SKIPPED = "failed", "unreachable", "skipped"
OK, PASS = "ok", "pass"
SUCCESS = {DEPLOYED, NO_CHANGE, OK, PASS}
_STYLE = {DEPLOYED: "green", NO_CHANGE: "cyan", OK: "green", PASS: "green", ROLLED_BACK: "yellow",
          FAILED: "red", UNREACHABLE: "red", SKIPPED: "dim"}


@dataclass(frozen=True)
class DeviceResult:
    device: str
    address: str
    status: str
    seconds: float
    target: str | None = None          # the artifact's target (deploy) or the device's (check)
    arch: str | None = None            # what the device reported
    latency_ms: float | None = None    # from the artifact's selftest, on the device
    message: str = ""                  # one line: what happened / why it failed
    hint: str = ""
    output: str = ""                   # selftest output when it failed
    sha256: str | None = None          # the version now current on the device
    dest: str | None = None            # the install folder on the device (absolute)
    glibc: str | None = None
    free_bytes: int | None = None
    bench: dict | None = None
    command: str = "deploy"

    @property
    def ok(self) -> bool:
        # for `edgepack rollback`, rolling back is the success; for deploy it means the new version failed
        return self.status in SUCCESS or (self.command == "rollback" and self.status == ROLLED_BACK)

    def to_json(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        d["seconds"] = round(self.seconds, 3)
        return d


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"


def table_rows(results: list[DeviceResult], kind: str = "deploy") -> tuple[list[str], list[list]]:
    """Columns and rows of the per-device table (printed by tables.print_table: boxed on a terminal,
    tab-separated when piped, so a CI log never truncates a device name or message)."""
    cols = ["device"] + {"deploy": ["target", "result", "time", "latency"],
                         "check": ["address", "arch", "glibc", "free", "current", "result"],
                         "smoke": ["result", "time", "latency", "bench p50"],
                         "rollback": ["result", "time", "latency"]}[kind] + ["detail"]
    rows = []
    for r in results:
        res = Cell(r.status.upper() if r.status == ROLLED_BACK else r.status, _STYLE.get(r.status, ""))
        lat = f"{r.latency_ms:.2f} ms" if r.latency_ms is not None else "-"
        detail = r.message + (f"\n{r.output}" if r.output and not r.ok else "")
        row = [r.device]
        if kind == "check":
            row += [r.address, r.arch or "-", r.glibc or "-", _fmt_bytes(r.free_bytes), (r.sha256 or "-")[:8], res]
        elif kind == "smoke":
            med = (r.bench or {}).get("median_ms")
            emulated = " (emulated)" if (r.bench or {}).get("emulated") else ""
            row += [res, f"{r.seconds:.2f} s", lat, f"{med:.2f} ms{emulated}" if med is not None else "-"]
        elif kind == "deploy":
            row += [r.target or "-", res, f"{r.seconds:.2f} s", lat]
        else:
            row += [res, f"{r.seconds:.2f} s", lat]
        rows.append(row + [detail])
    return cols, rows
