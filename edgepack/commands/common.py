"""What every command module shares: the two consoles and small option helpers."""
from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

err_console = Console(stderr=True, highlight=False)
out_console = Console(highlight=False)


def log(msg: str) -> None:
    """Progress lines of a command: dim, on stderr (stdout stays for results and --json)."""
    err_console.print(f"[dim]{escape(msg)}[/dim]")


def target_dirs(dirs) -> list[Path]:
    return [Path(d) for d in dirs]


def debug_enabled() -> bool:
    ctx = click.get_current_context(silent=True)
    return bool(ctx and getattr(ctx.find_root().obj, "debug", False))


targets_dir_option = click.option("--targets-dir", multiple=True, type=click.Path(path_type=Path),
                                  help="Extra folder of target .toml files.")
