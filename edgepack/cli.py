"""The ``edgepack`` command line: parses options and calls the library, nothing more."""
from __future__ import annotations

import sys

import click
from rich.markup import escape

from . import __version__
from .commands import all_commands
from .commands.common import err_console
from .errors import EdgepackError


class Context:
    def __init__(self, debug: bool):
        self.debug = debug


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="edgepack")
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.pass_context
def cli(ctx, debug):
    """Build one verified, self-contained executable per edge target from an ONNX model."""
    ctx.obj = Context(debug)


for _command in all_commands():  # edgepack/commands/: one module per command group
    cli.add_command(_command)


def _hoist_global_flags(argv: list[str]) -> list[str]:
    """`--debug` is a global flag, but people type it where they think of it (`edgepack build m.onnx
    --debug`): move it in front of the subcommand (never past a `--`)."""
    end = argv.index("--") if "--" in argv else len(argv)
    head, tail = argv[:end], argv[end:]
    if "--debug" not in head:
        return argv
    return ["--debug"] + [a for a in head if a != "--debug"] + tail


def main(argv=None):
    argv = _hoist_global_flags(list(argv if argv is not None else sys.argv[1:]))
    debug = "--debug" in argv
    try:
        cli.main(args=argv, prog_name="edgepack", standalone_mode=False)
    except EdgepackError as exc:
        if debug:
            raise
        err_console.print(f"[red]error:[/red] {escape(exc.message)}", soft_wrap=True)
        if exc.hint:
            err_console.print(f"[yellow]hint:[/yellow] {escape(exc.hint)}", soft_wrap=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        err_console.print("aborted")
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(2)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # a bug: one line and exit 70; --debug shows the traceback
        if debug:
            raise
        err_console.print(f"[red]error:[/red] internal error: {escape(type(exc).__name__)}: {escape(str(exc)[:300])}",
                          soft_wrap=True)
        err_console.print("[yellow]hint:[/yellow] please report this with the output of the same command "
                          "with --debug", soft_wrap=True)
        sys.exit(70)
    sys.exit(0)


if __name__ == "__main__":
    main()
