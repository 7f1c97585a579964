"""Capture vLLM 0.33.0's own Kimi K3 backbone on a CPU machine (docs/vllm.md,
"Capturing vLLM's K3 on CPU").

vLLM's ``vllm.models.kimi_k3.nvidia.model.KimiLinearModel`` is built from a tiny K3
checkpoint written from our replica (so both models hold the same weights, loaded by
vLLM's own ``load_weights``), decoded eagerly as vLLM does (its Triton kernels run in
Triton's interpreter, as with ``TRITON_INTERPRET=1``), and compiled with
``torch.compile(fullgraph=True)`` so that the post-grad FX graph our passes see can be
inspected or compiled by ``kimi_specialized``.

``install()`` (``build`` calls it) sets the environment a CPU capture needs (``ENV``)
and applies the shims (``SHIMS``: name -> why; ``SHIM_DEVICES``: for which device
types), process-wide and for good: use a process of its own (the tests spawn one per
scenario) in which vLLM has not been imported yet.

``build(device="cuda")`` builds the same model with its tensors on the GPU, where
vLLM's CUDA extension is absent or cannot load (vLLM 0.33.0's is built for torch 2.14):
vLLM still runs on its CPU platform class, with only the shims that pick CUDA's code
paths, its Triton kernels compiled by Triton, and stand-ins for its ``_C`` ops that run
inside CUDA graphs (``benchmarks/vllm_stack.py``, docs/vllm.md).

None of the shims changes vLLM's decode math: they pick the code path vLLM takes on
CUDA where the CPU platform would take another, make CUDA-only objects inert, and give
vLLM's compiled ``_C`` ops (absent from a CPU install) implementations with fake (meta)
kernels. Two things differ from a CUDA run and are
said where they are done: each KDA state has cache pages of its own, and MLA's output
gate runs uncompiled (``SHIMS``).

    vllm_config, model = build(tp=1, layers=5)               # tp=2/4: SP, fake group
    batch = decode_batch(model, vllm_config, rows=3, padding=1)
    step = next_step(vllm_config, batch)                       # vLLM's own metadata
    hidden = eager_step(model, vllm_config, step)             # vLLM eager
    graphs, hidden = capture(model, vllm_config, step)        # post-grad FX graphs
    compiled = compile_backbone(model, "kimi_specialized", {"compiler": "eager"})
    hidden = compiled.step(vllm_config, next_step(vllm_config, batch))

The model runs in one process with vLLM's distributed state initialised for it: TP > 1
uses a fake process group (``group="fake"``: capture only, collectives return garbage)
or the caller's gloo world (``group="gloo"``: ``torch.distributed`` initialised, e.g. by
``kimi_inductor.launch.run_ranks``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch._inductor.config
from torch import fx

ENV = {
    "VLLM_TARGET_DEVICE": "cpu",  # vLLM's CPU platform (its CUDA platform needs the _C extension: module docstring)
    "VLLM_KIMI_K3_GEMM_AR": "0",  # GEMM + all-reduce kernels are CUDA (CuTe DSL) only
    "HF_HUB_OFFLINE": "1",
}
CPU_ENV = {"CUDA_VISIBLE_DEVICES": ""}  # a CPU run: no GPU seen even where one is

SHIMS: dict[str, str] = {}
SHIM_DEVICES: dict[str, tuple[str, ...]] = {}  # name -> the device types it is installed for


def _shim(name: str, why: str, devices: tuple[str, ...] = ("cpu", "cuda")) -> Callable:
    """Register an installer under ``name`` in ``SHIMS``, for the device types
    ``devices`` (run once by ``install``)."""
    def deco(fn: Callable) -> Callable:
        SHIMS[name], SHIM_DEVICES[name] = why, devices
        _INSTALLERS.append((fn, devices))
        return fn
    return deco


_INSTALLERS: list[tuple[Callable, tuple[str, ...]]] = []
_installed: str | None = None


def install(device: str = "cpu") -> None:
    """Apply the shims for ``device`` ("cpu": everything runs on the CPU, vLLM's Triton
    kernels interpreted; "cuda": the model's tensors on the GPU, vLLM's Triton kernels
    compiled by Triton, only the shims that pick CUDA's code paths). Idempotent; call
    before building vLLM's model. A process serves one device type."""
    global _installed
    kind = torch.device(device).type
    if _installed is not None:
        if _installed != kind:
            raise RuntimeError(f"vllm_cpu is installed for {_installed}; this process cannot switch to {kind}")
        return
    os.environ.update(ENV)
    if kind == "cpu":
        os.environ.update(CPU_ENV)
    elif kind != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"vllm_cpu runs vLLM's K3 on 'cpu' or on an available 'cuda' device, not {device!r}")
    for fn, devices in _INSTALLERS:
        if kind in devices:
            fn()
    _installed = kind


# --------------------------------------------------------------------------- shims
@_shim("vLLM custom ops on CUDA", "vLLM registers its torch custom ops (vllm::moe_forward_shared, ...) for its "
       "platform's dispatch key, CPU on the CPU platform; with the model on CUDA they are registered for every "
       "backend (CompositeExplicitAutograd), before any vLLM module that defines one is imported", devices=("cuda",))
def _custom_ops_on_cuda() -> None:
    from vllm.platforms import current_platform

    type(current_platform).dispatch_key = "CompositeExplicitAutograd"


class _InertStream:
    """``torch.cuda.Stream`` on a machine without CUDA: constructible, never used
    (the aux streams that would use it are set to None, ``vllm_k3``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _InertEvent:
    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def record(self, *args: Any) -> None:
        pass

    def wait(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


@_shim("cuda Stream/Event", "K3's layers create torch.cuda.Stream/Event objects for their aux-stream overlap at "
       "construction; inert ones here (the overlap itself is off: aux streams are None, vllm_k3)", devices=("cpu",))
def _inert_cuda_streams() -> None:
    if not torch.cuda.is_available():
        torch.cuda.Stream = _InertStream
        torch.cuda.Event = _InertEvent


@_shim("MoE backend TRITON", "the unquantized MoE backend vLLM picks on H200 (KernelConfig(moe_backend='triton')); "
       "its TritonExperts accept the CPU device here (they run under the Triton interpreter)")
def _triton_moe_on_cpu() -> None:
    from vllm.model_executor.layers.fused_moe.experts import triton_moe

    triton_moe.TritonExperts._supports_current_device = staticmethod(lambda: True)


@_shim("amd-quark stand-in", "vLLM's emulation MoE backend (MXFP4 experts kept in the checkpoint layout) needs "
       "amd-quark: its support check, and quark.torch.kernel.mx.dq_mxfp4 to dequantise the experts per forward; "
       "where amd-quark is not installed, a stand-in module computes dq_mxfp4 with vLLM's own torch MXFP4 "
       "dequantisation of that layout (fused_moe.flashinfer_moe_ep)")
def _quark_stand_in() -> None:
    import importlib.machinery
    import importlib.util
    import sys
    import types

    if importlib.util.find_spec("quark") is not None:
        return

    def dq_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[..., K / 2] uint8 codes + [..., K / 32] uint8 E8M0 scales -> [..., K] ``dtype``."""
        from vllm.model_executor.layers.fused_moe.flashinfer_moe_ep import _dequant_mxfp4_ue8m0_gran32

        rows = _dequant_mxfp4_ue8m0_gran32(packed.reshape(-1, packed.shape[-1]), scales.reshape(-1, scales.shape[-1]))
        return rows.view(*packed.shape[:-1], -1).to(dtype)

    names = ("quark", "quark.torch", "quark.torch.kernel", "quark.torch.kernel.mx")
    modules = [types.ModuleType(name) for name in names]
    for module in modules:
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None, is_package=True)
    for parent, child in zip(modules, modules[1:]):
        setattr(parent, child.__name__.rsplit(".", 1)[1], child)
    modules[-1].dq_mxfp4 = dq_mxfp4
    sys.modules.update(zip(names, modules))


@_shim("MoERunner._select_forward", "the MoE runs as torch.ops.vllm.moe_forward(_shared), the opaque op CUDA "
       "uses (the CPU platform calls the Python function directly)")
def _moe_forward_op() -> None:
    from vllm.model_executor.layers.fused_moe.runner import moe_runner

    def select_forward(self) -> Callable:
        ops = torch.ops.vllm
        return ops.moe_forward if self._shared_experts is None else ops.moe_forward_shared

    moe_runner.MoERunner._select_forward = select_forward


@_shim("CustomOp forward_cuda", "vLLM's enabled CustomOps (custom_ops='all': mode NONE, or a backend other than "
       "Inductor such as kimi_specialized) dispatch to forward_cuda as on CUDA, not forward_cpu: KDA's gated norm is "
       "its Triton kernel, SiTU-and-mul the _C op (stand-in), RMSNorm the vllm_ir op")
def _custom_op_cuda_dispatch() -> None:
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.activation import SituAndMul

    dispatch = CustomOp.dispatch_forward
    if getattr(dispatch, "kimi_inductor", False):
        return

    def dispatch_forward(self, compile_native: bool):
        method = dispatch(self, compile_native)
        if getattr(method, "__func__", None) is not type(self).forward_cpu:
            return method  # disabled op (forward_native)
        if isinstance(self, SituAndMul):
            self.op = torch.ops._C.situ_and_mul  # set in __init__ on CUDA only
        return self.forward_cuda

    dispatch_forward.kimi_inductor = True
    CustomOp.dispatch_forward = dispatch_forward


@_shim("CPU communicator as CUDA's", "all_reduce is out of place, as CUDA's communicator (the CPU one reduces "
       "its input in place and returns it: vllm::all_reduce would alias its input, which AOTAutograd refuses when "
       "torch runs with CI set); the EP all-gather / reduce-scatter dispatch inside moe_forward_shared (SP layout) "
       "calls all_gatherv / reduce_scatterv, which vLLM implements for CUDA only: here for equal per-rank sizes "
       "(SP shards) through the communicator's all_gather / reduce_scatter")
def _cpu_communicator() -> None:
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    def equal(sizes: list[int] | None) -> None:
        if sizes is not None and len(set(sizes)) > 1:
            raise NotImplementedError(f"uneven per-rank sizes {sizes}")

    def all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):
        equal(sizes)
        if isinstance(input_, (list, tuple)):
            return [self.all_gather(x, dim) for x in input_]
        return self.all_gather(input_, dim)

    def reduce_scatterv(self, input_, dim: int = 0, sizes: list[int] | None = None):
        equal(sizes)
        return self.reduce_scatter(input_, dim)

    in_place = CpuCommunicator.all_reduce

    def all_reduce(self, input_):
        return in_place(self, input_.clone())

    CpuCommunicator.all_reduce = all_reduce
    CpuCommunicator.all_gatherv = all_gatherv
    CpuCommunicator.reduce_scatterv = reduce_scatterv


@_shim("use_custom_op_collectives", "CpuPlatform.use_custom_op_collectives() is True (CUDA's value): TP "
       "collectives are torch.ops.vllm.all_gather / reduce_scatter / all_reduce in the graph, as on H200")
def _custom_op_collectives() -> None:
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.use_custom_op_collectives = classmethod(lambda cls: True)


@_shim("unquantized GEMM", "UnquantizedLinearMethod and the vocab embedding's UnquantizedEmbeddingMethod use F.linear "
       "(CUDA's default_unquantized_gemm) and keep their weights; the CPU platform would repack weights for oneDNN / "
       "sgl-kernel extension ops (_C.convert_weight_packed on a host with AMX) and drop them")
def _linear_gemm() -> None:
    from vllm.model_executor.layers import linear, utils
    from vllm.model_executor.layers import vocab_parallel_embedding as vocab

    for module in (linear, vocab):
        module.dispatch_unquantized_gemm = lambda *args, **kwargs: utils.default_unquantized_gemm
    linear.UnquantizedLinearMethod.process_weights_after_loading = lambda self, layer: None
    vocab.UnquantizedEmbeddingMethod.process_weights_after_loading = lambda self, layer: None


@_shim("MLA gate uncompiled", "vLLM wraps MLA's sigmoid output gate (_gate_sigmoid_mul) in its own torch.compile; "
       "here it runs as the plain function, which is what a capture inlines (compiled alone, Inductor computes it in "
       "fp32 with one bf16 rounding instead of two, and eager would not match a graph run op by op)")
def _plain_gate() -> None:
    from vllm.models.kimi_k3.nvidia import mla

    mla._gate_sigmoid_mul = getattr(mla._gate_sigmoid_mul, "_torchdynamo_orig_callable", mla._gate_sigmoid_mul)


@_shim("causal_conv1d Triton", "KDA's short convolution uses vLLM's Triton causal_conv1d_update/_fn, as on CUDA "
       "(on the CPU platform the module rebinds them to CPU extension ops)")
def _triton_causal_conv1d() -> None:
    import importlib
    import sys

    from vllm.platforms import current_platform

    name = "vllm.model_executor.layers.mamba.ops.causal_conv1d"
    platform = type(current_platform)
    is_cpu = platform.is_cpu
    platform.is_cpu = lambda self: False  # only while the module body runs
    try:
        module = importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
    finally:
        platform.is_cpu = is_cpu
    kda = sys.modules.get("vllm.models.kimi_k3.nvidia.kda")
    if kda is not None:
        kda.causal_conv1d_update, kda.causal_conv1d_fn = module.causal_conv1d_update, module.causal_conv1d_fn


@_shim("Triton kernels interpreted", "every @triton.jit kernel launch (and nested helper call) runs in Triton's "
       "interpreter on the CPU, as TRITON_INTERPRET=1 would; the kernels stay JITFunctions, so Dynamo captures "
       "their launches as triton_kernel_wrapper_* (with TRITON_INTERPRET=1 it would trace into them)", devices=("cpu",))
def _interpret_triton() -> None:
    from triton.runtime import jit
    from triton.runtime.interpreter import InterpretedFunction

    if getattr(jit.JITFunction.run, "kimi_inductor", False):
        return

    def interpreted(kernel) -> InterpretedFunction:
        fn = kernel.__dict__.get("_kimi_interpreted")
        if fn is None:
            fn = kernel.__dict__["_kimi_interpreted"] = InterpretedFunction(kernel.fn)
        return fn

    def run(self, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        return interpreted(self).run(*args, grid=grid, warmup=warmup, **kwargs)

    def call(self, *args: Any, **kwargs: Any) -> Any:  # a helper called from an interpreted kernel
        return interpreted(self)(*args, **kwargs)

    run.kimi_inductor = True
    jit.JITFunction.run = run
    jit.JITFunction.__call__ = call
    _interpreter_patching()


SHIM_DEVICES["interpreter bf16 dot"] = SHIM_DEVICES["interpreter patching"] = ("cpu",)
SHIMS["interpreter bf16 dot"] = (
    "Triton 3.6's interpreter multiplies bf16 tl.dot operands as their raw uint16 storage (garbage: vLLM's fused MoE "
    "kernel); they are widened to fp32 first (exact, as a tensor core does)")

SHIMS["interpreter patching"] = (
    "while an interpreted launch runs, module-level aliases of Triton builtins (flash-linear-attention's `exp = "
    "tl.exp`, used by the KDA kernels) are patched with triton.language; nested helper calls skip re-patching what "
    "the launch patched (speed), and their patches are undone when the launch ends (Triton leaves them, which "
    "breaks later TTIR generation)")


def _interpreter_patching() -> None:
    """Two changes to how the interpreter patches ``triton.language`` around a launch:

    * a module that holds a Triton builtin under its own global name
      (flash-linear-attention's ``exp = tl.exp``, used by the KDA kernels) gets that
      global patched too for the launch (the interpreter patches ``tl.exp`` itself, so
      the alias would call the compiler-only builtin);
    * a nested ``@triton.jit`` helper call inside a running launch does not re-patch
      the languages the launch already patched (Triton redoes it per call: a third of
      the interpreter's time on these kernels), and what a nested call does patch is
      restored when the launch ends (Triton leaves ``triton.language.core`` patched,
      which breaks the TTIR generation of Dynamo's mutation analysis afterwards).

    And ``tl.dot`` of bf16 operands widens them to fp32 first: Triton 3.6's interpreter
    would multiply their uint16 storage."""
    import inspect
    import sys

    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang, grid_call = interpreter._patch_lang, interpreter.GridExecutor.__call__
    builtin_names = {id(getattr(tl, n)): n for n in dir(tl) if tl.core.is_builtin(getattr(tl, n, None))}
    aliases: dict[str, list[tuple[str, str]]] = {}  # module -> [(its global, tl's name)]
    launch: dict[str, Any] = {}  # while a launch runs: "langs" it patched, its "scope"

    class Unchanged:
        def restore(self) -> None:
            pass

    def module_aliases(fn: Callable) -> list[tuple[str, str]]:
        found = aliases.get(fn.__module__)
        if found is None:
            found = aliases[fn.__module__] = [
                (name, builtin_names[id(v)]) for name, v in list(fn.__globals__.items())
                if id(v) in builtin_names and not name.startswith("__")]
        return found

    def patch_lang_once(fn: Callable):
        if "langs" not in launch:
            return patch_lang(fn)  # not inside GridExecutor.__call__: Triton's own behaviour
        used = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core)}
        if "scope" in launch and used <= launch["langs"]:
            scope = Unchanged()
        else:
            scope = patch_lang(fn)
            launch["langs"] |= used
            if "scope" in launch:  # Triton never restores a nested call's patches: the launch does
                launch["nested"].append(scope)
            else:
                launch["scope"], launch["nested"], restore = scope, [], scope.restore

                def restore_all() -> None:
                    for nested in reversed(launch["nested"]):
                        nested.restore()
                    restore()
                scope.restore = restore_all
        for name, builtin in module_aliases(fn):
            launch["scope"].set_attr(sys.modules[fn.__module__], name, getattr(tl, builtin))
        return scope

    def run_grid(self, *args: Any, **kwargs: Any) -> Any:
        launch["langs"] = set()
        try:
            return grid_call(self, *args, **kwargs)  # restores the launch's scope when done
        finally:
            launch.clear()

    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = run_grid

    create_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widened(x):
            if x.dtype.scalar != tl.bfloat16:
                return x
            data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)
        return create_dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot_bf16


@_shim("has_triton", "torch.utils._triton.has_triton() is True (it wants a GPU, or Triton's CPU backend), so Dynamo "
       "captures vLLM's Triton launches as it does on CUDA", devices=("cpu",))
def _has_triton() -> None:
    import torch.utils._triton as triton_utils

    triton_utils.has_triton = lambda: True


def _prefill_kernel_arg_names() -> None:
    """Evaluate ``VllmTritonJitKernel._kernel_arg_names`` (a ``functools.cached_property``)
    of every such kernel object in vLLM's modules once, eagerly: on Python 3.11 the
    first evaluation takes a lock, which Dynamo cannot trace."""
    import sys

    from vllm.model_executor.warmup.jit_warmup_triton_helper import VllmTritonJitKernel

    for name, module in list(sys.modules.items()):
        if name.startswith("vllm.") and module is not None:
            for value in list(vars(module).values()):
                if isinstance(value, VllmTritonJitKernel):
                    value._kernel_arg_names  # noqa: B018  (fills the cached property)


@_shim("vLLM's Triton launch plans", "VllmTritonJitKernel (fused_q_kv_rmsnorm's launcher) binds its inputs to the "
       "kernel's arguments by a plan (_launch_binding_plan, functools.cache) that Dynamo traces; torch 2.11's Dynamo "
       "on Python 3.12 fails inside it ('Read uninitialized cell', its comprehension's walrus). Plans computed by an "
       "eager launch are kept in a dict that a compiled launch reads instead (a launch not seen eagerly computes its "
       "plan as before)")
def _known_launch_plans() -> None:
    from vllm.model_executor.warmup import jit_warmup_triton_helper as helper

    compute = helper._launch_binding_plan
    if getattr(compute, "kimi_inductor", False):
        return
    plans: dict[tuple, Any] = {}

    def launch_binding_plan(*key: tuple[str, ...]):
        plan = plans.get(key)
        if plan is None:
            plan = compute(*key)
            if not torch.compiler.is_compiling():  # a traced dict write trips Dynamo's mappingproxy check
                plans[key] = plan
        return plan

    launch_binding_plan.kimi_inductor = True
    helper._launch_binding_plan = launch_binding_plan


SHIM_DEVICES["VllmTritonJitKernel arg names"] = SHIM_DEVICES["conv state layout env"] = ("cpu", "cuda")
SHIMS["VllmTritonJitKernel arg names"] = (
    "vLLM's Triton kernel owners (fused_q_kv_rmsnorm) cache their argument names in a functools.cached_property; "
    "filled before compiling (Python 3.11's cached_property takes a lock Dynamo cannot trace)")


@_shim("Triton mutation analysis for sm_90", "Dynamo finds which tensors a Triton launch writes from the kernel's "
       "TTIR, which needs an active Triton driver: while it generates TTIR, a stand-in driver names H200's target "
       "(cuda, sm_90), so triton_kernel_wrapper_functional clones only what the kernel writes, as on H200 (without "
       "it Dynamo assumes every tensor argument is written)", devices=("cpu",))
def _ttir_for_sm90() -> None:
    from torch._higher_order_ops import triton_kernel_wrap
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    generate_ttir = triton_kernel_wrap.generate_ttir
    if getattr(generate_ttir, "kimi_inductor", False):
        return

    class SM90Driver:
        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self) -> int:
            return 0

    def generate_ttir_sm90(*args: Any, **kwargs: Any):
        active = driver._active
        driver.set_active(SM90Driver())
        try:
            return generate_ttir(*args, **kwargs)
        finally:
            driver._active = active

    generate_ttir_sm90.kimi_inductor = True
    triton_kernel_wrap.generate_ttir = generate_ttir_sm90


# ---------------------------------------------------------- stand-ins for _C ops
# vLLM's compiled extensions (_C, _moe_C) are absent from a CPU install of its CUDA
# wheel, and cannot load on a GPU whose torch is not the one the wheel was built for
# (vLLM 0.33.0's: torch 2.14). The ops K3's decode reaches are defined here under
# vLLM's own names and schemas (so the graph spells them as vLLM does on CUDA), each
# with an implementation of what the CUDA kernel computes and a fake (meta) kernel.
# Every implementation is capturable in a CUDA graph (no host synchronisation), except
# the CPU MLA decode, which has a CUDA one of its own (vLLM's Triton MLA kernels).
_LIBS: dict[str, torch.library.Library] = {}


def _define(qualname: str, schema: str, impl: Callable, cuda_impl: Callable | None = None) -> None:
    """Define ``qualname`` with ``impl`` on every device, or ``impl`` on the CPU and
    ``cuda_impl`` on CUDA; nothing where vLLM's own extension defines it."""
    namespace, name = qualname.split("::")
    if hasattr(getattr(torch.ops, namespace), name):
        return  # vLLM's own extension is loaded
    lib = _LIBS.setdefault(namespace, torch.library.Library(namespace, "FRAGMENT"))
    lib.define(f"{name}{schema}")
    if cuda_impl is None:
        lib.impl(name, impl, "CompositeExplicitAutograd")
    else:
        lib.impl(name, impl, "CPU")
        lib.impl(name, cuda_impl, "CUDA")
    torch.library.register_fake(qualname, lambda *args, **kwargs: None, lib=lib)


def _mla_q_concat_cache_insert(ql_nope, q_pe, kv_c_normed, k_pe, mqa_q, kv_cache, slot_mapping, block_size,
                               positions=None, cos_sin_cache=None) -> None:
    """mqa_q = [ql_nope | q_pe]; the latent [kv_c_normed | k_pe] of each row with a
    slot (>= 0) goes into the paged cache (K3's MLA is NoPE: no rotation). A row
    without a slot rewrites row 0 of block 0 (vLLM's null block, never a request's)
    with its own value, so the write needs no host-side selection."""
    if positions is not None or cos_sin_cache is not None:
        raise NotImplementedError("the stand-in does not apply RoPE (Kimi K3's MLA is NoPE)")
    mqa_q.copy_(torch.cat([ql_nope, q_pe], dim=-1))
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    keep = slot_mapping >= 0
    rows = torch.where(keep, slot_mapping, 0).long()
    latent = torch.cat([kv_c_normed, k_pe.reshape(k_pe.shape[0], -1)], dim=-1).to(flat.dtype)
    flat.index_copy_(0, rows, torch.where(keep[:, None], latent, flat[rows]))


def _mla_decode_kvcache(out, query, kv_cache, scale, block_tables, seq_lens) -> None:
    """Latent MQA decode over the paged cache (what the CPU MLA backend's kernel and
    FlashMLA compute): per request, softmax(q . K^T * scale) . V with K the whole latent
    row and V its first ``out.shape[-1]`` values; fp32 accumulation."""
    block_size, rank = kv_cache.shape[-2], out.shape[-1]
    flat = kv_cache.reshape(-1, kv_cache.shape[-1])
    for b in range(query.shape[0]):
        n = int(seq_lens[b])
        pos = torch.arange(n)
        rows = block_tables[b].long()[pos // block_size] * block_size + pos % block_size
        keys = flat[rows].float()
        probs = torch.softmax(query[b].float() @ keys.T * scale, dim=-1)
        out[b] = (probs @ keys[:, :rank]).to(out.dtype)


@functools.cache
def _unit_scale(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


def _mla_decode_kvcache_triton(out, query, kv_cache, scale, block_tables, seq_lens) -> None:
    """The same decode on CUDA with vLLM's Triton MLA kernels, launched as vLLM's
    TRITON_MLA backend launches them (split-KV stage 1 + stage 2, its split count for
    the longest context the block table holds; the cache read as [blocks, page, 1,
    L + R], its first L values the values)."""
    from vllm.v1.attention.backends.mla.triton_mla import _compute_num_kv_splits
    from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd

    B, N, L = out.shape
    page = kv_cache.shape[-2]
    cache = kv_cache.reshape(-1, page, 1, kv_cache.shape[-1])
    sms = torch.cuda.get_device_properties(out.device).multi_processor_count
    splits = _compute_num_kv_splits(block_tables.shape[1] * page, sms)
    logits = torch.empty(B, N, splits, L + 1, dtype=torch.float32, device=out.device)
    lse = torch.empty(B, N, dtype=out.dtype, device=out.device)
    one = _unit_scale(out.device)
    decode_attention_fwd(query, cache, cache[..., :L], out, lse, block_tables, seq_lens, logits, splits, scale, page,
                         k_scale=one, v_scale=one, is_mla=True)


def _situ_and_mul(out, x, beta, linear_beta) -> None:
    """beta tanh(gate / beta) sigmoid(gate) * up, up soft-clipped by linear_beta when > 0
    (vLLM's SituAndMul.forward_native formula, fp32)."""
    d = x.shape[-1] // 2
    gate, up = x[..., :d].float(), x[..., d:].float()
    gate = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if linear_beta > 0:
        up = linear_beta * torch.tanh(up / linear_beta)
    out.copy_((gate * up).to(out.dtype))


def _moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
                          expert_map=None, scatter_idx=None) -> None:
    """Group the flattened top-k slots by expert (in slot order within an expert),
    each expert's group padded to a multiple of ``block_size`` with the sentinel
    ``topk_ids.numel()``; ``experts_ids`` names each block's expert (-1 past the last).
    With ``expert_map`` (EP, invalid experts ignored) slots routed to other ranks'
    experts are left out and blocks carry local expert ids."""
    if scatter_idx is not None:
        raise NotImplementedError("scatter_idx")
    device, E = topk_ids.device, num_experts
    flat = topk_ids.reshape(-1).long()
    n, capacity = flat.numel(), sorted_token_ids.numel()
    local = torch.arange(E, device=device) if expert_map is None else expert_map.long()
    expert = torch.where(local[flat] >= 0, flat, E)  # E: left out, sorts last
    counts = torch.zeros(E + 1, dtype=torch.long, device=device).scatter_add_(0, expert, torch.ones_like(expert))[:E]
    padded = (counts + block_size - 1) // block_size * block_size
    ends = padded.cumsum(0)
    order = torch.sort(expert, stable=True).indices
    grouped = expert[order]
    e = grouped.clamp(max=E - 1)
    rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[e]  # place within the expert's group
    target = torch.where(grouped < E, ends[e] - padded[e] + rank, capacity)
    slots = torch.full((capacity + 1,), n, dtype=sorted_token_ids.dtype, device=device)
    slots.scatter_(0, target, order.to(slots.dtype))
    sorted_token_ids.copy_(slots[:capacity])
    block = torch.searchsorted(ends, torch.arange(experts_ids.numel(), device=device) * block_size, right=True)
    experts_ids.copy_(torch.where(block < E, local[block.clamp(max=E - 1)], -1))
    num_tokens_post_pad.copy_(ends[-1:])


def _moe_sum(input, output, topk_ids=None, expert_map=None) -> None:
    """Sum the top-k slot outputs [T, k, H] per row; with ``expert_map`` only the slots
    whose expert lives on this rank."""
    if expert_map is not None:
        local = expert_map[topk_ids.long()] >= 0
        input = torch.where(local[..., None], input, torch.zeros((), dtype=input.dtype, device=input.device))
    output.copy_(input.sum(dim=1).to(output.dtype))


def _fused_kda_decode(x, weight, bias, conv_state, raw_g, raw_beta, A_log, dt_bias, state_indices, state, out,
                      lower_bound=None, output_gate=None, norm_weight=None, norm_eps=1e-5) -> None:
    """vLLM's native KDA decode, one token a row (x [T, 3P], weight width-major [3, width,
    P], conv_state [S, 3P, width - 1] as vLLM hands it, raw_g / out [1, T, H, D]): the
    conv update (silu), gates, delta rule and sigmoid-gated RMSNorm its Triton group
    computes, as stock's ``kimi::kda_decode`` on the same caches."""
    if bias is not None or output_gate is None or norm_weight is None:
        raise NotImplementedError("the stand-in takes K3's native decode call (no conv bias, gated norm)")
    from .stock.library import REFERENCES

    T, P = x.shape[0], raw_g.shape[-2] * raw_g.shape[-1]
    y = REFERENCES[torch.ops.kimi.kda_decode.default](
        x, raw_g.reshape(T, P), output_gate.reshape(T, P), raw_beta.reshape(T, -1),
        weight.transpose(1, 2).reshape(-1, 1, weight.shape[1]), A_log, dt_bias, norm_weight, conv_state.transpose(1, 2),
        state, state_indices[:, None], torch.ones_like(state_indices), lower_bound, norm_eps)
    out.copy_(y.view(out.shape))


@_shim("native KDA decode", "with build(kda_decode='native') the KDA layers take vLLM's native decode (what its "
       "CUDA build runs on SM90 at 12 heads): _C::fused_kda_decode under its own schema (stand-in: stock's KDA "
       "decode on the same caches) and vLLM's backend choice returning 'native' when asked for it (the CPU "
       "platform has no SM90 capability)", devices=("cpu",))
def _native_kda_decode() -> None:
    from vllm.models.kimi_k3.nvidia import kda

    _define("_C::fused_kda_decode",
            "(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_state, Tensor raw_g, Tensor raw_beta, "
            "Tensor A_log, Tensor dt_bias, Tensor state_indices, Tensor(b!) state, Tensor(c!) out, "
            "float? lower_bound=None, Tensor? output_gate=None, Tensor? norm_weight=None, float norm_eps=1e-5) -> ()",
            _fused_kda_decode)
    plain = kda.resolve_kda_decode_backend

    def resolve(backend: str, *args: Any) -> str:
        return "native" if backend == "native" else plain(backend, *args)

    kda.resolve_kda_decode_backend = resolve


@_shim("_C/_moe_C stand-ins", "implementations (+ fake kernels) under vLLM's names for the extension ops K3's decode "
       "reaches, capturable in CUDA graphs: _C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert, "
       "_C::mla_decode_kvcache (the CPU MLA backend's forward_mqa kernel: the reference loop on the CPU, vLLM's "
       "Triton MLA kernels on CUDA, 'MLA decode on CUDA'), _C::situ_and_mul, _moe_C::moe_align_block_size, "
       "_moe_C::moe_sum")
def _extension_standins() -> None:
    _define("_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert",
            "(Tensor ql_nope, Tensor q_pe, Tensor kv_c_normed, Tensor k_pe, Tensor(a!) mqa_q, Tensor(b!) kv_cache, "
            "Tensor slot_mapping, int block_size, Tensor? positions=None, Tensor? cos_sin_cache=None) -> ()",
            _mla_q_concat_cache_insert)
    _define("_C::mla_decode_kvcache",
            "(Tensor(a!) out, Tensor query, Tensor kv_cache, float scale, Tensor block_tables, Tensor seq_lens) -> ()",
            _mla_decode_kvcache, _mla_decode_kvcache_triton)
    _define("_C::situ_and_mul", "(Tensor(a!) out, Tensor input, float beta, float linear_beta) -> ()",
            _situ_and_mul)
    _define("_moe_C::moe_align_block_size",
            "(Tensor topk_ids, int num_experts, int block_size, Tensor(a!) sorted_token_ids, "
            "Tensor(b!) experts_ids, Tensor(c!) num_tokens_post_pad, Tensor? maybe_expert_map=None, "
            "Tensor(d!)? maybe_scatter_idx=None) -> ()", _moe_align_block_size)
    _define("_moe_C::moe_sum", "(Tensor input, Tensor(a!) output, Tensor? topk_ids=None, Tensor? expert_map=None) -> ()",
            _moe_sum)


SHIM_DEVICES["MLA decode on CUDA"] = ("cuda",)
SHIMS["MLA decode on CUDA"] = (
    "vLLM's CPU MLA backend (the one its CPU platform selects, AttentionConfig(backend=CPU_MLA) so that no AMX host "
    "picks AMX_MLA) decodes with _C::mla_decode_kvcache; on CUDA its stand-in runs vLLM's Triton MLA decode kernels "
    "(decode_attention_fwd, as the TRITON_MLA backend launches them; FLASH_ATTN_MLA, SM90's default, is a CUDA "
    "extension)")


# ------------------------------------------------------------------------ checkpoint
# vLLM's MLA metadata builders and decode kernels take only DeepSeek's latent head
# (kv_lora_rank 512 + rope 64 = 576, block size 16), so the tiny vLLM model uses it.
MLA_DIMS = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
BLOCK_SIZE = 16


def config_for(preset: str = "tiny", layers: int | None = None):
    """Our replica's config for ``preset`` with the MLA latent vLLM's CPU path needs;
    ``layers``: keep the first ``layers`` layers, with K3's schedule for that depth
    (attention every 4th layer and the last; 5 layers: KDA 0-2, MLA 3-4, dense layer 0,
    two AttnRes blocks)."""
    from .stock import KimiK3Config
    from .stock.config import _schedule

    config = KimiK3Config.preset(preset).replace(**MLA_DIMS)
    if layers is not None:
        kda, full = _schedule(layers)
        attn = {**config.linear_attn_config, "kda_layers": kda, "full_attn_layers": full}
        dsa = None if config.dsa_config is None else {**config.dsa_config, "dsa_layers": full}
        config = config.replace(num_hidden_layers=layers, linear_attn_config=attn, dsa_config=dsa)
    return config


@functools.cache
def checkpoint(preset: str = "tiny", seed: int = 0, layers: int | None = None, experts: str = "bf16") -> Path:
    """A checkpoint folder (config.json + model.safetensors) of our replica's random
    weights for ``config_for(preset, layers)``, written once per process. ``experts``:
    "bf16", or "mxfp4" (routed experts as ``weight_packed`` + ``weight_scale``; the
    config's ``quantization_config`` names vLLM's ``mxfp4`` quant method)."""
    from .stock.checkpoint import random_checkpoint, save_checkpoint

    config = config_for(preset, layers)
    tensors = random_checkpoint(config, seed, experts)
    if experts == "mxfp4":
        config = config.replace(extra={**config.extra, "quantization_config": {"quant_method": "mxfp4"}})
    path = Path(tempfile.mkdtemp(prefix=f"kimi-vllm-{preset}-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    save_checkpoint(path, config, tensors)
    return path


# ----------------------------------------------------------------------------- build
def vllm_config_for(path: str | Path, tp: int = 1, max_model_len: int = 256, dp: int = 1, dp_rank: int = 0,
                    kda_decode: str = "auto"):
    """A ``VllmConfig`` for the checkpoint at ``path``: TP ``tp``, PP 1, expert parallel
    on (with DP > 1 this is the layout that runs K3 sequence-parallel on H200; ``dp`` /
    ``dp_rank``: one DP engine's view of ``-dp dp``), bf16,
    prefix caching off, eager (vLLM compiles nothing itself; ``capture`` does), the CPU
    platform's MLA backend (CPU_MLA; its decode op runs vLLM's Triton MLA kernels on
    CUDA, ``SHIMS``). The device config stays the CPU platform's even when the model
    is built on CUDA (``build``). MoE
    backend: H200's unquantized one (triton) for bf16 experts, emulation for MXFP4 ones
    (the backend that keeps their checkpoint layout). ``kda_decode``: vLLM's KDA decode
    backend (``additional_config["kda_decode_backend"]``; "native": SM90's, ``SHIMS``)."""
    from vllm.config import (AttentionConfig, CacheConfig, CompilationConfig, DeviceConfig, KernelConfig,
                             ModelConfig, ParallelConfig, VllmConfig)
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    model_config = ModelConfig(model=str(path), skip_tokenizer_init=True, max_model_len=max_model_len,
                               dtype="bfloat16")
    return VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, data_parallel_rank=dp_rank,
                                       enable_expert_parallel=True),
        cache_config=CacheConfig(enable_prefix_caching=False, mamba_cache_mode="none", block_size=BLOCK_SIZE),
        compilation_config=CompilationConfig(mode=0),
        attention_config=AttentionConfig(backend=AttentionBackendEnum.CPU_MLA),  # not AMX_MLA on an AMX host
        kernel_config=KernelConfig(moe_backend="emulation" if model_config.quantization == "mxfp4" else "triton"),
        additional_config={"kda_decode_backend": kda_decode})


def _cuda_environment() -> None:
    """Undo what the CPU platform's config check put in the environment that CUDA does
    not: ``VLLM_SSM_CONV_STATE_LAYOUT=SD`` (the default layout anyway; set, it makes
    every KDA forward log once, which Dynamo cannot trace)."""
    from vllm.model_executor.layers.mamba import mamba_utils

    if os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT") == "SD":
        del os.environ["VLLM_SSM_CONV_STATE_LAYOUT"]
        mamba_utils.get_conv_state_layout.cache_clear()


SHIMS["conv state layout env"] = ("the CPU platform sets VLLM_SSM_CONV_STATE_LAYOUT=SD (the default); unset again, "
                                  "as on CUDA, since with it set every KDA forward logs (a Dynamo graph break)")


def _init_distributed(vllm_config, tp: int, rank: int, group: str, sp: bool) -> None:
    import torch.distributed as dist
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed import parallel_state

    dp = vllm_config.parallel_config.data_parallel_size
    local_rank = rank
    if group == "gloo":
        if not dist.is_initialized() or dist.get_world_size() != tp * dp:
            raise RuntimeError(f"group='gloo' needs torch.distributed initialised with {tp * dp} ranks (run_ranks)")
        # with DP > 1 vLLM takes the rank in its TP group and places it by its DP rank itself
        local_rank = dist.get_rank()
        rank = local_rank % tp if dp > 1 else local_rank
    elif group == "fake":  # single-replica only: build refuses data parallelism off gloo
        if dist.is_initialized():
            raise RuntimeError("group='fake' starts its own fake process group; torch.distributed is initialised")
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=tp)
    else:
        raise ValueError(f"group must be 'fake' or 'gloo', got {group!r}")
    backend = dist.get_backend()
    with _fake_subgroups(group == "fake"):
        if parallel_state._WORLD is None:
            init_distributed_environment(world_size=tp, rank=rank, local_rank=local_rank, backend=backend)
        initialize_model_parallel(tensor_model_parallel_size=tp, backend=backend)
        if sp and tp > 1 and dp == 1:
            _ep_all2all()


def _ep_all2all() -> None:
    """The EP group's all-gather / reduce-scatter dispatcher, which vLLM creates when its
    config has DP > 1 (``ParallelConfig.use_all2all``). The DP replicas themselves are
    not simulated: EP spans the TP ranks."""
    from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager
    from vllm.distributed.parallel_state import get_ep_group

    communicator = get_ep_group().device_communicator
    if communicator is not None and communicator.all2all_manager is None:
        communicator.all2all_manager = AgRsAll2AllManager(get_ep_group().cpu_group)


@contextlib.contextmanager
def _fake_subgroups(active: bool) -> Iterator[None]:
    """In a fake world, vLLM's gloo CPU groups and shared-memory broadcaster are fake too."""
    if not active:
        yield
        return
    import torch.distributed as dist
    from vllm.distributed.device_communicators import shm_broadcast

    new_group, create = dist.new_group, shm_broadcast.MessageQueue.create_from_process_group

    def fake_new_group(*args: Any, **kwargs: Any):
        kwargs["backend"] = "fake"
        return new_group(*args, **kwargs)

    dist.new_group = fake_new_group
    shm_broadcast.MessageQueue.create_from_process_group = staticmethod(lambda *a, **k: None)
    try:
        yield
    finally:
        dist.new_group = new_group
        shm_broadcast.MessageQueue.create_from_process_group = create


def build(tp: int = 1, rank: int = 0, sp: bool = True, group: str = "fake", preset: str = "tiny",
          layers: int | None = None, seed: int = 0, experts: str = "bf16", device: str = "cpu",
          weights: tuple[Any, dict[str, torch.Tensor]] | None = None, max_model_len: int = 256, dp: int = 1,
          kda_decode: str = "auto"):
    """``(vllm_config, model)``: vLLM's ``KimiLinearForCausalLM`` (its backbone is
    ``model.model``, a ``KimiLinearModel``) on this rank, with our replica's random
    weights for ``preset`` loaded through vLLM's ``load_weights``, and its caches bound.

    ``sp``: at TP > 1, build in vLLM's sequence-parallel layout (PP 1, EP on and DP 2
    while the layers are constructed, which is what makes vLLM choose SP without
    MegaMoE); otherwise plain TP. ``group``: ``"fake"`` starts a fake process group of
    ``tp`` ranks (capture only) as ``rank``; ``"gloo"`` uses the caller's world.
    ``experts``: as ``checkpoint`` (MXFP4 ones run on vLLM's emulation MoE backend).
    ``device``: where the model's tensors live ("cpu", or "cuda": ``install``). ``dp``:
    ``-dp dp`` with EP over all tp x dp gloo ranks (rank i is rank i % tp of DP replica
    i // tp, as vLLM orders them; vLLM builds its TP, DP and EP groups and the EP
    dispatcher itself; each replica decodes its own batch, of the same rows).
    ``weights``: ``(config, tensors)`` loaded instead of the preset's random checkpoint
    (e.g. drawn on the GPU; only the config is written to disk, for vLLM's
    ``ModelConfig``). ``max_model_len``: vLLM's, at least the longest context decoded.
    ``kda_decode``: vLLM's KDA decode backend ("native": its SM90 op, CPU only). Once per
    process (vLLM's distributed state and layer registry are global)."""
    install(device)
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    from .stock.checkpoint import load_checkpoint
    from . import vllm_k3

    tensors = None
    if weights is None:
        path = checkpoint(preset, seed, layers, experts)
    else:
        from .stock.checkpoint import save_checkpoint

        config, tensors = weights
        path = Path(tempfile.mkdtemp(prefix="kimi-vllm-config-"))
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        save_checkpoint(path, config.replace(**MLA_DIMS), {})
    if dp > 1:
        import torch.distributed as dist

        if not (sp and tp > 1 and group == "gloo" and dist.is_initialized()):
            raise ValueError(f"dp={dp} needs the SP layout at TP > 1 on gloo ranks (run_ranks with tp x dp ranks)")
        vllm_config = vllm_config_for(path, tp, max_model_len, dp, dist.get_rank() // tp, kda_decode)
    else:
        vllm_config = vllm_config_for(path, tp, max_model_len, kda_decode=kda_decode)
    _cuda_environment()
    with set_current_vllm_config(vllm_config):
        _init_distributed(vllm_config, tp, rank, group, sp)
        parallel = vllm_config.parallel_config
        dp = parallel.data_parallel_size
        if sp and tp > 1 and dp == 1:
            parallel.data_parallel_size = 2
        try:
            with set_default_torch_dtype(torch.bfloat16), torch.device(device):
                model = vllm_k3.KimiLinearForCausalLM(vllm_config=vllm_config)
        finally:
            parallel.data_parallel_size = dp
        if tensors is None:
            _, tensors = load_checkpoint(path)
        loaded = model.load_weights(iter(tensors.items()))
        missing = {n for n, _ in model.named_parameters()} - set(loaded)
        if missing:
            raise RuntimeError(f"vLLM's load_weights left {len(missing)} parameters unloaded: {sorted(missing)[:5]}")
        process_weights_after_loading(model, vllm_config.model_config, torch.device(device))
    vllm_k3._drop_aux_streams(model.model)  # a CUDA build made real streams: compiled fullgraph, they run in order
    model.eval()
    return vllm_config, model


# --------------------------------------------------------------------------- decode
def _layers(vllm_config) -> dict[str, Any]:
    """vLLM's attention layers by name (KDA and MLA), from its static forward context
    (which also holds the MoE runners that ``moe_forward`` looks up by name)."""
    from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention

    return {name: layer for name, layer in vllm_config.compilation_config.static_forward_context.items()
            if isinstance(layer, (KimiK3DeltaAttention, MultiHeadLatentAttention))}


def _is_kda(layer: Any) -> bool:
    from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention

    return isinstance(layer, KimiK3DeltaAttention)


@dataclass
class DecodeBatch:
    """A fixed batch of decoding requests plus CUDA-graph padding rows, stepped like
    vLLM's runner steps it (prefill is out of scope: the caches start empty, or at
    ``start`` tokens of context with seeded random contents).

    Request r owns KDA state slot ``1 + r`` and MLA blocks ``1 + r * blocks_per_request
    ...`` (slot and block 0 are vLLM's null block); a padding row has no request: it is
    beyond ``num_actual_tokens``, its MLA slot is ``PAD_SLOT_ID`` and
    ``forward_context.is_padding`` marks it (the MoE skips it)."""

    requests: int
    padding: int
    vocab: int
    max_context: int
    seed: int = 0
    device: str = "cpu"
    start: int = 0  # every request's context at the first step
    context: torch.Tensor = field(init=False)
    gen: torch.Generator = field(init=False)
    caches: dict[str, Any] = field(init=False, default_factory=dict)  # layer name -> bound cache tensor(s)

    def __post_init__(self) -> None:
        self.context = torch.full((self.requests,), self.start, dtype=torch.int64)
        self.gen = torch.Generator().manual_seed(self.seed)

    @property
    def rows(self) -> int:
        return self.requests + self.padding

    @property
    def blocks_per_request(self) -> int:
        return -(-self.max_context // BLOCK_SIZE)

    @property
    def num_blocks(self) -> int:
        return 1 + self.requests * self.blocks_per_request

    @property
    def num_slots(self) -> int:
        return 1 + self.requests


@dataclass
class Step:
    """One decode step's inputs and vLLM metadata (``forward_context`` sets them)."""

    input_ids: torch.Tensor  # [rows]
    positions: torch.Tensor  # [rows]
    attn_metadata: dict[str, Any]  # layer name -> vLLM metadata from its own builders
    slot_mapping: dict[str, torch.Tensor]  # MLA layer name -> [rows] (PAD_SLOT_ID on padding)
    is_padding: torch.Tensor  # [rows] bool
    num_actual_tokens: int


def allocate_caches(model, vllm_config, batch: DecodeBatch) -> dict[str, Any]:
    """Zeroed caches for every attention layer, bound by the layers' own
    ``bind_kv_cache``: MLA's [blocks, 1, block_size, kv_lora_rank + rope] latent pages,
    KDA's [slots, 1, 1, bytes] int8 pages holding the conv state, then the recurrent
    state (``vllm_k3.PagedKDA`` views them when read)."""
    from math import prod

    caches: dict[str, torch.Tensor] = {}
    for name, layer in _layers(vllm_config).items():
        if _is_kda(layer):  # one int8 page per state slot holding both states, bound by vLLM's code
            shapes, dtypes = layer.get_state_shape(), layer.get_state_dtype()
            size = sum(prod(s) * torch.empty(0, dtype=d).element_size() for s, d in zip(shapes, dtypes))
            raw = torch.zeros(batch.num_slots, 1, 1, size, dtype=torch.int8, device=batch.device)
            layer.bind_kv_cache(raw)
            caches[name] = [raw]
        else:
            raw = torch.zeros(batch.num_blocks, 1, BLOCK_SIZE, layer.head_size, dtype=torch.bfloat16,
                              device=batch.device)
            layer.bind_kv_cache(raw)
            caches[name] = raw
    return caches


def decode_batch(model, vllm_config, rows: int = 3, padding: int = 1, max_context: int = 64,
                 seed: int = 0, device: str = "cpu", context: int = 0) -> DecodeBatch:
    """A ``DecodeBatch`` of ``rows`` live requests and ``padding`` padding rows, with the
    model's caches allocated on ``device`` and bound for it: zeroed, or with ``context``
    tokens of every request already there (``fill``)."""
    if context >= max_context:
        raise ValueError(f"context {context} leaves no room for a step in max_context {max_context}")
    batch = DecodeBatch(rows, padding, vllm_config.model_config.hf_text_config.vocab_size, max_context, seed,
                        str(device), context)
    batch.caches = allocate_caches(model, vllm_config, batch)
    fill(vllm_config, batch)
    return batch


def fill(vllm_config, batch: DecodeBatch) -> None:
    """Seeded contents for caches that hold ``batch.start`` tokens of context (nothing
    to do at 0): every MLA latent row standard normal (bf16), every KDA conv state
    standard normal (bf16) and recurrent state 0.1 x standard normal (fp32), each
    written through the layer's own views of its page."""
    if batch.start == 0:
        return
    gen = torch.Generator(device=batch.device).manual_seed(batch.seed + 1)
    for name, layer in _layers(vllm_config).items():
        for i, t in enumerate(layer.kv_cache if _is_kda(layer) else [batch.caches[name]]):
            scale = 0.1 if _is_kda(layer) and i == 1 else 1.0
            t.copy_((torch.randn(t.shape, generator=gen, device=batch.device) * scale).to(t.dtype))


def restart(batch: DecodeBatch, vllm_config=None) -> None:
    """Back to the first step: caches zeroed (in place: a compiled graph keeps reading
    the same tensors) and, for a batch that starts at a context, filled again as at the
    start (``vllm_config`` needed then); contexts and token ids as at the start."""
    for cache in batch.caches.values():
        for t in cache if isinstance(cache, list) else [cache]:
            t.zero_()
    if batch.start:
        if vllm_config is None:
            raise ValueError("restart of a batch with a starting context needs its vllm_config (to refill)")
        fill(vllm_config, batch)
    batch.__post_init__()


def next_step(vllm_config, batch: DecodeBatch) -> Step:
    """The next decode step of ``batch``: token ids (seeded), positions, and metadata from
    vLLM's own builders (``KimiK3KDAMetadataBuilder`` for KDA, the MLA backend's builder
    for MLA) over a ``CommonAttentionMetadata`` per KV-cache group, on the batch's device
    (the metadata's CPU copies on the CPU). Advances the batch (every request accepts its
    token)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID

    R, T = batch.requests, batch.rows
    ctx = batch.context
    ids = torch.randint(0, batch.vocab, (T,), generator=batch.gen)
    ids[R:] = 0
    positions = torch.zeros(T, dtype=torch.int64)
    positions[:R] = ctx
    live = torch.arange(R)
    table = (1 + live[:, None] * batch.blocks_per_request + torch.arange(batch.blocks_per_request)).int()
    slots = torch.full((T,), PAD_SLOT_ID, dtype=torch.int64)
    slots[:R] = table.long().gather(1, (ctx // BLOCK_SIZE)[:, None])[:, 0] * BLOCK_SIZE + ctx % BLOCK_SIZE
    seq_lens = (ctx + 1).int()
    qsl = torch.arange(R + 1, dtype=torch.int32)
    dev = functools.partial(torch.Tensor.to, device=batch.device)

    def common(block_table: torch.Tensor, slot_mapping: torch.Tensor) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            query_start_loc=dev(qsl), query_start_loc_cpu=qsl.clone(), seq_lens=dev(seq_lens), num_reqs=R,
            num_actual_tokens=R, max_query_len=1, max_seq_len=int(seq_lens.max()),
            block_table_tensor=dev(block_table), slot_mapping=dev(slot_mapping), positions=dev(positions[:R]),
            seq_lens_cpu_upper_bound=seq_lens.clone(), is_prefilling=torch.zeros(R, dtype=torch.bool))

    kda_common = common((1 + live[:, None]).int(), (1 + live).long())
    mla_common = common(table, slots[:R])
    metadata, slot_mapping = {}, {}
    for name, builder in _builders(vllm_config, batch.device).items():
        is_kda = _is_kda(_layers(vllm_config)[name])
        metadata[name] = builder.build(0, kda_common if is_kda else mla_common)
        if not is_kda:
            slot_mapping[name] = dev(slots)
    is_padding = torch.zeros(T, dtype=torch.bool)
    is_padding[R:] = True
    batch.context = ctx + 1
    return Step(dev(ids), dev(positions), metadata, slot_mapping, dev(is_padding), R)


def _builders(vllm_config, device: str = "cpu") -> dict[str, Any]:
    """One metadata builder per layer (vLLM builds one per KV-cache group; the metadata
    is the same), created once per config (for one device)."""
    cache = vllm_config.__dict__.setdefault("_kimi_cpu_builders", {})
    if not cache:
        for name, layer in _layers(vllm_config).items():
            spec = layer.get_kv_cache_spec(vllm_config)
            cls = layer.get_attn_backend().get_builder_cls()
            cache[name] = cls(spec, [name], vllm_config, torch.device(device))
    return cache


@contextlib.contextmanager
def forward_context(vllm_config, step: Step) -> Iterator[None]:
    """vLLM's forward context for ``step`` (attention metadata and slot mapping by
    layer, the padding mask), with ``vllm_config`` current."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    with set_current_vllm_config(vllm_config), set_forward_context(
            step.attn_metadata, vllm_config, num_tokens=len(step.input_ids), slot_mapping=step.slot_mapping,
            is_padding=step.is_padding):
        yield


def eager_step(model, vllm_config, step: Step) -> torch.Tensor:
    """vLLM's backbone forward for ``step``, eagerly, as vLLM runs it: pre-norm hidden
    states [rows, hidden] (the padding rows hold whatever vLLM leaves there)."""
    with torch.no_grad(), forward_context(vllm_config, step):
        return model.model(step.input_ids, step.positions, None)


# --------------------------------------------------------------------------- capture
class _Recorder:
    """An Inductor post-grad custom pass that records the graph it is handed: the
    graph ``KimiPasses`` sees when ``kimi_specialized`` compiles (backend.py)."""

    def __init__(self, on_graph: Callable[[fx.GraphModule], None] | None):
        self.graphs: list[fx.GraphModule] = []
        self.on_graph = on_graph

    def __call__(self, graph: fx.Graph) -> None:
        copy = fx.Graph()
        copy.output(copy.graph_copy(graph, {}))
        gm = fx.GraphModule(graph.owning_module, copy)  # Inductor rewrites the graph it was handed later on
        self.graphs.append(gm)
        if self.on_graph is not None:
            self.on_graph(gm)

    def uuid(self) -> str:
        return f"kimi-vllm-cpu-recorder-{id(self)}"


def _capture_backend(recorder: _Recorder) -> Callable:
    """Dynamo backend: AOTAutograd and Inductor's post-grad passes (``recorder`` as the
    custom post pass, where ``kimi_specialized`` runs ``KimiPasses``), then the
    post-grad graph runs as is (no code generation), so the capture also runs."""
    from torch._inductor.compile_fx import compile_fx

    from .backend import _eager_inner

    def backend(gm: fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.custom_graph_pass import CustomGraphPass

        class Pass(CustomGraphPass):
            def __call__(self, graph: fx.Graph) -> None:
                recorder(graph)

            def uuid(self) -> str:
                return recorder.uuid()

        return compile_fx(gm, example_inputs, inner_compile=_eager_inner,
                          config_patches={"post_grad_custom_post_pass": Pass(), "fx_graph_cache": False})

    return backend


@dataclass
class Compiled:
    """vLLM's backbone compiled with ``torch.compile(fullgraph=True, dynamic=False)``:
    call ``step(vllm_config, step)``; ``graphs`` holds the post-grad graphs recorded
    (``backend="capture"``), ``backend`` the backend object or name."""

    fn: Callable
    backend: Any
    graphs: list[fx.GraphModule] = field(default_factory=list)
    inductor_config: dict[str, Any] = field(default_factory=dict)

    def step(self, vllm_config, step: Step) -> torch.Tensor:
        with torch.no_grad(), forward_context(vllm_config, step), torch._inductor.config.patch(self.inductor_config):
            return self.fn(step.input_ids, step.positions, None)


def compile_backbone(model, backend: str | Callable = "capture", options: dict[str, Any] | None = None,
                     on_graph: Callable[[fx.GraphModule], None] | None = None,
                     inductor_config: dict[str, Any] | None = None) -> Compiled:
    """Compile ``model.model`` (vLLM's ``KimiLinearModel``) with fullgraph Dynamo,
    ``dynamic=False``.

    ``backend="capture"``: AOTAutograd + Inductor's post-grad passes with a recorder as
    the post-grad custom pass (``on_graph`` is called with each graph); the graph then
    runs without code generation. ``backend="kimi_specialized"``: our backend with
    ``options`` (e.g. ``{"compiler": "eager"}``); any other Dynamo backend as given.
    ``inductor_config``: ``torch._inductor.config`` patched while compiling and running
    (``{"pattern_matcher": False}`` keeps Inductor's own rewrites, such as mm + add ->
    addmm, out of a bitwise comparison). Compilation happens at the first ``step``."""
    torch._dynamo.reset()
    _prefill_kernel_arg_names()
    graphs: list[fx.GraphModule] = []
    if backend == "capture":
        recorder = _Recorder(on_graph)
        graphs = recorder.graphs
        backend = _capture_backend(recorder)
        fn = torch.compile(model.model, backend=backend, fullgraph=True, dynamic=False)
    elif backend == "kimi_specialized":
        from .backend import KimiSpecialized

        backend = KimiSpecialized(options)
        fn = torch.compile(model.model, backend=backend, fullgraph=True, dynamic=False)
    else:
        fn = torch.compile(model.model, backend=backend, fullgraph=True, dynamic=False, options=options)
    return Compiled(fn, backend, graphs, dict(inductor_config or {}))


def capture(model, vllm_config, step: Step, on_graph: Callable[[fx.GraphModule], None] | None = None
            ) -> tuple[list[fx.GraphModule], torch.Tensor]:
    """Compile vLLM's backbone for ``step`` and run it once: (post-grad graphs as our
    passes see them, the step's hidden states)."""
    compiled = compile_backbone(model, "capture", on_graph=on_graph)
    out = compiled.step(vllm_config, step)
    return compiled.graphs, out


# --------------------------------------------------------------------------- checks
def op_counts(gm: fx.GraphModule) -> dict[str, int]:
    """Calls in a captured graph by name: ``call_function`` targets as ``str(target)``
    (``vllm.all_gather.default``, ``vllm.moe_forward_shared.default``, ...), plus
    ``triton:<module>.<kernel>`` per Triton launch (the kernel from Dynamo's side table)
    and ``functionalized:<op>`` per mutating op behind ``auto_functionalized_v2``."""
    from collections import Counter

    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    counts: Counter[str] = Counter()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        counts[str(node.target)] += 1
        if "triton_kernel_wrapper" in str(node.target):
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            fn = getattr(kernel, "fn", kernel)
            counts[f"triton:{fn.__module__}.{fn.__qualname__}"] += 1
        elif "auto_functionalized" in str(node.target):
            counts[f"functionalized:{node.args[0]._schema.name}"] += 1
    return dict(counts)


def weight_mismatches(model, preset: str = "tiny", layers: int | None = None, seed: int = 0) -> list[str]:
    """Parameters of vLLM's model (TP 1) that differ from our replica's built from the
    same checkpoint (names as vLLM's, its ``experts.routed_experts.`` as our
    ``experts.``); parameters only one side has (vLLM's absorbed MLA weights and scales,
    for one) are not compared."""
    from .stock.checkpoint import build_model, load_checkpoint

    config, tensors = load_checkpoint(checkpoint(preset, seed, layers))
    ours = dict(build_model(config, tensors).named_parameters())
    bad = []
    for name, theirs in model.named_parameters():
        mine = ours.get(name.replace(".experts.routed_experts.", ".experts."))
        if mine is not None and (mine.shape != theirs.shape or not torch.equal(mine.to(theirs.dtype), theirs)):
            bad.append(name)
    compared = sum(n.replace(".experts.routed_experts.", ".experts.") in ours for n, _ in model.named_parameters())
    if compared < len(ours):
        bad.append(f"only {compared} of our {len(ours)} parameters have a vLLM counterpart")
    return bad
