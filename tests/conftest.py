import os
from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    if not torch.cuda.is_available():
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def kernel_cache(tmp_path_factory) -> Path:
    """One kernel build cache for the whole session: engines with the same shapes share a build."""
    path = tmp_path_factory.mktemp("ftc-cache")
    os.environ["FTC_CACHE_DIR"] = str(path)
    return path
