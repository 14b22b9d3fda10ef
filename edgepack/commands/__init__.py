"""The ``edgepack`` subcommands: one module per command group, each parsing options and calling the
library; a module lists its commands in ``COMMANDS``. ``edgepack.cli`` builds the group from
:func:`all_commands`. Nothing here imports ``edgepack.cli`` (no import cycle). Imports are static
so that the frozen (PyInstaller) edgepack finds every module."""
from __future__ import annotations


def all_commands():
    """Every top-level command, in the order of `edgepack --help` sections."""
    from . import build, cache, deploy, fleet, info, oci, run, tune
    for module in (build, run, info, tune, deploy, fleet, oci, cache):
        yield from module.COMMANDS
