"""kimi_kernels::kda_decode against its reference (stock f_b GEMM + kimi::kda_decode)."""

import pytest
import torch

import kimi_inductor.kernels.kda_decode as K

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter is slow: toy heads there, real TP8 heads (12 x 128) on the GPU
SHAPES = [(12, 128)] if DEVICE == "cuda" else [(2, 16)]


def inputs(R, q, H, D, seed):
    g = torch.Generator().manual_seed(seed)
    P = H * D
    bf16 = torch.bfloat16

    def r(*shape, scale=1.0, dtype=bf16):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    packed = r(R * q, 4 * P + D + H + 8)  # the in-projection's output: views into it, as in the graph
    slots = (1 + torch.arange(R * q, dtype=torch.int32)).view(R, q)
    slots[1 % R] = 0  # a padding request
    accepted = torch.randint(1, q + 1, (R,), generator=g, dtype=torch.int32)
    return dict(
        mixed_qkv=packed[:, :3 * P], f_a=packed[:, 4 * P:4 * P + D], f_b_weight=r(P, D, scale=D**-0.5),
        g2=packed[:, 3 * P:4 * P], beta=packed[:, 4 * P + D:4 * P + D + H],
        conv_weight=r(3 * P, 1, 4, scale=0.5, dtype=torch.float32),
        A_log=torch.log(torch.rand(H, generator=g) * 15 + 1), dt_bias=r(P, scale=0.5, dtype=torch.float32),
        norm_weight=1 + r(D, scale=0.1), conv_state=r(1 + R * q, 2 + q, 3 * P),
        recurrent_state=r(1 + R * q, H, D, D, scale=0.3, dtype=torch.float32),
        state_slots=slots, num_accepted=accepted, lower_bound=-5.0, norm_eps=1e-5)


@pytest.mark.parametrize("H, D", SHAPES)
@pytest.mark.parametrize("R, q", [(1, 1), (3, 1), (5, 4), (2, 8)])
@pytest.mark.parametrize("dtype, nv, nc", [(torch.bfloat16, 1, 1), (torch.float32, 1, 1), (torch.bfloat16, 4, 1),
                                           (torch.bfloat16, 1, 4), (torch.bfloat16, 2, 2)])
def test_kernel_matches_reference(R, q, H, D, dtype, nv, nc, monkeypatch):
    """``nv``: V blocks per head (4: the last-arriving program normalises and writes q/k
    conv); ``nc``: chunks of a block, streamed one ahead."""
    monkeypatch.setattr(K, "v_split", lambda R, H, D, Q=1: (nv, D // nv // nc))
    x = inputs(R, q, H, D, seed=R * 10 + q)
    if dtype == torch.float32:
        x = {k: (v.float() if k in ("mixed_qkv", "f_a", "f_b_weight", "g2", "beta", "norm_weight", "conv_state")
                 else v) for k, v in x.items()}
    want_conv, want_rec = x["conv_state"].clone(), x["recurrent_state"].clone()
    want = K.reference(**{**x, "conv_state": want_conv, "recurrent_state": want_rec})
    dev = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in x.items()}
    got = torch.ops.kimi_kernels.kda_decode(**dev)
    if nv > 1:
        assert not K.arrival_counters(got.device, R * H).any()  # reset for the next call
    # The bf16 rounding points are the reference's; only fp32 summation order differs,
    # which now and then moves a value across a bf16 rounding boundary (a g1 ulp moves the
    # gate by up to 5 exp(A_log) / 4 ulps): hence 1e-2 on outputs, 1e-3 on states.
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(dev["conv_state"].cpu(), want_conv)
    torch.testing.assert_close(dev["recurrent_state"].cpu(), want_rec, atol=1e-3, rtol=1e-3)
    live = x["state_slots"][:, 0] > 0
    assert got.view(R, q, -1)[~live.to(got.device)].abs().max() == 0 if (~live).any() else True


@pytest.mark.parametrize("H, D", SHAPES)
def test_states_as_views_of_one_page_per_slot(H, D):
    """vLLM binds a KDA layer's conv and recurrent states as bf16 / fp32 views of one int8
    page per slot (slot stride = the page, not the state): ``kda_decode_paged`` reads and
    writes them there (the kernel addresses states by slot stride), and leaves the rest
    of each page alone."""
    R, q = 3, 1
    x = inputs(R, q, H, D, seed=7)
    conv, rec = x["conv_state"], x["recurrent_state"]
    conv_bytes, rec_bytes = conv[0].numel() * 2, rec[0].numel() * 4
    page = torch.randint(-128, 128, (conv.shape[0], conv_bytes + rec_bytes + 64), dtype=torch.int8)
    page_conv = page[:, :conv_bytes].view(torch.bfloat16).view(conv.shape)
    page_rec = page[:, conv_bytes:conv_bytes + rec_bytes].view(torch.float32).view(rec.shape)
    page_conv.copy_(conv)
    page_rec.copy_(rec)
    want_conv, want_rec = conv.clone(), rec.clone()
    want = K.reference(**{**x, "conv_state": want_conv, "recurrent_state": want_rec})
    page = page.to(DEVICE)
    tail = page[:, conv_bytes + rec_bytes:].clone()
    dev = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in x.items()
           if k not in ("conv_state", "recurrent_state")}
    got = torch.ops.kimi_kernels.kda_decode_paged(**dev, page=page, conv_start=0, state_len=conv.shape[1],
                                                  rec_start=conv_bytes)
    dev_conv, dev_rec = K.page_states(page, 0, conv.shape[1], conv.shape[2], torch.bfloat16, conv_bytes, H, D)
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(dev_conv.cpu(), want_conv)
    torch.testing.assert_close(dev_rec.cpu(), want_rec, atol=1e-3, rtol=1e-3)
    assert torch.equal(page[:, conv_bytes + rec_bytes:], tail)


@pytest.mark.parametrize("H, D", SHAPES)
def test_native_decode_weights(H, D):
    """vLLM's native-decode weights (the conv weight as [3, W, P], seen here transposed to
    [3, P, W]; the norm weight in fp32) give what stock's layout gives, bit for bit."""
    R, q = 3, 1
    x = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs(R, q, H, D, seed=11).items()}
    native = dict(conv_weight=x["conv_weight"].view(3, H * D, 4).transpose(1, 2).contiguous().transpose(1, 2),
                  norm_weight=x["norm_weight"].float())
    runs = []
    for weights in ({}, native):
        y = {**x, **weights, "conv_state": x["conv_state"].clone(), "recurrent_state": x["recurrent_state"].clone()}
        runs.append((torch.ops.kimi_kernels.kda_decode(**y), y["conv_state"], y["recurrent_state"]))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_v_split_streams_chunks_between_one_and_three_programs_an_sm(monkeypatch):
    """One-token steps stream ``CHUNK`` rows (``KIMI_INDUCTOR_KDA_CHUNK``) where the
    programs outnumber the SMs but fit three an SM; whole blocks elsewhere; V split in 4
    while the split programs leave SMs idle."""
    monkeypatch.setenv("KIMI_INDUCTOR_KDA_CHUNK", "32")
    one, three = K.SMS // 12, 3 * K.SMS // 12  # requests of 12 heads
    assert K.v_split(1, 12, 128) == (4, 32)
    assert [K.v_split(R, 12, 128)[1] for R in (one, one + 1, three, three + 1)] == [128, 32, 32, 128]
    assert K.v_split(one + 1, 12, 128, Q=4) == (1, 128)
    monkeypatch.setenv("KIMI_INDUCTOR_KDA_CHUNK", "0")
    assert K.v_split(one + 1, 12, 128) == (1, 128)
    for bad in ("48", "256", "-32", "x"):
        monkeypatch.setenv("KIMI_INDUCTOR_KDA_CHUNK", bad)
        with pytest.raises(ValueError, match="KIMI_INDUCTOR_KDA_CHUNK"):
            K.v_split(one + 1, 12, 128)
