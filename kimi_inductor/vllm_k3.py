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

What our passes find in that graph is vLLM's, not our stock decoder's: vLLM's collective
ops are matched (``passes/collectives.py``), while its attention, KDA and MegaMoE calls are
vLLM's own ops, so the hybrid-step rewrite applies only where the graph uses the ops our
passes know; the report says per layer what matched and why not (docs/vllm.md).
"""

from __future__ import annotations

from vllm.compilation.decorators import support_torch_compile
from vllm.models.kimi_k3.nvidia import model as _k3

from .config import decode_requested

if not getattr(_k3.KimiLinearModel, "kimi_inductor", False):

    @support_torch_compile(enable_if=decode_requested)
    class KimiLinearModel(_k3.KimiLinearModel):
        """vLLM's K3 backbone, compiled when the deployment asks for kimi_specialized."""

        kimi_inductor = True

    _k3.KimiLinearModel = KimiLinearModel

KimiLinearForCausalLM = _k3.KimiLinearForCausalLM
KimiK3ForConditionalGeneration = _k3.KimiK3ForConditionalGeneration
