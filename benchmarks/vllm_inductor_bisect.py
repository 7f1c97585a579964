"""Where Inductor's compile of vLLM's own K3 graph departs from vLLM's eager forward
(issue 17; docs/vllm.md, "vLLM's K3 stack on one H200").

vLLM's tiny K3 (5 layers, TP 1), one decode step of 8 requests + 1 padding row at CTX
tokens of random cache: vLLM's eager forward, then the backbone compiled several ways
from the same cache state, each compared with eager on its output (relative error of the
live rows) and on every cache tensor it wrote (relative error; for the int8 KDA pages,
the fraction of bytes that differ). Backends: Inductor with config variants, and
``aot_eager_decomp_partition`` / ``aot_eager`` (the same decomposed graph without code
generation). First, on CUDA, the page spelling alone (``page_spelling``): a Triton
kernel mutating ``page[:, 64:128].view(bf16).view(8, 4, 8)`` of an int8 page, eager
against Inductor (on the CPU a custom op through the same spelling is miscompiled,
docs/vllm.md). Run on the GPU as ``benchmarks/vllm_stack.py`` is (docs/vllm.md);
``DEV=cpu CTX=20 ONLY=aot_eager`` checks the script on a CPU."""

from __future__ import annotations

import os
import traceback

import torch

from kimi_inductor import vllm_cpu

ROWS = 8
VARIANTS = [("inductor", {}), ("inductor", {"emulate_precision_casts": True}),
            ("inductor", {"emulate_precision_casts": True, "pattern_matcher": False}),
            ("inductor", {"pattern_matcher": False}),
            ("inductor", {"pattern_matcher": False, "reorder_for_locality": False, "reorder_for_peak_memory": False}),
            ("aot_eager_decomp_partition", {}), ("aot_eager", {})]


def difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of ``a`` against ``b``; for int8 pages the share of bytes that differ."""
    if a.dtype in (torch.int8, torch.uint8):
        return float((a != b).float().mean())
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def page_spelling() -> None:
    """Inductor vs eager on a Triton kernel that mutates a reshaped dtype view of an int8
    page: vLLM's spelling (a dtype view of a byte slice, as its KDA kernels take their
    states) and ``byte_pages``' (a slice of the page's dtype view)."""
    import triton
    import triton.language as tl

    @triton.jit
    def halve(ptr, stride_s, stride_r, N: tl.constexpr, R: tl.constexpr):
        s = tl.program_id(0)
        offs = tl.arange(0, R)[:, None] * stride_r + tl.arange(0, N)[None, :]
        x = tl.load(ptr + s * stride_s + offs)
        tl.store(ptr + s * stride_s + offs, (x.to(tl.float32) * 0.5).to(x.dtype))

    spellings = {"vllm": lambda page: page[:, 64:128].view(torch.bfloat16).view(8, 4, 8),
                 "byte_pages": lambda page: page.view(torch.bfloat16)[:, 32:64].view(8, 4, 8)}
    for name, state_of in spellings.items():
        def f(page):
            state = state_of(page)
            halve[(8,)](state, state.stride(0), state.stride(1), N=8, R=4)
            return page.float().sum()

        page = torch.randn(8, 64, device="cuda").to(torch.bfloat16).view(torch.int8)  # finite bf16 bytes
        eager, compiled = page.clone(), page.clone()
        f(eager)
        torch.compile(f, backend="inductor", fullgraph=True)(compiled)
        torch.cuda.synchronize()
        print(f"page spelling {name}, Triton launch: bytes differing", int((eager != compiled).sum()), "of",
              page.numel(), flush=True)


def main() -> None:
    device, context = os.environ.get("DEV", "cuda"), int(os.environ.get("CTX", "1024"))
    if device == "cuda":
        try:
            page_spelling()
        except Exception:  # noqa: BLE001  (the model comparison still runs)
            traceback.print_exc()
    cfg, model = vllm_cpu.build(tp=1, sp=False, layers=5, device=device, max_model_len=context + 64)
    batch = vllm_cpu.decode_batch(model, cfg, ROWS, 1, max_context=context + 16, device=device, context=context)
    step = vllm_cpu.next_step(cfg, batch)
    named = [(f"{name}[{i}]", t) for name, c in batch.caches.items()
             for i, t in enumerate(c if isinstance(c, list) else [c])]
    start = [t.clone() for _, t in named]

    def run(fn) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for (_, t), saved in zip(named, start):
            t.copy_(saved)
        out = fn()[:ROWS].clone()
        if device == "cuda":
            torch.cuda.synchronize()
        return out, [t.clone() for _, t in named]

    ref, ref_caches = run(lambda: vllm_cpu.eager_step(model, cfg, step))
    print("eager wrote:", [(n, round(difference(t, s), 5)) for (n, _), t, s in zip(named, ref_caches, start)])
    only = os.environ.get("ONLY")
    for backend, config in VARIANTS:
        if only and backend != only:
            continue
        try:
            compiled = vllm_cpu.compile_backbone(model, backend, inductor_config=config)
            out, written = run(lambda: compiled.step(cfg, step))
        except Exception:  # noqa: BLE001  (the next variant still runs)
            print(backend, config, "failed")
            traceback.print_exc()
            continue
        diffs = [(n, round(difference(t, r), 4)) for (n, _), t, r in zip(named, written, ref_caches)
                 if difference(t, r) > 0]
        print(backend, config, "out err", round(difference(out, ref), 4), "cache diffs", diffs, flush=True)


if __name__ == "__main__":
    main()
