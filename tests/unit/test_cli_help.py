"""A CLI a person can learn from --help: every command and option explains itself, the main
commands show examples."""
import click

from edgepack.cli import cli

MAIN = ("build", "run", "inspect", "deploy", "tune", "verify-build")


def _commands(cmd, path=()):
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from _commands(sub, path + (name,))
    else:
        yield " ".join(path), cmd


def test_every_command_and_option_has_help_text():
    missing = [f"{name} {p.opts[0]}" for name, cmd in _commands(cli) for p in cmd.params
               if isinstance(p, click.Option) and not p.help and p.name != "help"]
    missing += [f"{name} (the command)" for name, cmd in _commands(cli) if not cmd.help]
    assert not missing, missing


def test_main_commands_show_examples():
    helps = dict(_commands(cli))
    assert not [n for n in MAIN if "Examples:" not in (helps[n].help or "")]
