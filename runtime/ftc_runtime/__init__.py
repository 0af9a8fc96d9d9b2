"""ftc_runtime: loads and runs engines built by `ftc compile`. Needs torch, never the compiler."""

from ftc_runtime.settings import limit_openmp_spinning

limit_openmp_spinning()  # before torch is imported: OpenMP reads these once, when it loads

from ftc_runtime.engine import Engine, Generation, GenerationStats  # noqa: E402
from ftc_runtime.sampling import SamplingParams  # noqa: E402

__all__ = ["Engine", "Generation", "GenerationStats", "SamplingParams"]
__version__ = "0.1.0"
