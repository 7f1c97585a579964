"""Checkpoints: real tensor names, save/load, MXFP4 experts, per-rank sharding."""

import torch
from safetensors.torch import save_file

from kimi_inductor.stock import KimiK3Config
from kimi_inductor.stock.checkpoint import build_model, load_checkpoint, random_checkpoint, save_checkpoint


def test_names_are_the_published_ones():
    c = KimiK3Config.preset("tiny-k3.1")
    t = random_checkpoint(c, experts="mxfp4")
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.A_log",
                 "model.layers.0.self_attn.q_conv1d.weight", "model.layers.0.mlp.gate_proj.weight",
                 "model.layers.3.self_attn.kv_a_proj_with_mqa.weight", "model.layers.3.self_attn.indexer.wk.weight",
                 "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
                 "model.layers.1.block_sparse_moe.experts.7.w2.weight_packed",
                 "model.layers.1.block_sparse_moe.experts.7.w2.weight_scale",
                 "model.layers.8.mlp_res_proj.weight", "model.output_attn_res_proj.weight", "lm_head.weight"):
        assert name in t, name
    assert t["model.layers.0.self_attn.q_conv1d.weight"].dtype == torch.float32


def test_save_load_round_trip_and_multimodal_prefix(tmp_path):
    c = KimiK3Config.preset("tiny")
    t = random_checkpoint(c, seed=3)
    save_checkpoint(tmp_path / "a", c, t)
    c2, t2 = load_checkpoint(tmp_path / "a")
    assert c2 == c and t2.keys() == t.keys() and all(torch.equal(t[k], t2[k]) for k in t)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    save_file({("language_model." + k[len("model."):] if k.startswith("model.layers.") else k): v
               for k, v in t.items()}, str(tmp_path / "b" / "model-00001.safetensors"))
    _, t3 = load_checkpoint(tmp_path / "b")
    assert t3.keys() == t.keys()


def test_mxfp4_experts_load_dequantised():
    c = KimiK3Config.preset("tiny")
    packed = build_model(c, random_checkpoint(c, seed=5, experts="mxfp4"))
    w = packed.model.layers[1].block_sparse_moe.experts.w13_weight
    assert w.dtype == torch.bfloat16 and w.shape == (8, 64, 64) and w.abs().sum() > 0


def test_rank_weights_for_one_rank_match_the_checkpoint():
    c = KimiK3Config.preset("tiny")
    t = random_checkpoint(c, seed=1)
    m = build_model(c, t)
    attn = m.model.layers[0].self_attn
    w = attn.in_proj_qkvgfab.weight
    P, D = 128, 16
    assert w.shape == (4 * P + D + 8 + 8, 128)  # 536 real rows + 8 pad rows
    assert torch.equal(w[:P], t["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(w[4 * P: 4 * P + D], t["model.layers.0.self_attn.f_a_proj.weight"])
    assert w[-8:].abs().max() == 0
    assert torch.equal(attn.A_log, t["model.layers.0.self_attn.A_log"][:8])
    mla = m.model.layers[3].self_attn.fused_qkv_a_g_proj.weight
    assert mla.shape == (48 + 40 + 128, 128)
