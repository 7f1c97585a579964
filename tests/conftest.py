import warnings

import pytest
import torch

# funcol's "wait_tensor not called" notice fires when a spawned rank exits; harmless.
warnings.filterwarnings("ignore", message=".*wait_tensor.*")
warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
