"""`edgepack cache list` and `edgepack cache prune`: what the user cache holds, and removing what is
superseded or unused (edgepack/cache_entries.py; docs/cache.md)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import click
from rich.markup import escape

from ..tables import Cell, print_table
from .common import err_console, out_console, target_dirs, targets_dir_option

_STATE_STYLE = {"current": "green", "superseded": "yellow", "incomplete": "red", "unkeyed": ""}


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _ago(t: float, now: float) -> str:
    s = max(0.0, now - t)
    return f"{s / 86400:.0f} d ago" if s >= 86400 else f"{s / 3600:.0f} h ago" if s >= 3600 else \
        f"{s / 60:.0f} min ago"


def _rel(path: Path) -> str:
    from ..cache import cache_root
    try:
        return str(path.relative_to(cache_root()))
    except ValueError:
        return str(path)


@click.group("cache")
def cache_group():
    """See and prune the user cache (~/.cache/edgepack, or $EDGEPACK_CACHE)."""


@cache_group.command("list")
@targets_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print the entries as JSON on stdout.")
def list_cmd(targets_dir, as_json):
    """List every cache entry: kind, state, size, last use.

    \b
    States: current (a known target uses it now), superseded (no target would use it: an older
    edgepack's build), incomplete (a build that did not finish), unkeyed (judged by its last use).

    \b
    Examples:
      edgepack cache list
      edgepack cache list --json | jq '.entries[] | select(.state == "superseded")'
    """
    from ..cache import cache_root
    from ..cache_entries import list_entries
    entries = list_entries(target_dirs(targets_dir))
    now = time.time()
    total = sum(e.bytes for e in entries)
    stale = sum(e.bytes for e in entries if e.state in ("superseded", "incomplete"))
    if as_json:
        click.echo(json.dumps({"root": str(cache_root()), "bytes": total, "entries": [
            {"kind": e.kind, "path": str(e.path), "bytes": e.bytes, "last_used": round(e.last_used),
             "state": e.state} for e in entries]}, indent=1))
        return
    print_table(out_console, f"edgepack cache {cache_root()}", ["kind", "state", "size", "last used", "entry"],
                [[e.kind, Cell(e.state, _STATE_STYLE[e.state]), _mb(e.bytes), _ago(e.last_used, now), _rel(e.path)]
                 for e in entries])
    out_console.print(f"total: {_mb(total)} in {len(entries)} entries ({_mb(stale)} superseded or incomplete)")


@cache_group.command("prune")
@click.option("--dry-run", "-n", is_flag=True, help="Print what would be removed; remove nothing.")
@click.option("--older-than", default="30d", show_default=True, metavar="AGE",
              help="Unkeyed entries (conversions, leftovers, OCI pulls, zig's caches) unused for this long go "
                   "(s, m, h, d, w: 12h, 30d, 0).")
@click.option("--all", "everything", is_flag=True,
              help="Remove every entry, current builds too (tuning databases and the corpus still need --include).")
@click.option("--include", multiple=True, type=click.Choice(["tuning", "corpus"]),
              help="Also prune TVM tuning databases (superseded ones; every one with --all) or the bench corpus "
                   "(by age); repeatable.")
@targets_dir_option
def prune_cmd(dry_run, older_than, everything, include, targets_dir):
    """Remove superseded and incomplete builds and unkeyed entries unused for --older-than.

    Each entry is removed under its builder's lock, taken without waiting: an entry a running
    build holds is skipped. Tuning databases (your tuning work) and the corpus stay unless named.

    \b
    Examples:
      edgepack cache prune --dry-run
      edgepack cache prune --older-than 7d
      edgepack cache prune --all --include tuning
    """
    from ..cache_entries import list_entries, parse_age, prune, to_prune
    age = parse_age(older_than)
    chosen = to_prune(list_entries(target_dirs(targets_dir)), age, everything=everything, include=tuple(include))
    freed = 0
    for r in prune(chosen, dry_run=dry_run):
        e = r.entry
        what = f"{e.kind} {_rel(e.path)} ({_mb(e.bytes)}, {e.state})"
        if r.why:
            err_console.print(f"[yellow]skipped[/yellow] {escape(what)}: {escape(r.why)}", soft_wrap=True)
            continue
        freed += e.bytes
        out_console.print(f"{'would remove' if dry_run else 'removed'} {escape(what)}", soft_wrap=True)
    out_console.print(f"{'would free' if dry_run else 'freed'} {_mb(freed)}"
                      + ("" if chosen else " (nothing to prune)"))


COMMANDS = (cache_group,)
