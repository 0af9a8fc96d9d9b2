"""How every `ftc` command ends on a user's mistake: one 'error:' line on stderr and exit status 1,
never a traceback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer


def fail(e: Exception) -> None:
    # Plain text: messages carry paths and user input, which must be neither wrapped nor read as markup.
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(1)


def user_errors() -> tuple[type[Exception], ...]:
    """The errors that report a user's mistake (a bad spec, engine, file or option), not a bug.
    Imported when one is raised, so that a command line starts without the compiler and runtime."""
    from ftc.codegen.kernel_check import KernelCheckError
    from ftc.codegen.render import CodegenError
    from ftc.compile.checkpoint import CheckpointError
    from ftc.compile.targets import TargetError
    from ftc_runtime.artifact import ArtifactError
    from ftc_runtime.experts.cpu_kernel import KernelError
    from ftc_runtime.io.ftw import FtwError
    from ftc_runtime.kernel_build import BuildError
    from ftc_runtime.settings import SettingsError
    from ftc_runtime.spec import SpecError

    return (ArtifactError, FtwError, KernelError, SettingsError, SpecError, BuildError, CheckpointError,
            CodegenError, KernelCheckError, TargetError, ValueError, OSError, RuntimeError)


@contextmanager
def failing_on_user_errors() -> Iterator[None]:
    """A user error raised inside ends the command as `fail` does."""
    try:
        yield
    except user_errors() as e:
        fail(e)
