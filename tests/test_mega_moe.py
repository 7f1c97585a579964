"""mega_moe: the MoE routing pass and its ops, against stock's expert-parallel MoE.

The op on 2 and 4 gloo ranks equals stock ``kimi::ep_experts`` (bitwise at G = 2, where
a reduce-scatter and an all-reduce add the same two partials) with padding rows, rows
whose experts all live on other ranks, experts that get no row, and the overflow error.
Whole-stack numerics of the routed decoder (all passes) are in test_hybrid_attention.py;
the TP layout's grouped experts are checked here.
"""

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline
from helpers import compile_tiny

from kimi_inductor.harness import DecodeRun, decode_many
from kimi_inductor.launch import run_ranks
from kimi_inductor.passes.snapshot import region_text
from kimi_inductor.stock import KimiK3Config

LOCAL, LATENT, WIDTH, TOP_K, ROWS = 3, 64, 32, 3, 5


def _expert_parallel_case():
    """Every rank's view of one MoE call; returns (stock, ours, overflow message)."""
    group = dist.group.WORLD
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(7)
    experts = LOCAL * world
    latent = torch.randn(world * ROWS, LATENT, generator=g).bfloat16()
    weights = torch.rand(world * ROWS, TOP_K, generator=g)
    unused = 1  # an expert that gets no row
    ids = torch.stack([torch.randperm(experts, generator=g)[:TOP_K + 1] for _ in range(world * ROWS)])
    ids = torch.stack([row[row != unused][:TOP_K] for row in ids]).int()
    ids[0] = torch.arange(experts - TOP_K, experts)  # rank 0's row 0: every expert on the last rank
    is_padding = torch.zeros(world * ROWS, dtype=torch.bool)
    is_padding[[2, world * ROWS - 1]] = True
    w13 = (torch.randn(experts, 2 * WIDTH, LATENT, generator=g) * 0.2).bfloat16()
    w2 = (torch.randn(experts, LATENT, WIDTH, generator=g) * 0.2).bfloat16()
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    local = slice(rank * LOCAL, (rank + 1) * LOCAL)
    args = (w13[local], w2[local], rank * LOCAL, group.group_name)
    stock = torch.ops.kimi.ep_experts(latent[mine], weights[mine], ids[mine], is_padding[mine], *args, 64, 4.0, 25.0)
    pad = is_padding[mine, None]
    routed = (latent[mine], weights[mine].masked_fill(pad, 0.0), ids[mine].masked_fill(pad, -1))
    ours = torch.ops.kimi_kernels.mega_moe(*routed, *args, 64, 4.0, 25.0)
    try:
        torch.ops.kimi_kernels.mega_moe(*routed, *args, ROWS - 1, 4.0, 25.0)
        overflow = ""
    except ValueError as e:
        overflow = str(e)
    return stock, ours, overflow


@pytest.mark.parametrize("world", [2, 4])
def test_op_equals_stock_expert_parallel_moe(world):
    results = run_ranks(_expert_parallel_case, world)
    for rank, (stock, ours, overflow) in enumerate(results):
        assert stock.abs().sum() > 0
        if world == 2:
            assert torch.equal(ours, stock), f"rank {rank}: max diff {(ours - stock).abs().max()}"
        else:  # the cross-rank fp32 sum may associate differently: at most one bf16 rounding apart
            torch.testing.assert_close(ours.float(), stock.float(), rtol=2 ** -7, atol=1e-6)
        assert f"mega_moe got {ROWS} tokens" in overflow and f"max_num_tokens={ROWS - 1}" in overflow
    assert not results[0][1][2].any()  # a padding row: not routed, zero
    assert not results[-1][1][-1].any()
    assert results[0][1][0].any()  # its experts all live on the last rank


def test_single_rank_op_is_the_expert_loop():
    from kimi_inductor.stock.moe import combine_experts

    g = torch.Generator().manual_seed(3)
    latent = torch.randn(6, LATENT, generator=g).bfloat16()
    weights = torch.rand(6, TOP_K, generator=g)
    ids = torch.randint(-1, LOCAL, (6, TOP_K), generator=g).int()
    w13 = (torch.randn(LOCAL, 2 * WIDTH, LATENT, generator=g) * 0.2).bfloat16()
    w2 = (torch.randn(LOCAL, LATENT, WIDTH, generator=g) * 0.2).bfloat16()
    out = torch.ops.kimi_kernels.mega_moe(latent, weights, ids, w13, w2, 0, "", 6, 4.0, 25.0)
    ref = combine_experts(latent, weights, ids, w13, w2, 0, 4.0, 25.0).bfloat16()
    assert torch.equal(out, ref)


def _routed(fake_world, layout, world=2):
    snaps = {}

    def observe(stage, gm):
        if stage == "after mega_moe":
            snaps["moe"] = region_text(gm, 2, "mlp")

    backend, _ = compile_tiny(layout=layout, group=fake_world(world), q=1, requests=2, padding=1, observer=observe,
                              options={"decode": {"sharded_moe_rows": 0}})  # the row shard: mega_moe's EP op
    return backend.report, snaps


def test_every_moe_layer_is_routed_through_mega_moe(fake_world):
    report, snaps = _routed(fake_world, "sp")
    moe = [l for l in report.layers if l.mlp == "moe"]
    assert moe and all(l.notes["moe"].startswith("mega_moe: EP exchange") for l in moe)
    assert all("reference" in l.notes["moe"] for l in moe)  # CPU
    assert all("moe" not in l.notes for l in report.layers if l.mlp == "dense")
    info = next(p for p in report.passes if p.name == "mega_moe")
    assert info.matched == info.rewritten == len(moe)
    L = len(report.layers)
    assert report.collectives_after == {"all_reduce": L + 1, "all_gather": len(moe), "reduce_scatter": 0}
    assert "kimi.ep_experts" not in snaps["moe"]


def test_tp_layout_runs_the_grouped_experts_without_an_exchange(fake_world):
    report, snaps = _routed(fake_world, "tp")
    moe = [l for l in report.layers if l.mlp == "moe"]
    assert moe and all(l.notes["moe"].startswith("expert_ffn: TP-sharded experts") for l in moe)
    assert "kimi_kernels.expert_ffn" in snaps["moe"] and "kimi.fused_experts" not in snaps["moe"]


def test_snapshot_routed_moe_g2(fake_world):
    """The MoE region of the hybrid graph after mega_moe (G = 2, T = 3: a pad row)."""
    assert_expected_inline(_routed(fake_world, "sp")[1]["moe"], """\
%in0 = kimi.attn_res(...)
%in1 = aten.permute(...)  : f32[128, 8]
%in2 = input  : f32[8]
%in3 = aten.permute(...)  : bf16[128, 128]
%in4 = aten.permute(...)  : bf16[64, 128]
%in5 = aten.permute(...)  : bf16[128, 64]
%in6 = aten.unsqueeze(...)  : b8[2, 1]
%in7 = aten.full(...)  : f32[]
%in8 = aten.full(...)  : i32[]
%in9 = input  : bf16[4, 64, 64]
%in10 = input  : bf16[4, 64, 32]
%in11 = input  : bf16[64]
%in12 = aten.permute(...)  : bf16[64, 128]
%0 = %in0[0]  : bf16[3, 128]
%1 = aten.constant_pad_nd(%0, [0, 0, 0, 1], 0)  : bf16[4, 128]
%2 = aten.slice(%1, 0, 0, 2)  : bf16[2, 128]
%3 = prims.convert_element_type(%2, f32)  : f32[2, 128]
%4 = aten.mm(%3, %in1)  : f32[2, 8]
%5 = aten.sigmoid(%4)  : f32[2, 8]
%6 = aten.add(%5, %in2)  : f32[2, 8]
%7 = aten.topk(%6, 2)
%8 = %7[1]  : i64[2, 2]
%9 = aten.mm(%2, %in3)  : bf16[2, 128]
%10 = aten.slice(%9, 1, 0, 64)  : bf16[2, 64]
%11 = prims.convert_element_type(%10, f32)  : f32[2, 64]
%12 = aten.div(%11, 4)  : f32[2, 64]
%13 = aten.tanh(%12)  : f32[2, 64]
%14 = aten.mul(%13, 4)  : f32[2, 64]
%15 = aten.sigmoid(%11)  : f32[2, 64]
%16 = aten.mul(%14, %15)  : f32[2, 64]
%17 = aten.slice(%9, 1, 64, 9223372036854775807)  : bf16[2, 64]
%18 = prims.convert_element_type(%17, f32)  : f32[2, 64]
%19 = aten.div(%18, 25)  : f32[2, 64]
%20 = aten.tanh(%19)  : f32[2, 64]
%21 = aten.mul(%20, 25)  : f32[2, 64]
%22 = aten.mul(%16, %21)  : f32[2, 64]
%23 = prims.convert_element_type(%22, bf16)  : bf16[2, 64]
%24 = aten.mm(%23, %in4)  : bf16[2, 128]
%25 = aten.mm(%2, %in5)  : bf16[2, 64]
%26 = aten.gather(%5, 1, %8)  : f32[2, 2]
%27 = aten.sum(%26, [-1], True)  : f32[2, 1]
%28 = aten.div(%26, %27)  : f32[2, 2]
%29 = aten.mul(%28, 1)  : f32[2, 2]
%30 = prims.convert_element_type(%8, i32)  : i32[2, 2]
%31 = aten.where(%in6, %in7, %29)  : f32[2, 2]
%32 = aten.where(%in6, %in8, %30)  : i32[2, 2]
%33 = kimi_kernels.mega_moe(%25, %31, %32, %in9, %in10, 0, '0', 8192, 4, 25)  : bf16[2, 64]
%34 = prims.convert_element_type(%33, f32)  : f32[2, 64]
%35 = aten.pow(%34, 2)  : f32[2, 64]
%36 = aten.mean(%35, [-1], True)  : f32[2, 1]
%37 = aten.add(%36, 1e-05)  : f32[2, 1]
%38 = aten.rsqrt(%37)  : f32[2, 1]
%39 = aten.mul(%34, %38)  : f32[2, 64]
%40 = prims.convert_element_type(%39, bf16)  : bf16[2, 64]
%41 = aten.mul(%40, %in11)  : bf16[2, 64]
%42 = aten.addmm(%24, %41, %in12)  : bf16[2, 128]
%43 = c10d.all_gather_into_tensor(%42, 2, '0')  : bf16[4, 128]
%44 = c10d.wait_tensor(%43)  : bf16[4, 128]
%45 = aten.slice(%44, 0, 0, 3)  : bf16[3, 128]""")


@pytest.mark.slow
def test_tp_layout_with_grouped_experts_equals_stock_for_16_steps():
    stock = DecodeRun(preset="tiny", layout="tp", q=4, requests=3, padding=1, steps=16)
    compiled = DecodeRun(**{**stock.__dict__, "backend": "kimi_specialized",
                            "options": {"compiler": "eager", "passes": ["mega_moe"]}})
    ref, out = run_ranks(decode_many, 2, [stock, compiled])[0]
    moe = KimiK3Config.preset("tiny").num_hidden_layers - 1
    assert sum(l["notes"].get("moe", "").startswith("expert_ffn") for l in out["report"]["layers"]) == moe
    assert torch.equal(out["outputs"], ref["outputs"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_mxfp4_experts_stay_packed_through_every_pass_and_equal_stock(world):
    """A checkpoint with MXFP4 experts, loaded packed: every pass rewrites every layer, the
    report names the MXFP4 experts, and the compiled decode equals stock's (whose ops
    dequantise) bitwise for 8 steps with a padding request, on 1, 2 and 4 gloo ranks
    (the MoE in the row shard; sharded MXFP4 layers: test_sharded_moe.py)."""
    stock = DecodeRun(preset="tiny", layout="sp", q=4, requests=3, padding=1, steps=8, experts="mxfp4")
    compiled = DecodeRun(**{**stock.__dict__, "backend": "kimi_specialized",
                            "options": {"compiler": "eager", "decode": {"sharded_moe_rows": 0}}})
    ref, out = run_ranks(decode_many, world, [stock, compiled])[0]
    moe = [l["notes"]["moe"] for l in out["report"]["layers"] if "moe" in l["notes"]]
    assert len(moe) == KimiK3Config.preset("tiny").num_hidden_layers - 1
    routed = "mega_moe: EP exchange" if world > 1 else "expert_ffn"  # one rank: experts whole, no exchange
    assert all(n.startswith(routed) and "MXFP4 experts" in n for n in moe), moe
    assert torch.equal(out["outputs"], ref["outputs"]), f"G={world}: max diff {(out['outputs'] - ref['outputs']).abs().max()}"


def test_mxfp4_experts_in_the_sm90_layout_compile_through_every_pass_and_equal_stock():
    """Experts reordered for the SM90 kernel (``build_model(mxfp4_layout='sm90')``, 5-D
    uint8) go through mega_moe on one CPU rank: every MoE layer is rewritten, the report
    names the layout's kernel and why the CPU takes the reference, and the compiled step
    equals the stock step on the experts as stored, bitwise."""
    import dataclasses

    from kimi_inductor.backend import KimiSpecialized
    from kimi_inductor.stock import Parallel
    from kimi_inductor.stock.batch import DecodeBatch
    from kimi_inductor.stock.checkpoint import build_model, random_checkpoint

    c = dataclasses.replace(KimiK3Config.preset("tiny"), routed_expert_hidden_size=256, moe_intermediate_size=256)
    tensors = random_checkpoint(c, seed=7, experts="mxfp4")
    stored = build_model(c, tensors, Parallel("sp", None), mxfp4_layout="checkpoint")
    sm90 = build_model(c, tensors, Parallel("sp", None), mxfp4_layout="sm90")
    batch = DecodeBatch(3, 2, 1, c.vocab_size)
    step = batch.step()
    backend = KimiSpecialized({"compiler": "eager", "decode": {"sharded_moe_rows": 0}})
    torch._dynamo.reset()
    with torch.no_grad():
        want = stored(step, stored.allocate_caches(batch.num_slots, batch.num_blocks, batch.block_size, batch.q))
        got = torch.compile(sm90, backend=backend)(
            step, sm90.allocate_caches(batch.num_slots, batch.num_blocks, batch.block_size, batch.q))
    moe = [l.notes["moe"] for l in backend.report.layers if "moe" in l.notes]
    assert len(moe) == c.num_hidden_layers - 1
    assert all("MXFP4 experts" in n and "SM90 MXFP4 expert kernel" in n and "needs an SM90+ GPU" in n
               for n in moe), moe
    assert torch.equal(got, want)
