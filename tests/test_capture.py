"""Dynamo captures a whole SP decode step as one graph with the op-level shape the passes match."""

import collections
import re

import pytest
import torch

from kimi_inductor.stock import KimiK3Config, Parallel
from kimi_inductor.stock.batch import DecodeBatch
from kimi_inductor.stock.checkpoint import build_model, random_checkpoint


def layer_of(node):
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        m = re.search(r"layers[\[.]'?(\d+)", path)
        if m:
            return int(m.group(1))
    return None


@pytest.mark.parametrize("preset, core", [("tiny", "kimi.mla_decode"), ("tiny-k3.1", "kimi.dsa_decode")])
def test_sp_step_is_one_graph_with_per_layer_collectives(fake_world, preset, core):
    config = KimiK3Config.preset(preset)
    model = build_model(config, random_checkpoint(config), Parallel("sp", fake_world(4)))
    batch = DecodeBatch(3, q=4, padding=1, vocab=config.vocab_size)
    caches = model.allocate_caches(batch.num_slots, batch.num_blocks, batch.block_size, batch.q)
    graphs = []

    def record(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=record, fullgraph=True, dynamic=False)(batch.step(), caches)
    assert len(graphs) == 1
    per_layer = collections.defaultdict(collections.Counter)
    for node in graphs[0].graph.nodes:
        name = str(node.target)
        if node.op == "call_function" and ("kimi." in name or "_c10d_functional" in name):
            per_layer[layer_of(node)][name.split(".")[-1] if "c10d" in name else name] += 1
    L = config.num_hidden_layers
    for i in range(L):
        kind = config.layer_kind(i)
        want = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1, "wait_tensor": 2, "kimi.attn_res": 2,
                {"kda": "kimi.kda_decode", "mla": "kimi.mla_decode", "dsa": "kimi.dsa_decode"}[kind]: 1}
        if config.is_moe_layer(i):
            want["kimi.ep_experts"] = 1
        assert per_layer[i] == collections.Counter(want), (i, per_layer[i])
    # outside the layers: the embedding's all-reduce, the final AttnRes and the exit gather
    assert per_layer[None] == collections.Counter(
        {"all_reduce": 1, "wait_tensor": 2, "kimi.attn_res": 1, "all_gather_into_tensor": 1})
    assert sum(c[core] for c in per_layer.values()) == sum(config.layer_kind(i) != "kda" for i in range(L))
