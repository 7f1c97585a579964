"""Decode context parallelism (DCP = G): the stock decoder's sharded latent cache, and
the passes over it.

DCP = G must compute what DCP = 1 computes: fp32 trajectories within 1e-4 over 16 steps
(contexts grow by 1..q per step from 0, so they rarely divide by G), for MLA (K3) and
DSA (K3.1, whose top-k spans every rank's positions), q = 1 and 4, padding requests.
kimi_specialized over a DCP decoder equals stock DCP bitwise (eager compiler, bf16);
the DSA layers' DCP core takes the MLA path too, so K3.1 covers both.
"""

import dataclasses

import pytest
import torch
from expecttest import assert_expected_inline
from helpers import compile_tiny

from kimi_inductor.harness import DecodeRun, decode_many
from kimi_inductor.launch import run_ranks
from kimi_inductor.passes.snapshot import region_text
from kimi_inductor.stock import Parallel
from kimi_inductor.stock.dcp import context_positions, local_slots


def test_cache_layout_interleaves_positions_over_ranks():
    # virtual blocks of 4 positions over 2 ranks (2 rows each); blocks 3 and 5 of the table
    slots = torch.tensor([3 * 4 + 0, 3 * 4 + 1, 3 * 4 + 3, 5 * 4 + 2, -1])
    assert local_slots(slots, 2, rank=0, size=2).tolist() == [6, -1, -1, 11, -1]
    assert local_slots(slots, 2, rank=1, size=2).tolist() == [-1, 6, 7, -1, -1]
    # a rank's context index i of a request -> global position
    assert context_positions(6, 2, rank=1, size=2, device="cpu").tolist() == [1, 3, 5, 7, 9, 11]


def test_dcp_must_span_the_tp_group(fake_world):
    with pytest.raises(ValueError, match="must be 1 or the TP size 2"):
        Parallel("tp", fake_world(2), dcp=4)


def _runs(world):
    """Each G: both presets and q = 1 and 4 (crossed differently at G = 2 and 4, for time);
    at G = 2 also the compiled DSA (DCP selection path) decoder against stock."""
    pairs = [("tiny", 1), ("tiny-k3.1", 4)] if world == 2 else [("tiny", 4), ("tiny-k3.1", 1)]
    cases = []
    for preset, q in pairs:
        base = DecodeRun(preset=preset, layout="sp", q=q, requests=3, padding=1, steps=16, dtype="float32")
        cases.append((base, dataclasses.replace(base, dcp=world), "fp32"))
    if world == 2:
        stock = DecodeRun(preset="tiny-k3.1", layout="sp", q=4, requests=3, padding=1, steps=16, dcp=2)
        row_shard = {"compiler": "eager", "decode": {"sharded_moe_rows": 0}}  # bitwise: MoE in the row shard
        cases.append((stock, dataclasses.replace(stock, backend="kimi_specialized", options=row_shard), "bitwise"))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_dcp_decode_equals_unsharded_and_compiles_to_the_same(world):
    cases = _runs(world)
    results = run_ranks(decode_many, world, [r for a, b, _ in cases for r in (a, b)])[0]
    for i, (a, b, check) in enumerate(cases):
        ref, out = results[2 * i]["outputs"], results[2 * i + 1]["outputs"]
        what = f"{a.preset} q={a.q} G={world}"
        if check == "fp32":
            rel = ((out - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)).max()
            assert rel < 1e-4, f"{what}: DCP vs unsharded, fp32 relative error {rel:.2e}"
        else:
            report = results[2 * i + 1]["report"]
            assert all(l["rewritten"] for l in report["layers"])
            assert all(("dcp" in l["notes"]) == (l["kind"] != "kda") for l in report["layers"])
            assert torch.equal(out, ref), f"{what}: compiled vs stock DCP, max diff {(out - ref).abs().max()}"


def test_report_names_dcp_and_the_snapshot_of_a_dcp_mla_layer(fake_world):
    snaps = {}

    def observe(stage, gm):
        if stage == "after hybrid_attention":
            snaps["mla"] = region_text(gm, 3, "attention")

    from kimi_inductor.stock import KimiK3Config

    backend, _ = compile_tiny(group=fake_world(2), q=1, requests=2, padding=1, observer=observe,
                              parallel_options={"dcp": 2})
    report = backend.report
    kinds = [KimiK3Config.preset("tiny").layer_kind(i) for i in range(len(report.layers))]
    assert [l.kind for l in report.layers] == kinds and all(l.rewritten for l in report.layers)
    for layer in report.layers:
        assert ("DCP 2" in layer.notes.get("dcp", "")) == (layer.kind == "mla")
        if layer.kind == "mla":  # lower_kernels takes the DCP core too
            assert "MLA core x1" in layer.notes["kernels"]
    assert_expected_inline(snaps["mla"], """\
%in0 = aten.slice(...)  : bf16[3, 128]
%in1 = input  : bf16[128]
%in2 = aten.select(...)  : bf16[128]
%in3 = input  : bf16[128]
%in4 = getitem  : bf16[3, 128]
%in5 = getitem  : bf16[3, 3, 128]
%in6 = aten.permute(...)  : bf16[128, 152]
%in7 = input  : bf16[48]
%in8 = aten.permute(...)  : bf16[48, 96]
%in9 = aten.slice(...)  : bf16[4, 16, 32]
%in10 = input  : bf16[32]
%in11 = input  : i64[3]
%in12 = input  : i32[3, 64]
%in13 = input  : i32[3]
%in14 = input  : bf16[129, 2, 40]
%in15 = aten.full(...)  : f32[]
%in16 = aten.full(...)  : f32[]
%in17 = aten.permute(...)  : bf16[4, 32, 16]
%in18 = aten.permute(...)  : bf16[64, 128]
%0 = auto_functionalized_v2[kimi.attn_res](delta=%in0, norm_weight=%in1, qk_weight=%in2, output_norm_weight=%in3, num_blocks=1, block_write_idx=-1, eps=1e-05, output_norm_eps=1e-05, _prefix_base_index=0, _bank_base_index=1, _all_bases=[%in4, %in5])
%1 = %0[0]  : bf16[3, 128]
%2 = aten.mm(%1, %in6)  : bf16[3, 152]
%3 = aten.split_with_sizes(%2, [88, 64], -1)
%4 = %3[0]  : bf16[3, 88]
%5 = %3[1]  : bf16[3, 64]
%6 = aten.split_with_sizes(%4, [48, 32, 8], -1)
%7 = %6[0]  : bf16[3, 48]
%8 = %6[1]  : bf16[3, 32]
%9 = %6[2]  : bf16[3, 8]
%10 = prims.convert_element_type(%7, f32)  : f32[3, 48]
%11 = aten.pow(%10, 2)  : f32[3, 48]
%12 = aten.mean(%11, [-1], True)  : f32[3, 1]
%13 = aten.add(%12, 1e-05)  : f32[3, 1]
%14 = aten.rsqrt(%13)  : f32[3, 1]
%15 = aten.mul(%10, %14)  : f32[3, 48]
%16 = prims.convert_element_type(%15, bf16)  : bf16[3, 48]
%17 = aten.mul(%16, %in7)  : bf16[3, 48]
%18 = aten.mm(%17, %in8)  : bf16[3, 96]
%19 = aten.reshape(%18, [-1, 4, 24])  : bf16[3, 4, 24]
%20 = aten.split_with_sizes(%19, [16, 8], -1)
%21 = %20[0]  : bf16[3, 4, 16]
%22 = %20[1]  : bf16[3, 4, 8]
%23 = aten.permute(%21, [1, 0, 2])  : bf16[4, 3, 16]
%24 = aten.bmm(%23, %in9)  : bf16[4, 3, 32]
%25 = aten.permute(%24, [1, 0, 2])  : bf16[3, 4, 32]
%26 = aten.cat([%25, %22], -1)  : bf16[3, 4, 40]
%27 = c10d.all_gather_into_tensor(%26, 2, '0')  : bf16[6, 4, 40]
%28 = c10d.wait_tensor(%27)  : bf16[6, 4, 40]
%29 = aten.reshape(%28, [2, 3, 4, 40])  : bf16[2, 3, 4, 40]
%30 = aten.permute(%29, [1, 0, 2, 3])  : bf16[3, 2, 4, 40]
%31 = aten.clone(%30, memory_format=torch.contiguous_format)  : bf16[3, 2, 4, 40]
%32 = aten.reshape(%31, [3, 8, 40])  : bf16[3, 8, 40]
%33 = aten.split_with_sizes(%32, [32, 8], -1)
%34 = %33[0]  : bf16[3, 8, 32]
%35 = %33[1]  : bf16[3, 8, 8]
%36 = prims.convert_element_type(%8, f32)  : f32[3, 32]
%37 = aten.pow(%36, 2)  : f32[3, 32]
%38 = aten.mean(%37, [-1], True)  : f32[3, 1]
%39 = aten.add(%38, 1e-05)  : f32[3, 1]
%40 = aten.rsqrt(%39)  : f32[3, 1]
%41 = aten.mul(%36, %40)  : f32[3, 32]
%42 = prims.convert_element_type(%41, bf16)  : bf16[3, 32]
%43 = aten.mul(%42, %in10)  : bf16[3, 32]
%44 = auto_functionalized_v2[kimi.mla_decode_dcp](ql_nope=%34, q_pe=%35, kv_c=%43, k_pe=%9, slot_mapping=%in11, block_table=%in12, seq_lens=%in13, selected=None, dcp_rank=0, dcp_size=2, scale=0.204124, _kv_cache_base_index=0, _all_bases=[%in14])
%45 = %44[0]  : f32[3, 8, 32]
%46 = %44[1]  : f32[3, 8]
%47 = c10d.all_gather_into_tensor(%46, 2, '0')  : f32[6, 8]
%48 = c10d.wait_tensor(%47)  : f32[6, 8]
%49 = aten.reshape(%48, [2, 3, 8])  : f32[2, 3, 8]
%50 = aten.amax(%49, [0])  : f32[3, 8]
%51 = aten.eq(%50, %50)  : b8[3, 8]
%52 = aten.abs(%50)  : f32[3, 8]
%53 = aten.ne(%52, inf)  : b8[3, 8]
%54 = aten.mul(%51, %53)  : b8[3, 8]
%55 = aten.where(%54, %50, %in15)  : f32[3, 8]
%56 = aten.sub(%49, %55)  : f32[2, 3, 8]
%57 = aten.exp(%56)  : f32[2, 3, 8]
%58 = aten.sum(%57, [0])  : f32[3, 8]
%59 = aten.gt(%58, 0)  : b8[3, 8]
%60 = aten.sub(%46, %55)  : f32[3, 8]
%61 = aten.exp(%60)  : f32[3, 8]
%62 = aten.clamp_min(%58, 1e-30)  : f32[3, 8]
%63 = aten.div(%61, %62)  : f32[3, 8]
%64 = aten.where(%59, %63, %in16)  : f32[3, 8]
%65 = aten.unsqueeze(%64, 2)  : f32[3, 8, 1]
%66 = aten.mul(%45, %65)  : f32[3, 8, 32]
%67 = aten.reshape(%66, [3, 2, 4, 32])  : f32[3, 2, 4, 32]
%68 = aten.permute(%67, [1, 2, 0, 3])  : f32[2, 4, 3, 32]
%69 = aten.reshape(%68, [8, 3, 32])  : f32[8, 3, 32]
%70 = aten.clone(%69, memory_format=torch.contiguous_format)  : f32[8, 3, 32]
%71 = c10d.reduce_scatter_tensor(%70, 'sum', 2, '0')  : f32[4, 3, 32]
%72 = c10d.wait_tensor(%71)  : f32[4, 3, 32]
%73 = aten.permute(%72, [1, 0, 2])  : f32[3, 4, 32]
%74 = prims.convert_element_type(%73, bf16)  : bf16[3, 4, 32]
%75 = aten.permute(%74, [1, 0, 2])  : bf16[4, 3, 32]
%76 = aten.bmm(%75, %in17)  : bf16[4, 3, 16]
%77 = aten.permute(%76, [1, 0, 2])  : bf16[3, 4, 16]
%78 = aten.clone(%77, memory_format=torch.contiguous_format)  : bf16[3, 4, 16]
%79 = aten.reshape(%78, [3, 64])  : bf16[3, 64]
%80 = prims.convert_element_type(%79, f32)  : f32[3, 64]
%81 = prims.convert_element_type(%5, f32)  : f32[3, 64]
%82 = aten.sigmoid(%81)  : f32[3, 64]
%83 = aten.mul(%80, %82)  : f32[3, 64]
%84 = prims.convert_element_type(%83, bf16)  : bf16[3, 64]
%85 = aten.mm(%84, %in18)  : bf16[3, 128]
%86 = c10d.all_reduce(%85, 'sum', '0')  : bf16[3, 128]
%87 = c10d.wait_tensor(%86)  : bf16[3, 128]""")
