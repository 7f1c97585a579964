"""vLLM's Kimi K3 text model with a compilable backbone (vLLM imports this module for the
K3 architectures once our plugin has registered it: ``vllm_glue.plugin``).

vLLM 0.33.0 ships Kimi K3 without ``@support_torch_compile`` and on its breakable-CUDA-graph
list, which forces compilation mode NONE. Here its backbone, ``KimiLinearModel``, becomes a
``@support_torch_compile`` subclass whose compilation is enabled only when
``additional_config["kimi_inductor"]["decode_backend"]`` is ``latency_specialized``
(otherwise the module runs exactly as vLLM's). vLLM then compiles the backbone's forward
with the configured backend: ``kimi_specialized`` in mode 1 / 2, or Inductor with our
post-grad pass in mode 3. The architectures vLLM looks up are vLLM's own classes; they
build the backbone by its module-global name, which is replaced here. NVIDIA build only
(``vllm.models.kimi_k3.nvidia``).

What our passes find in that graph is vLLM's own spelling of the decoder's roles
(``passes/spellings/vllm.py``): they rewrite its SP layout into the hybrid step and say
per layer what each pass did (docs/vllm.md). Where vLLM's code is not traceable with
``fullgraph=True`` (MLA's non-contiguous ``bmm(out=)``, the aux CUDA streams), the
classes below compute the same values traceably.
"""

from __future__ import annotations

from math import prod

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.models.kimi_k3.nvidia import model as _k3
from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention as _KDA
from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention as _MLA

from .config import decode_requested


def _drop_aux_streams(backbone: nn.Module) -> None:
    """Run what vLLM overlaps on aux CUDA streams in order on the current stream."""
    for module in backbone.modules():
        if isinstance(module, _MLA):
            module.aux_stream = None  # gate GEMM: maybe_execute_in_parallel(..., None)
        elif isinstance(module, _k3.KimiMoE):
            module._down_proj_stream = None  # router and latent down-projection
        elif isinstance(module, _KDA):
            module._projection_aux_stream = None  # projection overlap (CUDA-graph capture only)
            module._projection_events = None


if not getattr(_k3.MultiHeadLatentAttention, "kimi_inductor", False):

    class TraceableMLA(_k3.MultiHeadLatentAttention):
        """vLLM's K3 MLA with an up-projection Dynamo can trace (same values)."""

        kimi_inductor = True

        def _v_up_proj(self, x: torch.Tensor, out: torch.Tensor) -> None:
            if not torch.compiler.is_compiling():
                return super()._v_up_proj(x, out)
            # (B, N, L) -> (N, B, L) x (N, L, V) -> (N, B, V), copied into out as (B, N, V)
            x = x.view(-1, self.num_local_heads, self.kv_lora_rank).transpose(0, 1)
            out = out.view(-1, self.num_local_heads, self.v_head_dim)
            out.copy_(torch.bmm(x, self.W_UV).transpose(0, 1))

    _k3.MultiHeadLatentAttention = TraceableMLA

if not getattr(_k3.KimiK3DeltaAttention, "kimi_inductor", False):

    class PagedKDA(_k3.KimiK3DeltaAttention):
        """vLLM's K3 KDA layer whose states are taken from their int8 page when read.

        vLLM binds a layer's conv (bf16) and recurrent (fp32) states as dtype views of one
        int8 page tensor (``MambaBase.bind_kv_cache``). Read as two module attributes they
        become two graph inputs mutated through views of one base with different dtypes,
        which AOTAutograd refuses. Here the page is the attribute and ``kv_cache`` slices
        and views it on every read (the same bytes, shapes and strides), so the graph
        takes the page and the views are graph ops, which functionalization handles."""

        kimi_inductor = True

        def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
            self._kv_pages = kv_cache.squeeze(dim=(1, 2))

        @property
        def kv_cache(self) -> tuple[torch.Tensor, ...]:
            pages = getattr(self, "_kv_pages", None)
            if pages is None:
                return getattr(self, "_kv_states", ())
            states, offset = [], 0
            for shape, dtype in zip(self.get_state_shape(), self.get_state_dtype()):
                nbytes = prod(shape) * torch.empty((), dtype=dtype).element_size()
                states.append(pages[:, offset:offset + nbytes].view(dtype).view(-1, *shape))
                offset += nbytes
            return tuple(states)

        @kv_cache.setter
        def kv_cache(self, states: tuple[torch.Tensor, ...]) -> None:  # bound state by state
            self._kv_pages, self._kv_states = None, states

    _k3.KimiK3DeltaAttention = PagedKDA

if not getattr(_k3.KimiLinearModel, "kimi_inductor", False):

    @support_torch_compile(enable_if=decode_requested)
    class KimiLinearModel(_k3.KimiLinearModel):
        """vLLM's K3 backbone, compiled when the deployment asks for kimi_specialized."""

        kimi_inductor = True

        def __init__(self, *, vllm_config, prefix: str = ""):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            if decode_requested(vllm_config) or not torch.cuda.is_available():
                _drop_aux_streams(self)

    _k3.KimiLinearModel = KimiLinearModel

KimiLinearForCausalLM = _k3.KimiLinearForCausalLM
KimiK3ForConditionalGeneration = _k3.KimiK3ForConditionalGeneration
