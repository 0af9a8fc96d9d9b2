"""Every `ftc` command, called with its required arguments only, ends cleanly: never a traceback.

The commands are found by walking the typer app (`typer.main.get_command`), groups recursively, so
that a command added later is called too; the walk must find at least the commands known today.
Each one runs as a subprocess (an empty stdin, the working directory a fresh folder) on the tiny
Qwen3-MoE engine that `ftc compile` builds from model_specs/qwen3-moe-tiny.yaml, with:

- a required ENGINE/SOURCE argument: the engine directory; where its help names a spec, a second
  call gives the spec YAML instead (every such call ends in seconds: no spec is compiled without
  --random-weights);
- a required -o/--output: a path under the test's tmp_path that does not exist yet;
- any other required parameter: the test fails, asking for a value for it here.

A call ends cleanly in one of three ways:

- exit status 0, whatever it prints;
- exit status 1 with exactly one non-blank line on stderr, starting 'error: ' (`ftc.cli.errors.fail`);
- exit status 2, typer's usage error: stderr opens with 'Usage: ftc COMMAND' and names one of the
  command's parameters as '-o' / 'engine' in quotes (a bad or missing value, before the command runs).

A Python traceback on stderr never counts as clean, nor does any other exit status (a signal, a
crash). The groups themselves (`ftc`, `ftc bench`) only print their help and are not called.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

from ftc.cli.main import app

FTC = Path(sys.executable).parent / "ftc"
ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "model_specs" / "qwen3-moe-tiny.yaml"
TIMEOUT_S = 600  # per call; the slowest, `bench experts` (3 s a measurement), took 12 s on an idle 2-core machine

# The commands of today: the walk must find every one (more is fine), so that it cannot pass on none.
KNOWN = {"compile", "package", "inspect", "run", "profile", "trace",
         "bench experts", "bench decode", "bench matrix", "bench prefill", "bench agent", "bench load"}
ENGINE_ARGUMENTS = {"engine", "source"}  # names of the arguments that take the engine (or a spec)


def commands(command: Any = None, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """(path, command) of every command under `command` (the app), groups walked, not yielded. A
    group is told by its `commands` mapping (click's Group and typer's own vendored one both have it)."""
    command = typer.main.get_command(app) if command is None else command
    subcommands = getattr(command, "commands", None)
    if subcommands is None:
        yield " ".join(path), command
        return
    for name, sub in sorted(subcommands.items()):
        yield from commands(sub, (*path, name))


def takes_spec(command: Any) -> bool:
    """Whether the command's engine argument says, in its help, what it does with a spec."""
    return any(p.param_type_name == "argument" and p.name in ENGINE_ARGUMENTS and "spec" in (p.help or "").lower()
               for p in command.params)


COMMANDS = dict(commands())
CALLS = [pytest.param(path, given, id=path if given == "engine" else f"{path} (spec)")
         for path, command in COMMANDS.items() for given in ("engine", *(("spec",) if takes_spec(command) else ()))]


def ftc(args: list[Any], cwd: Path) -> subprocess.CompletedProcess:
    """The CLI in `cwd` with an empty stdin (never the test runner's terminal)."""
    return subprocess.run([str(FTC), *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=TIMEOUT_S,
                          input="")


def failure(r: subprocess.CompletedProcess, why: str) -> str:
    return f"{why}\ncommand: {' '.join(map(str, r.args))}\nrc: {r.returncode}\nstderr:\n{r.stderr}"


def required_args(path: str, given: str, engine: Path, tmp_path: Path) -> list[Any]:
    """The command line of `path` with its required parameters only: arguments in order, then options."""
    arguments, options = [], []
    for p in COMMANDS[path].params:
        if not p.required:
            continue
        if p.param_type_name == "argument" and p.name in ENGINE_ARGUMENTS:
            arguments.append(TINY if given == "spec" else engine)
        elif p.param_type_name == "option" and p.name == "output":
            options += [p.opts[0], tmp_path / "output"]
        else:
            pytest.fail(f"ftc {path}: no value for its required {p.param_type_name} {p.name!r}: add one to "
                        f"required_args in {Path(__file__).name}")
    return [*path.split(), *arguments, *options]


def check_clean(r: subprocess.CompletedProcess, path: str) -> None:
    """Exit 0, one 'error:' line and exit 1, or typer's usage error naming a parameter and exit 2."""
    assert "Traceback (most recent call last)" not in r.stderr, failure(r, "a traceback")
    if r.returncode == 0:
        return
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    if r.returncode == 1:
        assert len(lines) == 1 and lines[0].startswith("error: "), failure(r, "exit 1 without one 'error:' line")
    elif r.returncode == 2:
        names = {n for p in COMMANDS[path].params for n in (*p.opts, p.name, p.metavar) if n}
        assert lines and lines[0].startswith(f"Usage: ftc {path} "), failure(r, "exit 2 without a usage line")
        assert any(f"'{n}'" in r.stderr for n in names), failure(r, "a usage error naming no parameter")
    else:
        pytest.fail(failure(r, "neither 0, 1 (an error line) nor 2 (a usage error)"))


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory, kernel_cache: Path) -> Path:
    """The tiny engine, compiled by the CLI (its kernels built into the session's cache)."""
    out = tmp_path_factory.mktemp("every-command") / "tiny"
    r = ftc(["compile", TINY, "--random-weights", "--seed", 0, "-o", out, "--target", "auto"], cwd=out.parent)
    assert r.returncode == 0, failure(r, "the tiny engine did not compile")
    return out


def test_walk_finds_every_known_command() -> None:
    missing = KNOWN - COMMANDS.keys()
    assert not missing, f"the walk of the typer app missed {sorted(missing)}; it found {sorted(COMMANDS)}"


@pytest.mark.parametrize(("path", "given"), CALLS)
def test_command_ends_cleanly(path: str, given: str, tiny_engine: Path, tmp_path: Path) -> None:
    check_clean(ftc(required_args(path, given, tiny_engine, tmp_path), cwd=tmp_path), path)
