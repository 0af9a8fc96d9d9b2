"""ftc_runtime: loads and runs engines built by `ftc compile`. Needs torch, never the compiler."""

from .engine import Engine, Generation, GenerationStats
from .sampling import SamplingParams

__all__ = ["Engine", "Generation", "GenerationStats", "SamplingParams"]
__version__ = "0.1.0"
