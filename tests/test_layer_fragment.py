"""A layer fragment: one Kimi K3 attention or MoE layer compiled alone (``passes/decoder.py``).

mega_moe and lower_kernels rewrite it (their rewrites are local); every pass that needs
the whole decoder skips it and says so; with CPU references the rewritten layer is
bitwise the stock layer. A fragment with collectives (a TP layer) or under
``decode.tp > 1`` is refused and left unchanged.
"""

import pytest
import torch

pytest.importorskip("triton")


def attention_layer(preset: str, kind: str, group=None):
    """(layer module, its inputs) of the tiny stack's first ``kind`` attention."""
    from kimi_inductor.stock import KimiK3Config, Parallel
    from kimi_inductor.stock.batch import DecodeBatch
    from kimi_inductor.stock.checkpoint import build_model, random_checkpoint

    config = KimiK3Config.preset(preset)
    model = build_model(config, random_checkpoint(config), Parallel("tp", group))
    batch = DecodeBatch(3, 2, 1, config.vocab_size)
    caches = model.allocate_caches(batch.num_slots, batch.num_blocks, batch.block_size, batch.q)
    i = next(i for i, layer in enumerate(model.model.layers) if layer.kind == kind)
    torch.manual_seed(0)
    for cache in caches[i]:
        cache.copy_(torch.randn_like(cache, dtype=torch.float32).to(cache.dtype))
    x = torch.randn(batch.rows, config.hidden_size).to(torch.bfloat16)
    return model.model.layers[i].self_attn, (x, batch.step(), caches[i])


def moe_layer(group=None):
    """(the tiny stack's first MoE layer, its inputs: 5 rows, the last one padding)."""
    from kimi_inductor.stock import KimiK3Config, Parallel
    from kimi_inductor.stock.checkpoint import build_model, random_checkpoint

    config = KimiK3Config.preset("tiny")
    model = build_model(config, random_checkpoint(config), Parallel("sp" if group else "tp", group))
    layer = next(l.mlp for l in model.model.layers if l.is_moe_layer)
    torch.manual_seed(0)
    x = torch.randn(5, config.hidden_size).to(torch.bfloat16)
    return layer, (x, torch.tensor([False] * 4 + [True]))


def compile_layer(layer, args, options=None):
    from kimi_inductor.backend import KimiSpecialized

    backend = KimiSpecialized({"compiler": "eager", **(options or {})})
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(layer, backend=backend, dynamic=False)(*args)
    return backend.report, out


@pytest.mark.parametrize("preset, kind, label", [("tiny", "kda", "fused KDA"), ("tiny", "mla", "MLA core"),
                                                 ("tiny-k3.1", "dsa", "DSA core")])
def test_a_lone_attention_layer_is_lowered_and_equals_stock(preset, kind, label):
    layer, (x, step, cache) = attention_layer(preset, kind)
    stock_cache = tuple(c.clone() for c in cache)
    with torch.no_grad():
        want = layer(x, step, stock_cache)
    report, got = compile_layer(layer, (x, step, cache))
    assert report.fragment == kind and not report.decoder and report.layout == "fragment" and not report.reason
    assert report.format().startswith(f"graph 0: Kimi K3 layer fragment ({kind}) layout=fragment rows={x.shape[0]}")
    passes = {p.name: p for p in report.passes}
    assert passes["lower_kernels"].rewritten >= 1
    assert (passes["mega_moe"].matched, passes["mega_moe"].skipped) == (0, [])  # runs, finds no experts
    for name in ("hybrid_attention", "sharded_moe"):
        assert passes[name].rewritten == 0
        assert passes[name].skipped == ["a layer fragment: this pass rewrites the whole decoder"]
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(cache, stock_cache))


def test_a_fragment_under_a_tp_setting_is_left_unchanged():
    layer, args = attention_layer("tiny", "kda")
    report, _ = compile_layer(layer, args, {"decode": {"tp": 2}})
    assert report.reason == "a layer fragment has no TP group, options say decode.tp=2"
    assert all(p.rewritten == 0 and p.skipped == [report.reason] for p in report.passes)


def test_a_tp_layer_with_its_all_reduce_is_not_a_fragment(fake_world):
    layer, args = attention_layer("tiny", "kda", group=fake_world(2))
    report, _ = compile_layer(layer, args)
    assert not report.fragment and not report.decoder
    assert "a layer fragment (layers without AttnRes) with 1 collective(s)" in report.reason
    assert all(p.rewritten == 0 for p in report.passes)


def test_a_lone_moe_layer_gets_our_experts_and_equals_stock():
    layer, args = moe_layer()
    with torch.no_grad():
        want = layer(*args)
    report, got = compile_layer(layer, args)
    assert report.fragment == "moe" and not report.reason
    passes = {p.name: p for p in report.passes}
    assert (passes["mega_moe"].matched, passes["mega_moe"].rewritten) == (1, 1)
    assert passes["sharded_moe"].skipped == ["a layer fragment: this pass rewrites the whole decoder"]
    assert torch.equal(got, want)


def test_an_expert_parallel_moe_fragment_gets_the_exchange(fake_world):
    """SP at G = 2: the EP op holds its exchange, so the layer is a fragment; mega_moe
    replaces it by ours (values are garbage on a fake group: the report is checked)."""
    layer, args = moe_layer(group=fake_world(2))
    report, _ = compile_layer(layer, args)
    assert report.fragment == "moe" and not report.reason
    assert next(p for p in report.passes if p.name == "mega_moe").rewritten == 1
