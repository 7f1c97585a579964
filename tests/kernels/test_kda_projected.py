"""kimi_kernels::kda_decode_projected against its composition (skinny_mm, then kda_decode on
the in-projection's column slices), and the KDA kernel's signalled wait (``launch``'s
``signal``) against its plain launch."""

import pytest
import torch

import kimi_inductor.kernels.kda_decode as K
from kimi_inductor.kernels import kda_projected, skinny_gemm

from test_kda_decode import DEVICE, SHAPES, inputs

needs_cute = pytest.mark.skipif(bool(skinny_gemm.cute_available()), reason=skinny_gemm.cute_available() or "")


@pytest.mark.parametrize("H, D", SHAPES)
@pytest.mark.parametrize("nv, nc", [(1, 1), (4, 1), (1, 4)])
def test_kernel_leaves_the_gate_to_the_gemv_after_it(H, D, nv, nc, monkeypatch):
    """With a gate counter the kernel returns z = RMSNorm(o) w in fp32 (zeros for padding),
    z sigmoid(g2) rounded once is the plain kernel's output, the states are the same, and
    every (request, head) arrived at the counter once."""
    monkeypatch.setattr(K, "v_split", lambda R, H, D, Q=1: (nv, D // nv // nc))
    R, q = 3, 1
    x = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs(R, q, H, D, seed=5).items()}
    runs = []
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for gate_counter in (None, counter):
        y = {**x, "conv_state": x["conv_state"].clone(), "recurrent_state": x["recurrent_state"].clone()}
        runs.append((K.launch(**y, gate_counter=gate_counter), y["conv_state"], y["recurrent_state"]))
    (plain, *states), (z, *late_states) = runs
    assert z.dtype == torch.float32 and counter.item() == R * H
    gated = (z * torch.sigmoid(x["g2"].float())).to(plain.dtype)
    torch.testing.assert_close(gated, plain, atol=0, rtol=2**-7)  # the sigmoid's ulp may move a rounding
    assert all(torch.equal(a, b) for a, b in zip(states, late_states))


def projected_inputs(M, H, D, K_in, seed):
    """Stock's in-projection [q k v | g | f_a | b | pad] at hidden ``K_in``, and the KDA
    layer's weights and states (``inputs``), R = M requests of one token."""
    g = torch.Generator().manual_seed(seed)
    P = H * D
    N = 4 * P + D + H + (-(4 * P + D + H) % 16)
    x = inputs(M, 1, H, D, seed)
    for k in ("mixed_qkv", "f_a", "g2", "beta"):
        del x[k]
    x["x"] = torch.randn(M, K_in, generator=g).to(torch.bfloat16)
    x["in_weight"] = (torch.randn(N, K_in, generator=g) * K_in**-0.5).to(torch.bfloat16)
    x["columns"] = [0, 3 * P, 4 * P, 4 * P + D]
    return x


def composition(x):
    y = skinny_gemm.skinny_mm(x["x"], x["in_weight"], None, x["x"].dtype)
    H, D = x["recurrent_state"].shape[1], x["recurrent_state"].shape[-1]
    qkv, g2, fa, beta = x["columns"]
    rest = {k: v for k, v in x.items() if k not in ("x", "in_weight", "columns")}
    return K.kda_decode(y[:, qkv:qkv + 3 * H * D], y[:, fa:fa + D], g2=y[:, g2:g2 + H * D], beta=y[:, beta:beta + H],
                        **rest)


@pytest.mark.parametrize("H, D", SHAPES)
@pytest.mark.parametrize("M", [1, 2, 3])
def test_projected_equals_its_composition_over_steps(M, H, D):
    """Eight decode steps on the same states (the flags must be reset between calls), with
    a padding request: outputs and states bitwise the composition's. At TP8 shapes on a
    GPU with CuTe DSL, 1 and 2 rows take the overlapped path (``overlapped``), 3 rows the
    composition."""
    K_in = 7168 if DEVICE == "cuda" else 256
    x = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in projected_inputs(M, H, D, K_in, 7).items()}
    mine = {**x, "conv_state": x["conv_state"].clone(), "recurrent_state": x["recurrent_state"].clone()}
    for step in range(8 if DEVICE == "cuda" else 2):
        want = composition(x)
        got = torch.ops.kimi_kernels.kda_decode_projected(**mine)
        assert torch.equal(got, want), step
        assert torch.equal(mine["conv_state"], x["conv_state"]) and torch.equal(mine["recurrent_state"],
                                                                                x["recurrent_state"])
        x["x"] = mine["x"] = (x["x"].float() * 0.9 + 0.1 * got.float().sum()).to(x["x"].dtype)


def test_overlap_is_chosen_by_the_gemv_dispatch():
    """The overlap needs the CuTe GEMV on the in-projection and whole-tile g2 columns."""
    why = kda_projected.overlapped(16, 6288, 7168, 4608, 1536, torch.bfloat16, 4, 128)
    assert why.startswith("the in-projection runs on tl_dot")
    if not skinny_gemm.cute_available():
        assert kda_projected.overlapped(1, 6288, 7168, 4608, 1536, torch.bfloat16, 4, 128) == ""
        assert "whole 4-output tiles" in kda_projected.overlapped(1, 6288, 7168, 4606, 1536, torch.bfloat16, 4, 128)
        assert "conv width 3" in kda_projected.overlapped(1, 6288, 7168, 4608, 1536, torch.bfloat16, 3, 128)


@needs_cute
def test_skipping_and_gated_gemvs_compile_for_sm90a():
    """At one and two rows, TP8's in-projection: the GEMV without g2's tiles, and the GEMV
    of g2's rows with the gate in its epilogue."""
    from kimi_inductor.kernels.skinny_gemm import cute_gemv

    for M in (1, 2):
        skip = cute_gemv.skip_tiles(M, 6288, 7168, 4608, 6144)
        assert skip == cute_gemv.Skip(4608 // (4 * M), 6144 // (4 * M), 6288 // (4 * M))
        for args in (dict(cfg=cute_gemv.config(M, 6288, 7168), skip=skip, N=6288),
                     dict(cfg=kda_projected.gate_config(), fusion=cute_gemv.Fusion(gate_after=12 * M), N=1536)):
            N = args.pop("N")
            exe = cute_gemv.compile_gemv(M, N, 7168, False, torch.bfloat16, arch="sm_90a", pdl=True, preload=6,
                                         **args)
            assert exe.has_gpu_module
    assert "split 2 ways" in cute_gemv.skip_tiles(4, 3648, 7168, 1024, 2048)
