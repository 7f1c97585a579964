"""Shared test helpers (importable as ``helpers`` from the tests)."""

import torch


def compile_tiny(preset="tiny", layout="sp", group=None, q=4, requests=3, padding=1, options=None,
                 observer=None, dynamic=False, parallel_options=None, experts="bf16"):
    """Compile one decode step of the tiny stack with kimi_specialized (eager compiler)
    and run it once; returns the backend (reports) and the step's output."""
    from kimi_inductor.backend import KimiSpecialized
    from kimi_inductor.stock import KimiK3Config, Parallel
    from kimi_inductor.stock.batch import DecodeBatch
    from kimi_inductor.stock.checkpoint import build_model, random_checkpoint

    config = KimiK3Config.preset(preset)
    model = build_model(config, random_checkpoint(config, experts=experts),
                        Parallel(layout, group, **(parallel_options or {})))
    batch = DecodeBatch(requests, q, padding, config.vocab_size)
    caches = model.allocate_caches(batch.num_slots, batch.num_blocks, batch.block_size, batch.q)
    backend = KimiSpecialized({"compiler": "eager", **(options or {})}, observer=observer)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=backend, dynamic=dynamic)(batch.step(), caches)
    return backend, out


DENSE_PROBES = {  # a dense MLP's output y, changed by an op that is / is not row-local
    "mean_over_rows": lambda y: y + 0.5 * y.mean(0),
    "flipped_rows": lambda y: y + y.flip(0),
    "first_row_broadcast": lambda y: y + y[:1],
    "row_sized_views": lambda y: y.view(y.shape[0], 2, -1).transpose(1, 2).reshape(y.shape[0], -1),
}


def decode_with_dense_probe(cases):
    """On a rank: ``decode`` of each (probe name, DecodeRun) with the stock dense MLP's
    output passed through ``DENSE_PROBES[name]`` (in the stock and the compiled model)."""
    from kimi_inductor.harness import decode
    from kimi_inductor.stock.moe import DenseMLP

    forward, results = DenseMLP.forward, []
    try:
        for name, run in cases:
            probe = DENSE_PROBES[name]
            DenseMLP.forward = lambda self, x, is_padding=None, _p=probe: _p(forward(self, x, is_padding))
            results.append(decode(run))
    finally:
        DenseMLP.forward = forward
    return results
