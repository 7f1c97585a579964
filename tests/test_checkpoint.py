"""Checkpoints: real tensor names, save/load, MXFP4 experts, per-rank sharding."""

import pytest
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


def _dequantised(tensors):
    """The checkpoint with each MXFP4 expert weight written as its bf16 values."""
    from kimi_inductor.stock.mxfp4 import mxfp4_dequantize

    out = {k: v for k, v in tensors.items() if not k.endswith(("weight_packed", "weight_scale"))}
    for k in tensors:
        if k.endswith("weight_packed"):
            out[k[: -len("_packed")]] = mxfp4_dequantize(tensors[k], tensors[k[: -len("packed")] + "scale"])
    return out


def test_mxfp4_experts_load_packed_and_compute_as_their_bf16_values():
    """MXFP4 experts stay packed (uint8 codes + E8M0 scales: 17/64 of the bf16 bytes);
    the model's decode step equals, bitwise, the model loaded from the same experts as
    bf16 values. A checkpoint with any bf16 expert loads bf16 (MXFP4 ones dequantised)."""
    from kimi_inductor.stock.batch import DecodeBatch

    c = KimiK3Config.preset("tiny")
    t = random_checkpoint(c, seed=5, experts="mxfp4")
    packed, plain = build_model(c, t), build_model(c, _dequantised(t))
    ex, ref = packed.model.layers[1].block_sparse_moe.experts, plain.model.layers[1].block_sparse_moe.experts
    assert ex.w13_weight.dtype == torch.uint8 and ex.w13_weight.shape == (8, 64, 32)
    assert ex.w13_weight_scale.shape == (8, 64, 2) and ex.w2_weight.shape == (8, 64, 16)
    assert ref.w13_weight.dtype == torch.bfloat16 and not hasattr(ref, "w13_weight_scale")
    nbytes = sum(p.numel() * p.element_size() for n, p in packed.named_parameters() if ".experts." in n)
    bf16_bytes = sum(p.numel() * p.element_size() for n, p in plain.named_parameters() if ".experts." in n)
    assert nbytes == bf16_bytes // 4 + bf16_bytes // 64  # 4 bits + 8 bits per 32 values, vs 16 bits
    batch = DecodeBatch(3, 2, 1, c.vocab_size)
    step = batch.step()
    with torch.no_grad():
        outs = [m(step, m.allocate_caches(batch.num_slots, batch.num_blocks, batch.block_size, batch.q))
                for m in (packed, plain)]
    assert torch.equal(*outs) and outs[0].abs().sum() > 0
    mixed = dict(t)
    e = "model.layers.1.block_sparse_moe.experts.0.w1."
    mixed[e + "weight"] = _dequantised({k: v for k, v in t.items() if k.startswith(e)})[e + "weight"]
    del mixed[e + "weight_packed"], mixed[e + "weight_scale"]
    assert build_model(c, mixed).model.layers[1].block_sparse_moe.experts.w13_weight.dtype == torch.bfloat16


def test_mxfp4_experts_refuse_a_tp_width_of_partial_scale_groups(fake_world):
    from kimi_inductor.stock import Parallel

    c = KimiK3Config.preset("tiny")  # expert FFN width 32: 16 per rank at TP 2
    with pytest.raises(ValueError, match="whole 32-value scale groups"):
        build_model(c, random_checkpoint(c, experts="mxfp4"), Parallel("tp", fake_world(2)))


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


def test_expected_tensors_are_the_ones_random_checkpoint_writes():
    from kimi_inductor.stock.checkpoint import expected_tensors

    for preset in ("tiny", "tiny-k3.1"):
        c = KimiK3Config.preset(preset)
        names, experts = expected_tensors(c)
        assert set(random_checkpoint(c).keys()) == set(names) | {p + "weight" for p in experts}
        assert set(random_checkpoint(c, experts="mxfp4").keys()) == \
            set(names) | {p + s for p in experts for s in ("weight_packed", "weight_scale")}


def _write(path, config: dict, shards: list[dict]):
    import json

    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    for i, shard in enumerate(shards):
        save_file({k: v.contiguous() for k, v in shard.items()}, str(path / f"model-{i:05d}.safetensors"))


def _drop(t, name):
    return {k: v for k, v in t.items() if k != name}


E7 = "model.layers.1.block_sparse_moe.experts.7.w2.weight"
STRICT_CASES = {
    "duplicate": (lambda c, t: (c, [t, {"model.norm.weight": t["model.norm.weight"]}]),
                  r"tensor model.norm.weight is in the checkpoint twice: model.norm.weight in model-00000"),
    "unknown": (lambda c, t: (c, [{**t, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}]),
                r"1 tensors the Kimi K3 decoder does not use, e.g. \['model.layers.0.self_attn.rotary_emb.inv_freq'\]"),
    "int32": (lambda c, t: (c, [{**t, "model.norm.weight": t["model.norm.weight"].int()}]),
              "tensor model.norm.weight has dtype torch.int32; weights are floating point"),
    "bool": (lambda c, t: (c, [{**t, "lm_head.weight": t["lm_head.weight"] > 0}]),
             "tensor lm_head.weight has dtype torch.bool"),
    "fewer_layers_in_config": (lambda c, t: ({**c, "num_hidden_layers": 8}, [t]),
                               "config num_hidden_layers = 8 but the checkpoint has tensors of layer 8"),
    "more_layers_in_config": (lambda c, t: ({**c, "num_hidden_layers": 10}, [t]),
                              "config num_hidden_layers = 10 but the checkpoint's tensors stop at layer 8"),
    "output_gate": (lambda c, t: ({**c, "mla_use_output_gate": False}, [t]),
                    "config mla_use_output_gate = False: .* supports only mla_use_output_gate = true"),
    "moe_norm": (lambda c, t: ({**c, "latent_moe_use_norm": False}, [t]), "config latent_moe_use_norm = False"),
    "tied": (lambda c, t: ({**c, "tie_word_embeddings": True}, [t]), "config tie_word_embeddings = True"),
    "eps_zero": (lambda c, t: ({**c, "rms_norm_eps": 0.0}, [t]), r"config rms_norm_eps must be a number in \(0, 1\)"),
    "eps_negative": (lambda c, t: ({**c, "rms_norm_eps": -1e-5}, [t]), "config rms_norm_eps must be"),
    "missing_expert": (lambda c, t: (c, [_drop(t, E7)]),
                       rf"lacks 1 tensors, e.g. \['{E7} \(or .*w2.weight_packed \+ weight_scale\)'\]"),
}


@pytest.mark.parametrize("case", sorted(STRICT_CASES))
def test_loading_is_strict(tmp_path, case):
    """Each way a checkpoint used to load wrongly or crash obscurely is a ValueError
    naming the tensor or config field."""
    c = KimiK3Config.preset("tiny")
    t = random_checkpoint(c, seed=2)
    make, message = STRICT_CASES[case]
    config, shards = make(c.to_hf(), t)
    _write(tmp_path / "ckpt", config, shards)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(tmp_path / "ckpt")


def test_build_model_is_strict_too():
    c = KimiK3Config.preset("tiny")
    t = random_checkpoint(c, seed=2)
    with pytest.raises(ValueError, match="tensor model.norm.weight has dtype torch.int32"):
        build_model(c, {**t, "model.norm.weight": t["model.norm.weight"].int()})
    with pytest.raises(ValueError, match=E7):
        build_model(c, _drop(t, E7))


def test_mxfp4_experts_in_the_sm90_kernel_layout_compute_the_same():
    """``mxfp4_layout='sm90'`` reorders the packed experts' bytes for the SM90 expert kernel
    (5-D uint8, the same bytes); the stock step reads them back bitwise as loaded. Shapes
    the kernel cannot take raise, naming the fallback."""
    import dataclasses

    from kimi_inductor.stock.batch import DecodeBatch

    c = dataclasses.replace(KimiK3Config.preset("tiny"), routed_expert_hidden_size=256, moe_intermediate_size=256)
    t = random_checkpoint(c, seed=6, experts="mxfp4")
    packed, sm90 = build_model(c, t, mxfp4_layout="checkpoint"), build_model(c, t, mxfp4_layout="sm90")
    ex, ref = sm90.model.layers[1].block_sparse_moe.experts, packed.model.layers[1].block_sparse_moe.experts
    assert ex.w13_weight.dtype == torch.uint8 and ex.w13_weight.dim() == 5 and ref.w13_weight.dim() == 3
    assert sum(p.numel() for p in sm90.parameters()) == sum(p.numel() for p in packed.parameters())
    batch = DecodeBatch(3, 2, 1, c.vocab_size)
    step = batch.step()
    with torch.no_grad():
        outs = [m(step, m.allocate_caches(batch.num_slots, batch.num_blocks, batch.block_size, batch.q))
                for m in (packed, sm90)]
    assert torch.equal(*outs)
    big = {k: v.clone() if k.endswith("weight_scale") else v for k, v in t.items()}
    next(v for k, v in big.items() if k.endswith("weight_scale")).view(-1)[0] = 129  # 2^2: beyond the kernel
    with pytest.raises(ValueError, match="E8M0 scale byte 129.*mxfp4_layout='checkpoint'"):
        build_model(c, big, mxfp4_layout="sm90")
    tiny = KimiK3Config.preset("tiny")
    with pytest.raises(ValueError, match="mxfp4_layout='checkpoint'"):
        build_model(tiny, random_checkpoint(tiny, experts="mxfp4"), mxfp4_layout="sm90")
    assert build_model(tiny, random_checkpoint(tiny, experts="mxfp4")).model.layers[1] \
        .block_sparse_moe.experts.w13_weight.dim() == 3  # "auto" on the CPU: as stored
