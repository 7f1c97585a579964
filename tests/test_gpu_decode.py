"""The compiled tiny stack on GPUs: kimi_specialized with every pass (hybrid attention
over NCCL, mega_moe's exchange, the Triton KDA and expert kernels) against stock, 16
decode steps with padding rows. fp32 trajectories agree to 1e-4 (the kernels take fp32
dots, no rounding points); bf16 stays in the band of bf16 stock around fp32 stock
(docs/testing.md). At G = 2 also with decode context parallelism (DCP 2, both presets)
against the unsharded stock run. Skipped without CUDA (CI); G = 2 needs two GPUs.
"""

import dataclasses

import pytest
import torch

from kimi_inductor.harness import DecodeRun, decode_many
from kimi_inductor.launch import run_ranks


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_compiled_decode_on_gpus_agrees_with_stock(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    layout = "sp" if world > 1 else "tp"
    kda = DecodeRun(preset="tiny", layout=layout, q=4, requests=3, padding=1, steps=16, device="cuda",
                    dtype="float32")
    dsa = dataclasses.replace(kda, preset="tiny-k3.1", q=1, requests=2)  # T = 3: an SP pad row at G = 2
    compiled = dict(backend="kimi_specialized", options={"compiler": "inductor"})
    runs = [kda, dataclasses.replace(kda, **compiled), dsa, dataclasses.replace(dsa, dtype="bfloat16"),
            dataclasses.replace(dsa, dtype="bfloat16", **compiled)]
    if world > 1:  # decode context parallel: the Triton DCP cores and the LSE merge over NCCL
        runs += [dataclasses.replace(dsa, dcp=world, **compiled), dataclasses.replace(kda, dcp=world, **compiled)]
    results = run_ranks(decode_many, world, runs, backend="nccl")[0]
    ref32, out32, dsa32, dsa16, out16 = results[:5]
    for dcp_run, ref in zip(results[5:], (dsa32, ref32)):
        rel = ((dcp_run["outputs"] - ref["outputs"]).flatten(1).norm(dim=1) / ref["outputs"].flatten(1).norm(dim=1))
        assert rel.max() < 1e-4, f"DCP {world}: fp32 relative error {rel.max():.2e}"
    for result in (out32, out16):
        layers = result["report"]["layers"]
        assert all(l["rewritten"] for l in layers) or world == 1
        moe = [l for l in layers if l["mlp"] == "moe"]
        assert moe and all("triton: grouped Triton expert kernel" in l["notes"]["moe"] for l in moe)
    assert any("fused KDA" in l["notes"]["kernels"] for l in out32["report"]["layers"])
    a, b = ref32["outputs"], out32["outputs"]
    rel = ((b - a).flatten(1).norm(dim=1) / a.flatten(1).norm(dim=1)).max()
    assert rel < 1e-4, f"fp32 relative error {rel:.2e}"
    band = ((dsa16["outputs"] - dsa32["outputs"]).norm(dim=-1) / dsa32["outputs"].norm(dim=-1)).median()
    err = ((out16["outputs"] - dsa32["outputs"]).norm(dim=-1) / dsa32["outputs"].norm(dim=-1)).median()
    assert err <= 2.5 * band + 0.01, f"bf16 {err:.3f} vs stock's {band:.3f}"


@pytest.mark.gpu
def test_mxfp4_experts_compiled_on_a_gpu_agree_with_stock():
    """The tiny stack with its experts MXFP4 and held packed, compiled with every pass on
    one GPU: the grouped expert kernels upcast the codes in registers (``tl.dot_scaled``
    for bf16, dequantised tiles and fp32 dots for fp32); fp32 within 1e-4 of stock (which
    dequantises, then runs its loop), bf16 in the band of bf16 stock around fp32 stock."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    run = DecodeRun(preset="tiny", layout="tp", q=4, requests=3, padding=1, steps=16, device="cuda",
                    dtype="float32", experts="mxfp4")
    compiled = dict(backend="kimi_specialized", options={"compiler": "inductor"})
    runs = [run, dataclasses.replace(run, **compiled), dataclasses.replace(run, dtype="bfloat16"),
            dataclasses.replace(run, dtype="bfloat16", **compiled)]
    ref32, out32, ref16, out16 = run_ranks(decode_many, 1, runs, backend="nccl")[0]
    for result in (out32, out16):
        moe = [l["notes"]["moe"] for l in result["report"]["layers"] if l["mlp"] == "moe"]
        assert moe and all("MXFP4 experts; triton" in n for n in moe), moe
    rel = ((out32["outputs"] - ref32["outputs"]).flatten(1).norm(dim=1)
           / ref32["outputs"].flatten(1).norm(dim=1)).max()
    assert rel < 1e-4, f"fp32 relative error {rel:.2e}"
    band = ((ref16["outputs"] - ref32["outputs"]).norm(dim=-1) / ref32["outputs"].norm(dim=-1)).median()
    err = ((out16["outputs"] - ref32["outputs"]).norm(dim=-1) / ref32["outputs"].norm(dim=-1)).median()
    assert err <= 2.5 * band + 0.01, f"bf16 {err:.3f} vs stock's {band:.3f}"
