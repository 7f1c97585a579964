"""MXFP4 routed experts on vLLM's K3 graph: ``kimi_vllm.mega_moe`` takes them as vLLM's
emulation MoE backend keeps them (the checkpoint layout), and refuses any other layout.

The tiny K3 of ``test_vllm_graph`` (5 layers, 2 requests and a padding row) is written
with MXFP4 experts and vLLM's ``mxfp4`` quant method, and built on CPU by vLLM with
``moe_backend="emulation"`` (amd-quark stood in: ``vllm_cpu.SHIMS``), in a process of
its own. Skips without vLLM.
"""

from types import SimpleNamespace

import pytest
import torch
from test_vllm_graph import (LAYERS, PADDING, ROWS, assert_in_band, eager_and_compiled, isolated,  # noqa: F401
                             pytestmark)

STEPS = 2


def mxfp4_model(steps):
    """In the child: vLLM's tiny K3 with MXFP4 experts; its experts as loaded, one MoE
    layer through vLLM's op, ours and the stock reference, then ``steps`` steps of vLLM
    eager and of the backbone compiled with every pass."""
    from kimi_inductor import vllm_cpu
    from kimi_inductor.stock.moe import combine_experts
    from kimi_inductor.stock.mxfp4 import dequantize_experts, expert_weights

    vllm_config, model = vllm_cpu.build(tp=1, layers=LAYERS, experts="mxfp4")  # first: vLLM imported for CPU
    from vllm.model_executor.layers.fused_moe.flashinfer_moe_ep import _dequant_mxfp4_experts
    from vllm.utils.torch_utils import _encode_layer_name

    from kimi_inductor import vllm_moe  # noqa: F401  (registers kimi_vllm::mega_moe)

    name = "model.layers.1.block_sparse_moe.experts"
    runner = vllm_config.compilation_config.static_forward_context[name]
    experts, config = runner.routed_experts, runner.moe_config
    w13, w2, s13, s2 = (experts.w13_weight, experts.w2_weight, experts.w13_weight_scale, experts.w2_weight_scale)
    out = {"backend": vllm_config.kernel_config.moe_backend, "method": type(experts.quant_method).__name__,
           "mxfp4_backend": experts.quant_method.mxfp4_backend.value,
           "loaded": {k: (tuple(t.shape), t.dtype) for k, t in
                      (("w13", w13), ("w13_scale", s13), ("w2", w2), ("w2_scale", s2))},
           "dequant_as_vllm": all(torch.equal(_dequant_mxfp4_experts(w, s), dequantize_experts(w, s))
                                  for w, s in ((w13, s13), (w2, s2)))}

    batch = vllm_cpu.decode_batch(model, vllm_config, ROWS, PADDING)
    g = torch.Generator().manual_seed(1)
    rows = ROWS + PADDING
    latent = torch.randn(rows, w2.shape[1], generator=g).bfloat16()
    logits = torch.randn(rows, config.num_experts, generator=g)
    shared_in = torch.randn(rows, vllm_config.model_config.hf_text_config.hidden_size, generator=g).bfloat16()
    layer = _encode_layer_name(name)
    with torch.no_grad(), vllm_cpu.forward_context(vllm_config, vllm_cpu.next_step(vllm_config, batch)):
        out["vllm"] = torch.ops.vllm.moe_forward_shared(latent, logits, shared_in, None, layer, 0)
        out["ours"] = torch.ops.kimi_vllm.mega_moe(latent, logits, shared_in, layer)
        weights, ids = runner.router.select_experts(hidden_states=latent, router_logits=logits)
    betas = config.activation_situ_beta, config.activation_situ_linear_beta
    out["stock"] = combine_experts(latent, weights, ids, *expert_weights(w13, w2, s13, s2), 0, *betas).bfloat16()
    out.update(eager_and_compiled(vllm_config, model, batch, steps))
    return out


@pytest.fixture(scope="module")
def mxfp4():
    return isolated(mxfp4_model, STEPS)


def test_vllm_keeps_mxfp4_experts_in_the_checkpoint_layout(mxfp4):
    """The emulation backend of vLLM's ``mxfp4`` quant method: uint8 codes two per byte
    along the input dimension, one uint8 E8M0 scale per 32 inputs (E = 8, I = 32,
    latent L = 64), dequantised by vLLM's own torch code exactly as by ours."""
    assert (mxfp4["backend"], mxfp4["method"], mxfp4["mxfp4_backend"]) == ("emulation", "Mxfp4MoEMethod", "EMULATION")
    u8 = torch.uint8
    assert mxfp4["loaded"] == {"w13": ((8, 64, 32), u8), "w13_scale": ((8, 64, 2), u8),
                               "w2": ((8, 64, 16), u8), "w2_scale": ((8, 64, 1), u8)}
    assert mxfp4["dequant_as_vllm"]


def test_our_op_runs_vllms_mxfp4_experts(mxfp4):
    """On one MoE layer: the shared experts are vLLM's (bitwise); the routed sum equals
    the stock reference on the dequantised experts (bitwise: the CPU path is that
    reference) and vLLM's emulation forward within bf16 rounding on the live rows (vLLM's
    fused Triton experts round more: 0.9-1.0% row error against an fp32 computation of the
    same experts, ours 0.3-0.4%; swapped gate / up rows or nibbles would be O(1)); the
    padding row is not routed (zero)."""
    (shared, routed), (their_shared, theirs) = mxfp4["ours"], mxfp4["vllm"]
    assert torch.equal(shared, their_shared)
    assert torch.equal(routed[:ROWS], mxfp4["stock"][:ROWS])
    assert not routed[ROWS:].any()
    err = (routed[:ROWS].float() - theirs[:ROWS].float()).norm(dim=-1) / theirs[:ROWS].float().norm(dim=-1)
    assert (err < 0.02).all(), err


def test_mxfp4_backbone_compiled_with_every_pass_agrees_with_vllm_eager(mxfp4):
    (compiled,), (reports,) = mxfp4["compiled"], mxfp4["reports"]
    assert_in_band(mxfp4["eager"], compiled)
    (report,) = reports
    mega = next(p for p in report["passes"] if p["name"] == "mega_moe")
    assert (mega["matched"], mega["rewritten"]) == (4, 4)
    assert all("kimi_vllm.mega_moe" in layer["notes"]["moe"] for layer in report["layers"][1:])


# ------------------------------------------------------------- refusals (in process)
def _runner(backend="EMULATION", w4a16=True, shapes=None):
    """A MoE runner as ``_experts`` reads it: MXFP4 experts (E 2, I 32, L 64) in the
    checkpoint layout unless ``shapes`` overrides some, under ``backend``."""
    from vllm.model_executor.layers.fused_moe.config import mxfp4_moe_quant_config, mxfp4_w4a16_moe_quant_config
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend

    shapes = {"w13_weight": (2, 64, 32), "w13_weight_scale": (2, 64, 2), "w2_weight": (2, 64, 16),
              "w2_weight_scale": (2, 64, 1), **(shapes or {})}
    t = {k: torch.zeros(shape, dtype=torch.uint8) for k, shape in shapes.items()}
    quant = (mxfp4_w4a16_moe_quant_config if w4a16 else mxfp4_moe_quant_config)(t["w13_weight_scale"],
                                                                               t["w2_weight_scale"])
    method = SimpleNamespace(mxfp4_backend=Mxfp4MoeBackend[backend], moe_quant_config=quant)
    return SimpleNamespace(layer_name="model.layers.1.block_sparse_moe.experts", moe_config=SimpleNamespace(ep_rank=1),
                           routed_experts=SimpleNamespace(**t, quant_method=method, expert_map=None))


def test_mxfp4_experts_in_the_checkpoint_layout_are_taken_as_they_are():
    from kimi_inductor import vllm_moe

    runner = _runner()
    w13, w2, w13_scale, w2_scale, first = vllm_moe._experts(runner)
    experts = runner.routed_experts
    theirs = experts.w13_weight, experts.w2_weight, experts.w13_weight_scale, experts.w2_weight_scale
    assert all(a is b for a, b in zip((w13, w2, w13_scale, w2_scale), theirs))  # the same tensors: no copy
    assert first == 2


@pytest.mark.parametrize("variant, cause", [
    ({"backend": "MARLIN"}, r"MXFP4 MoE backend MARLIN, which re-lays them out"),
    ({"shapes": {"w13_weight_scale": (2, 128)}}, r"not in the checkpoint layout .*\(2, 128\)"),  # CUTLASS-tiled scales
    ({"shapes": {"w2_weight": (2, 64, 32)}}, r"not in the checkpoint layout"),
    ({"w4a16": False}, r"quantized activations"),
])
def test_other_mxfp4_layouts_are_refused_with_the_fix(variant, cause):
    from kimi_inductor import vllm_moe

    with pytest.raises(ValueError, match=rf"layer model\.layers\.1\.block_sparse_moe\.experts has .*{cause}.*"
                                         r"Fix: .*moe_backend='emulation'"):
        vllm_moe._experts(_runner(**variant))


def test_mxfp4_experts_are_reordered_in_place_for_the_sm90_kernel(monkeypatch):
    """Where the SM90 MXFP4 kernel runs (stood in here: the CPU takes the reference), the
    first call with bf16 activations reorders the layer's bytes in place into its layout
    (5-D views of vLLM's own storage, once), the op on them equals the op on the
    checkpoint layout, and vLLM's own MoE path for the layer refuses with the fix;
    ``KIMI_VLLM_MXFP4_LAYOUT=checkpoint`` and fp32 activations keep the layout."""
    from kimi_inductor import vllm_moe
    from kimi_inductor.kernels import expert_ffn as X
    from kimi_inductor.kernels import expert_mxfp4
    from kimi_inductor.kernels.expert_mxfp4 import checkpoint_layout

    monkeypatch.setattr(expert_mxfp4, "runs_on", lambda device: True)
    monkeypatch.setattr(vllm_moe, "_SM90", {})
    L = I = 256
    runner = _runner(shapes={"w13_weight": (2, 2 * I, L // 2), "w13_weight_scale": (2, 2 * I, L // 32),
                             "w2_weight": (2, L, I // 2), "w2_weight_scale": (2, L, I // 32)})
    experts = runner.routed_experts
    g = torch.Generator().manual_seed(0)
    for name in ("w13_weight", "w2_weight"):
        getattr(experts, name).copy_(torch.randint(0, 256, getattr(experts, name).shape, generator=g))
        getattr(experts, name + "_scale").copy_(torch.randint(118, 129, getattr(experts, name + "_scale").shape,
                                                              generator=g))
    stored = [getattr(experts, n).clone() for n in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale")]
    calls = []
    experts.quant_method.apply = lambda layer=None, **kw: calls.append(layer)
    other = SimpleNamespace()
    monkeypatch.setenv("KIMI_VLLM_MXFP4_LAYOUT", "checkpoint")
    assert vllm_moe._experts(runner, torch.bfloat16)[0] is experts.w13_weight
    monkeypatch.delenv("KIMI_VLLM_MXFP4_LAYOUT")
    assert vllm_moe._experts(runner, torch.float32)[0] is experts.w13_weight
    w13, w2, s13, s2, first = vllm_moe._experts(runner, torch.bfloat16)
    assert w13.dim() == 5 and w13.data_ptr() == experts.w13_weight.data_ptr() and first == 2  # in place
    assert vllm_moe._experts(runner, torch.bfloat16)[0] is w13  # reordered once
    monkeypatch.setenv("KIMI_VLLM_MXFP4_LAYOUT", "checkpoint")  # too late to keep the layout: the bytes moved,
    assert vllm_moe._experts(runner, torch.float32)[0] is w13  # so every call reads the views (never as stored)
    monkeypatch.delenv("KIMI_VLLM_MXFP4_LAYOUT")
    assert all(torch.equal(a, b) for a, b in zip(checkpoint_layout(w13, s13, True) + checkpoint_layout(w2, s2, False),
                                                 (stored[0], stored[2], stored[1], stored[3])))
    latent = torch.randn(3, L, generator=g).bfloat16()
    weights, ids = torch.rand(3, 2, generator=g), torch.tensor([[0, 1], [1, -1], [0, 0]], dtype=torch.int32)
    assert torch.equal(X.reference(latent, weights, ids, w13, w2, 4.0, 25.0, s13, s2),
                       X.reference(latent, weights, ids, *stored[:2], 4.0, 25.0, *stored[2:]))
    with pytest.raises(ValueError, match=r"reordered in place .*KIMI_VLLM_MXFP4_LAYOUT=checkpoint"):
        experts.quant_method.apply(layer=experts)
    experts.quant_method.apply(layer=other)  # another layer sharing the method still runs
    assert calls == [other]
