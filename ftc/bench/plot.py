"""One PNG figure for the benchmarks' `--plot`: matplotlib (an optional dependency) without a
display, one axes, a legend, saved and closed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def png_axes(path: Path) -> Iterator[Any]:
    """The axes to draw on; on leaving, the figure gets its legend and is written to `path`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError(f"--plot {path}: needs matplotlib (pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        yield ax
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
