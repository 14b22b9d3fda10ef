"""Checked subprocess calls: every external command goes through ``run``."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Mapping, Sequence

from .errors import BuildError, ToolMissingError


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run(cmd: Sequence[str | os.PathLike], *, what: str, cwd: Path | None = None,
        env: Mapping[str, str] | None = None, timeout: float | None = None,
        error: type = BuildError, log: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd``; raise ``error`` naming ``what`` with the output's tail when it fails.

    ``log``, when given, receives the full stdout+stderr (heavy builds write a lot).
    """
    argv = [str(c) for c in cmd]
    full_env = None
    if env is not None:
        full_env = dict(os.environ)
        full_env.update(env)
    try:
        proc = subprocess.run(argv, cwd=cwd, env=full_env, timeout=timeout,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              errors="replace")
    except FileNotFoundError as exc:
        raise ToolMissingError(f"{what}: program not found: {argv[0]}",
                               hint="run `edgepack doctor` to see what is missing") from exc
    except subprocess.TimeoutExpired as exc:
        raise error(f"{what}: timed out after {timeout:.0f} s") from exc
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(proc.stdout)
    if proc.returncode != 0:
        where = f" (full log: {log})" if log else ""
        raise error(f"{what} failed with exit code {proc.returncode}{where}:\n{_tail(proc.stdout)}")
    return proc


def run_streaming(cmd: Sequence[str | os.PathLike], *, what: str, on_line, env: Mapping[str, str] | None = None,
                  error: type = BuildError, log: Path) -> None:
    """Like ``run`` for long builds: every output line goes to ``log`` and to ``on_line`` as it comes
    (progress bars are fed from the build's own step counts), and a failure names the log."""
    argv = [str(c) for c in cmd]
    full_env = dict(os.environ, **env) if env is not None else None
    log.parent.mkdir(parents=True, exist_ok=True)
    tail: list[str] = []
    try:
        with open(log, "w") as out, subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE,
                                                     stderr=subprocess.STDOUT, text=True, errors="replace") as p:
            for line in p.stdout:
                out.write(line)
                tail = (tail + [line.rstrip()])[-25:]
                on_line(line)
            rc = p.wait()
    except FileNotFoundError as exc:
        raise ToolMissingError(f"{what}: program not found: {argv[0]}",
                               hint="run `edgepack doctor` to see what is missing") from exc
    if rc != 0:
        raise error(f"{what} failed with exit code {rc} (full log: {log}):\n" + "\n".join(tail))



def run_forked(fn, args: tuple = (), timeout: float = 600.0) -> tuple[str, object]:
    """``fn(*args)`` in a forked child, so that a crash in native code (a segfault inside a wheel)
    ends the child, not this process. Returns ``("ok", value)``; ``("raised", (cls, message, hint))``
    where ``cls`` is the EdgepackError subclass raised, or None for any other exception (``message``
    then starts with its type name); or ``("died", why)`` when the child died or ran past ``timeout``."""
    import multiprocessing
    from .errors import EdgepackError

    def child(conn):
        try:
            conn.send(("ok", fn(*args)))
        except EdgepackError as exc:
            conn.send(("raised", (type(exc), exc.message, exc.hint)))
        except BaseException as exc:  # noqa: BLE001  the parent decides what it means
            conn.send(("raised", (None, f"{type(exc).__name__}: {exc}"[:300], None)))
        finally:
            conn.close()

    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    # not a daemon: a daemonic process may not start children, and run_forked nests (node_suite runs
    # a conversion in a child, whose ncnn check forks again); this function always joins or kills it
    proc = ctx.Process(target=child, args=(send,), daemon=False)
    proc.start()
    send.close()
    try:
        got = recv.recv() if recv.poll(timeout) else None
    except EOFError:  # the child died before answering (a signal inside native code)
        got = None
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if got is None:
        return "died", (f"timed out after {timeout:.0f} s" if proc.exitcode in (None, -9)
                        else f"exit {proc.exitcode}")
    return got
