"""Data parallelism (vLLM's ``-tp G -dp N --enable-expert-parallel``): N TP groups decode
their own rows and share the routed experts, partitioned over all N G ranks. The stock
replica's DP decode, and sharded_moe's DP form (each TP group's rows gathered from its
DP peers for the routed experts, the fp32 partials reduce-scattered back) against it.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from helpers import compile_tiny

from kimi_inductor.harness import DecodeRun, decode_many
from kimi_inductor.launch import run_ranks
from kimi_inductor.passes.sharded_moe import _dp_peers
from kimi_inductor.passes.snapshot import region_text
from kimi_inductor.stock import Parallel


def _dp_world(fake_world, dp=2, G=2, peers=True):
    """A fake world of dp x G ranks (this process rank 0): its TP group, and with
    ``peers`` each TP index's group of DP peers, as vLLM's DP group."""
    fake_world(dp * G)
    tp = [dist.new_group(list(range(d * G, (d + 1) * G))) for d in range(dp)]
    for t in range(G) if peers else ():
        dist.new_group(list(range(t, dp * G, G)))
    return tp[0]


def _compiled(group, **kw):
    snaps = {}

    def observe(stage, gm):
        if stage == "after sharded_moe":
            snaps["moe"] = region_text(gm, 2, "mlp")

    backend, _ = compile_tiny(group=group, q=1, requests=2, padding=1, observer=observe,
                              parallel_options={"ep_group": dist.group.WORLD}, **kw)
    return backend.report, snaps.get("moe", "")


def test_sharded_moe_gathers_the_dp_peers_rows_for_the_routed_experts(fake_world):
    report, moe_text = _compiled(_dp_world(fake_world))
    moe = [l for l in report.layers if l.mlp == "moe"]
    assert moe and all("sharded_moe" in l.rewritten_by for l in moe)
    assert all("data parallel: the rows of all 2 TP groups gathered" in l.notes["moe_layout"] for l in moe)
    # per MoE layer: one all-gather and one reduce-scatter over the peers, two all-reduces in the TP group
    assert report.collectives_after == {"all_reduce": len(report.layers) + 1 + 2 * len(moe),
                                        "all_gather": len(moe), "reduce_scatter": len(moe)}
    lines = moe_text.splitlines()
    gather = next(l for l in lines if "c10d.all_gather_into_tensor(" in l)
    ffn = next(l for l in lines if "kimi_kernels.expert_ffn(" in l)
    scatter = next(l for l in lines if "c10d.reduce_scatter_tensor(" in l)
    # T = 3 rows of both groups: latent (64) + weights (2) + global ids (2) in one fp32 message
    assert gather.endswith(": f32[6, 68]") and ffn.endswith(": f32[6, 64]") and scatter.endswith(": f32[3, 64]")
    assert lines.index(gather) < lines.index(ffn) < lines.index(scatter)
    peers_name = gather.split("'")[1]
    assert f"'{peers_name}')" in scatter and "kimi_kernels.mega_moe" not in moe_text
    # lower_kernels still runs the layer's projections in two launches (the latent reaches the experts via the gather)
    assert all("mlp: router + top-k + latent down + shared gate/up SiTU (one launch) x1, shared down + up "
               "(one GEMM) x1" in l.notes["kernels"] for l in moe), [l.notes["kernels"] for l in moe]


def test_without_the_dp_peers_group_or_with_interleaved_tp_groups_the_row_shard_is_kept(fake_world):
    """The pass finds the peers' group among the deployment's and makes none (the reason
    becomes the layer's ``moe_layout`` note: row shard kept)."""
    _dp_world(fake_world, peers=False)
    tp = dist.new_group([0, 1])  # the same ranks as _dp_world's TP group
    assert _dp_peers(dist.group.WORLD, tp) == ("data parallel: no process group of this rank's DP peers (global "
                                               "ranks [0, 2]) exists; create it before compiling (vLLM's DP group "
                                               "is it)")
    peers = dist.new_group([0, 2])
    assert _dp_peers(dist.group.WORLD, tp) is peers and _dp_peers(tp, tp) is None
    interleaved = dist.new_group([0, 2])  # EP ranks 0 and 1 are global 0 and 1: not this TP group
    assert _dp_peers(dist.group.WORLD, interleaved) == ("the experts' EP group (4 ranks, this rank 0) is not whole "
                                                        "TP groups of 2 one after another with this rank at d x 2 + "
                                                        "its TP rank 0")


def test_parallel_refuses_data_parallel_without_sp(fake_world):
    tp = _dp_world(fake_world)
    with pytest.raises(ValueError, match="needs the SP layout with TP > 1"):
        Parallel("tp", tp, ep_group=dist.group.WORLD)
    fake_world(4, rank=1)
    tp = dist.new_group([1, 2])  # rank 1 is TP rank 0 but EP rank 1
    with pytest.raises(ValueError, match=r"EP rank 1 of 4 is not d x 2 \+ its TP rank 0"):
        Parallel("sp", tp, ep_group=dist.group.WORLD)


@pytest.mark.slow
def test_dp_decode_agrees_with_stock_for_8_steps():
    """TP 2 x DP 2 on 4 gloo ranks, a padding request, 8 steps. Stock's DP replica 0
    decodes what TP 2 alone decodes, bitwise (its experts' fp32 partials sum over 4 ranks
    instead of 2: the same values, in bf16 here too; the first 4 steps compared);
    kimi_specialized with sharded_moe's DP form agrees with stock DP in fp32 to 1e-4 (the
    bf16 band of the same sums at DP 1: test_sharded_moe; the row shard over an EP group
    of 4, kimi_vllm.mega_moe's kernel: test_vllm_graph's DP test)."""
    run = DecodeRun(preset="tiny", layout="sp", q=1, requests=3, padding=1, steps=8, dp=2)
    fp32 = dataclasses.replace(run, dtype="float32")
    compiled = dataclasses.replace(fp32, backend="kimi_specialized", options={"compiler": "eager"})
    ranks = run_ranks(decode_many, 4, [fp32, compiled, dataclasses.replace(run, steps=4)])
    alone = run_ranks(decode_many, 2, [dataclasses.replace(run, dp=1, steps=4)])[0][0]["outputs"]
    assert torch.equal(ranks[0][2]["outputs"], alone)
    assert not torch.equal(ranks[2][2]["outputs"], alone)  # replica 1 decodes its own batch
    for rank in (0, 2):
        ref32, out32 = (r["outputs"] for r in ranks[rank][:2])
        assert all("sharded_moe" in l["rewritten_by"] for l in ranks[rank][1]["report"]["layers"]
                   if l["mlp"] == "moe")
        rel = ((out32 - ref32).norm(dim=-1) / ref32.norm(dim=-1)).max()
        assert rel < 1e-4, f"rank {rank}: fp32 relative error {rel:.2e}"
