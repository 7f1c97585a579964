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


@pytest.fixture
def fake_world():
    """``fake_world(G, rank=0)``: a single-process fake process group of G ranks
    (collectives return garbage of the right shape), torn down after the test."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(world: int, rank: int = 0):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        return dist.group.WORLD

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()
