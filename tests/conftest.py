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


def compile_tiny(preset="tiny", layout="sp", group=None, q=4, requests=3, padding=1, options=None,
                 observer=None, dynamic=False):
    """Compile one decode step of the tiny stack with kimi_specialized (eager compiler)
    and run it once; returns the backend (reports) and the step's output."""
    from kimi_inductor.backend import KimiSpecialized
    from kimi_inductor.stock import KimiK3Config, Parallel
    from kimi_inductor.stock.batch import DecodeBatch
    from kimi_inductor.stock.checkpoint import build_model, random_checkpoint

    config = KimiK3Config.preset(preset)
    model = build_model(config, random_checkpoint(config), Parallel(layout, group))
    batch = DecodeBatch(requests, q, padding, config.vocab_size)
    caches = model.allocate_caches(batch.num_slots, batch.num_blocks, batch.block_size, batch.q)
    backend = KimiSpecialized({"compiler": "eager", **(options or {})}, observer=observer)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=backend, dynamic=dynamic)(batch.step(), caches)
    return backend, out
