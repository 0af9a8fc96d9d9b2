"""`release_device_memory`: what a benchmark does between two engines of one run, so that the
next one's expert slots fit where the last one's were."""

from __future__ import annotations

import gc

import torch


def release_device_memory() -> None:
    """Frees what a dropped engine held on the GPU: its tensors collected now (an engine's objects
    refer to each other), then torch's cached blocks given back for the next engine's slots."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
