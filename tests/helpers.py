"""Shared test helpers (importable as ``helpers`` from the tests)."""

import torch


def compile_tiny(preset="tiny", layout="sp", group=None, q=4, requests=3, padding=1, options=None,
                 observer=None, dynamic=False, parallel_options=None):
    """Compile one decode step of the tiny stack with kimi_specialized (eager compiler)
    and run it once; returns the backend (reports) and the step's output."""
    from kimi_inductor.backend import KimiSpecialized
    from kimi_inductor.stock import KimiK3Config, Parallel
    from kimi_inductor.stock.batch import DecodeBatch
    from kimi_inductor.stock.checkpoint import build_model, random_checkpoint

    config = KimiK3Config.preset(preset)
    model = build_model(config, random_checkpoint(config), Parallel(layout, group, **(parallel_options or {})))
    batch = DecodeBatch(requests, q, padding, config.vocab_size)
    caches = model.allocate_caches(batch.num_slots, batch.num_blocks, batch.block_size, batch.q)
    backend = KimiSpecialized({"compiler": "eager", **(options or {})}, observer=observer)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=backend, dynamic=dynamic)(batch.step(), caches)
    return backend, out
