"""Each stock op against an independent, loop-by-loop formula (bf16 inputs, fp32 math)."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import kimi_inductor.stock  # noqa: F401  (registers the kimi:: ops)
from kimi_inductor.stock.mxfp4 import E2M1, mxfp4_dequantize, mxfp4_quantize
from kimi_inductor.stock.moe import select_experts

bf16 = torch.bfloat16


def rand(*shape, dtype=bf16, scale=1.0, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else hash(shape) % 2**31)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


# ---------------------------------------------------------------- AttnRes
def attn_res_naive(prefix, delta, bank, nw, qw, onw, n, write, eps, oeps):
    R, H = prefix.shape
    outs, new_prefix, new_bank = [], prefix.clone(), bank.clone()
    for r in range(R):
        p = prefix[r].float()
        if delta is not None:
            p = (p + delta[r].float()).to(bf16).float()
            new_prefix[r] = p.to(bf16)
        if write >= 0:
            new_bank[r, write] = p.to(bf16)
        sources = [new_bank[r, j].float() for j in range(n)] + [p]
        logits = torch.tensor([
            sum(float(s[d]) * float(nw[d]) * float(qw[d]) for d in range(H)) / math.sqrt(float((s * s).mean()) + eps)
            for s in sources])
        a = torch.softmax(logits, 0)
        mixed = sum(float(a[j]) * sources[j] for j in range(len(sources)))
        if onw is not None:
            mixed = mixed / math.sqrt(float((mixed * mixed).mean()) + oeps) * onw.float()
        outs.append(mixed.to(bf16))
    return torch.stack(outs), new_prefix, new_bank


@pytest.mark.parametrize("with_delta, n, write, out_norm", [
    (False, 0, 0, True), (True, 1, -1, True), (True, 2, 2, True), (True, 3, -1, False), (False, 2, -1, True)])
def test_attn_res_matches_its_definition(with_delta, n, write, out_norm):
    R, NB, H = 3, 3, 16
    prefix, bank = rand(R, H, seed=1), rand(R, NB, H, seed=2)
    delta = rand(R, H, seed=3) if with_delta else None
    nw, qw, onw = rand(H, seed=4) + 1, rand(H, seed=5, scale=0.5), (rand(H, seed=6) if out_norm else None)
    want = attn_res_naive(prefix, delta, bank, nw, qw, onw, n, write, 1e-5, 1e-5)
    p, b = prefix.clone(), bank.clone()
    got = torch.ops.kimi.attn_res(p, delta, b, nw, qw, onw, n, write, 1e-5, 1e-5)
    torch.testing.assert_close(got.float(), want[0].float(), atol=2e-2, rtol=1e-2)
    assert torch.equal(p, want[1]) and torch.equal(b, want[2])


# ---------------------------------------------------------------- KDA
def kda_naive(history, tokens, g1, g2, beta, w, A_log, dt_bias, norm_w, S, lb, H, D):
    """One request, token by token. history [3, 3P] raw inputs, tokens [n, 3P]."""
    hist, outs, states = [h for h in history.float()], [], []
    S = S.clone().float()
    P = H * D
    for t in range(tokens.shape[0]):
        hist.append(tokens[t].float())
        window = torch.stack(hist[-4:])  # oldest -> newest, the current token last
        y = F.silu((window.t() * w).sum(1)).to(bf16).float()
        o = torch.zeros(P)
        for h in range(H):
            sl = slice(h * D, (h + 1) * D)
            q, k, v = y[sl], y[P + h * D: P + (h + 1) * D], y[2 * P + h * D: 2 * P + (h + 1) * D]
            q = q / math.sqrt(float((q * q).sum()) + 1e-6) / math.sqrt(D)
            k = k / math.sqrt(float((k * k).sum()) + 1e-6)
            g = lb * torch.sigmoid(math.exp(float(A_log[h])) * (g1[t, sl].float() + dt_bias[sl]))
            b = torch.sigmoid(beta[t, h].float())
            Sh = S[h] * torch.exp(g)[None, :]
            u = b * (v - Sh @ k)
            Sh = Sh + torch.outer(u, k)
            S[h] = Sh
            o[sl] = Sh @ q
        o = o.to(bf16).float().view(H, D)
        o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + 1e-5) * norm_w.float()
        o = o * torch.sigmoid(g2[t].float().view(H, D))
        outs.append(o.reshape(P).to(bf16))
        states.append(S.clone())
    return torch.stack(outs), states, torch.stack(hist).to(bf16)


def kda_inputs(n_tok, H=2, D=8, seed=0):
    P = H * D
    return dict(
        mixed_qkv=rand(n_tok, 3 * P, seed=seed), g1=rand(n_tok, P, seed=seed + 1),
        g2=rand(n_tok, P, seed=seed + 2), beta=rand(n_tok, H, seed=seed + 3),
        conv_weight=rand(3 * P, 1, 4, dtype=torch.float32, seed=7, scale=0.5),
        A_log=torch.log(torch.rand(H, generator=torch.Generator().manual_seed(8)) * 15 + 1),
        dt_bias=rand(P, dtype=torch.float32, seed=9, scale=0.5), norm_weight=rand(D, seed=10) + 1)


@pytest.mark.parametrize("q", [1, 4])
def test_kda_verify_step_matches_token_by_token(q):
    H, D, R = 2, 8, 3
    P = H * D
    x = kda_inputs(R * q, H, D)
    slots = torch.tensor([[1 + r * q + t for t in range(q)] for r in range(R)], dtype=torch.int32)
    slots[1] = 0  # request 1 is padding
    accepted = torch.tensor([q, 1, max(1, q - 1)], dtype=torch.int32)
    conv = rand(1 + R * q, 2 + q, 3 * P, seed=20)
    rec = rand(1 + R * q, H, D, D, dtype=torch.float32, seed=21, scale=0.3)
    conv0, rec0 = conv.clone(), rec.clone()
    out = torch.ops.kimi.kda_decode(
        x["mixed_qkv"], x["g1"], x["g2"], x["beta"], x["conv_weight"], x["A_log"], x["dt_bias"],
        x["norm_weight"], conv, rec, slots, accepted, -5.0, 1e-5)
    w = x["conv_weight"].view(3 * P, 4)
    for r in range(R):
        rows = slice(r * q, (r + 1) * q)
        if r == 1:
            assert out[rows].abs().max() == 0, "padding request must output zeros"
            assert torch.equal(conv[slots[r, 0]], conv0[slots[r, 0]])
            continue
        a = int(accepted[r])
        history = conv0[slots[r, 0], a - 1: a + 2]
        start = rec0[slots[r, a - 1]]
        want, states, hist = kda_naive(history, x["mixed_qkv"][rows], x["g1"][rows], x["g2"][rows],
                                       x["beta"][rows], w, x["A_log"], x["dt_bias"], x["norm_weight"],
                                       start, -5.0, H, D)
        torch.testing.assert_close(out[rows].float(), want.float(), atol=2e-2, rtol=2e-2)
        for t in range(q):  # the state after token t lands in slot t
            torch.testing.assert_close(rec[slots[r, t]], states[t], atol=1e-4, rtol=1e-4)
        assert torch.equal(conv[slots[r, 0]], hist[-(2 + q):])  # window[1:] + new inputs


def test_kda_next_step_resumes_from_the_accepted_token():
    """After a 4-token verify with 2 accepted, the next step continues from token 1's
    state and conv window: equal to decoding tokens 0, 1 and then the new ones."""
    H, D, q = 2, 8, 4
    P = H * D
    first, second = kda_inputs(q, H, D, seed=30), kda_inputs(q, H, D, seed=40)
    slots = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
    conv = torch.zeros(5, 2 + q, 3 * P, dtype=bf16)
    rec = torch.zeros(5, H, D, D)
    args = lambda x: (x["mixed_qkv"], x["g1"], x["g2"], x["beta"], x["conv_weight"], x["A_log"],
                      x["dt_bias"], x["norm_weight"])
    torch.ops.kimi.kda_decode(*args(first), conv, rec, slots, torch.tensor([1], dtype=torch.int32), -5.0, 1e-5)
    out = torch.ops.kimi.kda_decode(*args(second), conv, rec, slots, torch.tensor([2], dtype=torch.int32), -5.0, 1e-5)
    both = {k: torch.cat([first[k][:2], second[k]]) if first[k].shape[0] == q else first[k] for k in first}
    want, _, _ = kda_naive(torch.zeros(3, 3 * P, dtype=bf16), both["mixed_qkv"], both["g1"], both["g2"],
                           both["beta"], first["conv_weight"].view(3 * P, 4), first["A_log"], first["dt_bias"],
                           first["norm_weight"], torch.zeros(H, D, D), -5.0, H, D)
    torch.testing.assert_close(out.float(), want[2:].float(), atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------- MLA / DSA
def paged_cache(R, ctx, block, d, seed):
    nb = -(-max(ctx) // block)
    cache = rand(1 + R * nb, block, d, seed=seed)
    table = torch.tensor([[1 + r * nb + i for i in range(nb)] for r in range(R)], dtype=torch.int32)
    return cache, table


def context_rows(cache, table, r, n):
    block = cache.shape[1]
    return torch.stack([cache[table[r, p // block], p % block] for p in range(n)])


@pytest.mark.parametrize("q", [1, 3])
def test_mla_matches_dense_softmax_attention(q):
    R, N, L, Rd, block = 3, 2, 16, 4, 4
    ctx = [5, 9, 0]  # the third request is padding
    cache, table = paged_cache(R, [c + q for c in ctx], block, L + Rd, seed=50)
    seq_lens = torch.tensor([c + q if c or r < 2 else 0 for r, c in enumerate(ctx)], dtype=torch.int32)
    slot_mapping = torch.full((R * q,), -1, dtype=torch.int64)
    for r in range(2):
        for j in range(q):
            p = ctx[r] + j
            slot_mapping[r * q + j] = int(table[r, p // block]) * block + p % block
    ql, qpe = rand(R * q, N, L, seed=51), rand(R * q, N, Rd, seed=52)
    kv_c, k_pe = rand(R * q, L, seed=53), rand(R * q, Rd, seed=54)
    scale = 24**-0.5
    out = torch.ops.kimi.mla_decode(ql, qpe, kv_c, k_pe, cache, slot_mapping, table, seq_lens, scale)
    for r in range(R):
        n = int(seq_lens[r])
        if n == 0:
            assert out[r * q:(r + 1) * q].abs().max() == 0
            continue
        rows = context_rows(cache, table, r, n).float()
        assert torch.equal(rows[-q:], torch.cat([kv_c, k_pe], -1)[r * q:(r + 1) * q].float())
        for j in range(q):
            t = r * q + j
            for h in range(N):
                query = torch.cat([ql[t, h], qpe[t, h]]).float()
                visible = rows[: n - q + j + 1]
                p = torch.softmax(visible @ query * scale, 0)
                want = p @ visible[:, :L]
                torch.testing.assert_close(out[t, h].float(), want, atol=1e-2, rtol=1e-2)


def test_dsa_is_mla_over_the_brute_force_top_k():
    R, q, N, L, Rd, block, n_idx, d_idx, topk = 2, 2, 2, 16, 4, 4, 3, 8, 5
    ctx = [9, 3]  # request 1 sees fewer than topk positions: it keeps them all
    cache, table = paged_cache(R, [c + q for c in ctx], block, L + Rd, seed=60)
    index_cache = rand(*cache.shape[:2], d_idx, seed=61)
    seq_lens = torch.tensor([c + q for c in ctx], dtype=torch.int32)
    slot_mapping = torch.tensor([int(table[r, (ctx[r] + j) // block]) * block + (ctx[r] + j) % block
                                 for r in range(R) for j in range(q)])
    ql, qpe = rand(R * q, N, L, seed=62), rand(R * q, N, Rd, seed=63)
    kv_c, k_pe = rand(R * q, L, seed=64), rand(R * q, Rd, seed=65)
    iq, ik = rand(R * q, n_idx, d_idx, seed=66), rand(R * q, d_idx, seed=67)
    iw = rand(R * q, n_idx, dtype=torch.float32, seed=68)
    scale = 24**-0.5
    out = torch.ops.kimi.dsa_decode(ql, qpe, kv_c, k_pe, iq, ik, iw, cache, index_cache, slot_mapping,
                                    table, seq_lens, topk, scale)
    for r in range(R):
        n = int(seq_lens[r])
        rows = context_rows(cache, table, r, n).float()
        keys = context_rows(index_cache, table, r, n).float()
        for j in range(q):
            t, visible = r * q + j, n - q + j + 1
            score = torch.tensor([sum(float(iw[t, h]) * max(0.0, float(iq[t, h].float() @ keys[s]))
                                      for h in range(n_idx)) for s in range(visible)])
            for h in range(N):
                query = torch.cat([ql[t, h], qpe[t, h]]).float()
                found = None
                # brute force: every top-k set of the naive scores (ties admit several)
                order = torch.argsort(score, descending=True, stable=True)
                k = min(topk, visible)
                kth = score[order[k - 1]]
                sure = [int(s) for s in order if score[s] > kth + 1e-6]
                tied = [int(s) for s in order if abs(score[s] - kth) <= 1e-6]
                for extra in itertools.combinations(tied, k - len(sure)):
                    keep = sorted(sure + list(extra))
                    p = torch.softmax(rows[keep] @ query * scale, 0)
                    if torch.allclose(out[t, h].float(), p @ rows[keep][:, :L], atol=1e-2, rtol=1e-2):
                        found = keep
                        break
                assert found is not None, f"token {t} head {h}: no top-{k} set reproduces the output"


# ---------------------------------------------------------------- MoE
def test_router_matches_brute_force():
    logits = rand(6, 8, dtype=torch.float32, seed=70, scale=2)
    bias = rand(8, dtype=torch.float32, seed=71, scale=0.3)
    weights, ids = select_experts(logits, bias, 3, True, 2.5)
    for r in range(6):
        scores = torch.sigmoid(logits[r])
        order = sorted(range(8), key=lambda e: -(float(scores[e]) + float(bias[e])))[:3]
        assert sorted(ids[r].tolist()) == sorted(order)
        total = sum(float(scores[e]) for e in order)
        for k, e in enumerate(ids[r].tolist()):
            assert math.isclose(float(weights[r, k]), float(scores[e]) / total * 2.5, rel_tol=1e-6)


def situ(g, u):
    return 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)


def test_fused_experts_matches_a_per_token_loop():
    T, E, k, Lt, I = 5, 4, 2, 16, 8
    latent = rand(T, Lt, seed=80)
    w13, w2 = rand(E, 2 * I, Lt, seed=81, scale=0.3), rand(E, Lt, I, seed=82, scale=0.3)
    weights = torch.rand(T, k, generator=torch.Generator().manual_seed(83))
    ids = torch.tensor([[0, 1], [1, 3], [3, 0], [2, 2 - 2], [1, 2]], dtype=torch.int32)
    out = torch.ops.kimi.fused_experts(latent, weights, ids, w13, w2, 4.0, 25.0)
    for t in range(T):
        want = torch.zeros(Lt)
        for j in range(k):
            e = int(ids[t, j])
            h = (w13[e].float() @ latent[t].float()).to(bf16).float()
            a = situ(h[:I], h[I:]).to(bf16).float()
            want += float(weights[t, j]) * (w2[e].float() @ a).to(bf16).float()
        torch.testing.assert_close(out[t].float(), want, atol=2e-2, rtol=2e-2)


def test_mxfp4_round_trip():
    g = torch.Generator().manual_seed(90)
    codes = torch.randint(0, 8, (4, 64), generator=g)
    signs = torch.randint(0, 2, (4, 64), generator=g) * 2 - 1
    exps = torch.randint(-3, 3, (4, 2), generator=g).repeat_interleave(32, 1)
    exact = (E2M1[codes] * signs * torch.exp2(exps.float())).to(bf16)
    exact[:, ::32] = (6 * torch.exp2(exps[:, ::32].float())).to(bf16)  # every group reaches its max
    packed, scales = mxfp4_quantize(exact)
    assert packed.dtype == torch.uint8 and packed.shape == (4, 32) and scales.shape == (4, 2)
    assert torch.equal(mxfp4_dequantize(packed, scales), exact)
    w = rand(8, 64, seed=91)
    back = mxfp4_dequantize(*mxfp4_quantize(w)).float()
    group_max = w.float().abs().view(8, 2, 32).amax(-1).repeat_interleave(32, 1)
    # scale 2^e <= amax / 3 and E2M1 steps are at most 2: error <= one scale unit
    assert ((back - w.float()).abs() <= group_max / 3 + 1e-6).all()


# ---------------------------------------------------------------- q bounds
def _q_cases(q, R=2, H=2, D=8, N=2, L=16, Rd=4, block=4, nb=6, n_idx=3, d_idx=8):
    """(op name, call) for every op that takes a step's q tokens per request."""
    import kimi_inductor.kernels  # noqa: F401  (registers kimi_kernels::)

    T, P = R * q, H * D
    x = kda_inputs(T, H, D)
    kda = (x["mixed_qkv"], x["g1"], x["g2"], x["beta"], x["conv_weight"], x["A_log"], x["dt_bias"],
           x["norm_weight"], rand(1 + T, 2 + q, 3 * P), rand(1 + T, H, D, D, dtype=torch.float32),
           (1 + torch.arange(T)).view(R, q).int(), torch.ones(R, dtype=torch.int32), -5.0, 1e-5)
    kernel_kda = (kda[0], rand(T, D), rand(P, D)) + kda[2:]  # f_a, f_b_proj weight instead of g1
    table = (1 + torch.arange(R * nb)).view(R, nb).int()
    seq_lens = torch.full((R,), q, dtype=torch.int32)
    slots = (table[:, :1].long() * block + torch.arange(q)).view(-1) if q else torch.zeros(0, dtype=torch.int64)
    cache, index_cache = rand(1 + R * nb, block, L + Rd), rand(1 + R * nb, block, d_idx)
    ql, qpe, kv_c, k_pe = rand(T, N, L), rand(T, N, Rd), rand(T, L), rand(T, Rd)
    iq, ik, iw = rand(T, n_idx, d_idx), rand(T, d_idx), rand(T, n_idx, dtype=torch.float32)
    mla = (ql, qpe, kv_c, k_pe, cache, slots, table, seq_lens, 0.2)
    dcp = (ql, qpe, kv_c, k_pe, cache, slots, table, seq_lens, None, 0, 1, 0.2)
    dsa = (ql, qpe, kv_c, k_pe, iq, ik, iw, cache, index_cache, slots, table, seq_lens, 4, 0.2)
    ops = torch.ops
    return [
        ("kimi::kda_decode", lambda: ops.kimi.kda_decode(*kda)),
        ("kimi_kernels::kda_decode", lambda: ops.kimi_kernels.kda_decode(*kernel_kda)),
        ("kimi::mla_decode", lambda: ops.kimi.mla_decode(*mla)),
        ("kimi_kernels::mla_decode", lambda: ops.kimi_kernels.mla_decode(*mla)),
        ("kimi::mla_decode_dcp", lambda: ops.kimi.mla_decode_dcp(*dcp)),
        ("kimi_kernels::mla_decode_dcp", lambda: ops.kimi_kernels.mla_decode_dcp(*dcp)),
        ("kimi::dsa_decode", lambda: ops.kimi.dsa_decode(*dsa)),
        ("kimi_kernels::dsa_decode", lambda: ops.kimi_kernels.dsa_decode(*dsa)),
        ("kimi::dsa_index_dcp", lambda: ops.kimi.dsa_index_dcp(iq, ik, iw, index_cache, slots, table, seq_lens,
                                                              0, 1)),
        ("kimi_kernels::dsa_select", lambda: ops.kimi_kernels.dsa_select(iq, iw, index_cache, table, seq_lens, 4)),
    ], (kda, cache, index_cache)


@pytest.mark.parametrize("q", [0, 9, 16])
def test_every_op_refuses_q_outside_1_to_8(q):
    """q = 1 + speculative tokens is at most 8: the fused KDA kernel pads the gate rows
    to 16 (tokens 16+ got a zero gate), so every op refuses more, eagerly and when
    traced (fake tensors), before touching a cache."""
    cases, (kda, cache, index_cache) = _q_cases(q)
    before = [t.clone() for t in (kda[8], kda[9], cache, index_cache)]
    for name, call in cases:
        with pytest.raises(ValueError, match=rf"{name}: q = {q} tokens per request is outside 1\.\.8"):
            call()
        with torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True), \
                pytest.raises(ValueError, match=rf"{name}: q = {q}"):
            call()
    assert all(torch.equal(a, b) for a, b in zip(before, (kda[8], kda[9], cache, index_cache)))


def test_ops_accept_q_8():
    cases, _ = _q_cases(8)
    for name, call in cases:
        call()
