"""vLLM glue: the general plugin and the post-grad pass adapter (docs/vllm.md).

Importing this module imports vLLM; everything else in kimi_inductor works without it.

* ``plugin()`` is our ``vllm.general_plugins`` entry point: vLLM runs it in every
  process before the model loads. It registers the ``kimi_specialized`` Dynamo backend
  (so ``compilation_config={"mode": 1 or 2, "backend": "kimi_specialized"}`` resolves
  it by name), points vLLM's registry for the K3
  architectures at ``kimi_inductor.vllm_k3`` (a compilable backbone, imported lazily
  when a K3 model loads) and keeps a deployment that asks for ``latency_specialized``
  off vLLM's breakable-CUDA-graph default (which would force compilation mode NONE).
  It is idempotent.
* ``KimiInductorPass`` is a vLLM ``InductorPass`` running our pass manager, for
  ``compilation_config={"inductor_compile_config": {"post_grad_custom_post_pass":
  KimiInductorPass()}}`` in mode 3. It holds only plain options (vLLM deep-copies the
  config), takes its options from ``additional_config["kimi_inductor"]`` of the
  current vLLM config when given none, and its ``uuid`` covers our sources and options.
* Importing this module publishes an instance as ``kimi_inductor.kimi_pass``, for the
  JSON / CLI form ``{"inductor_passes": {"post_grad_custom_post_pass":
  "kimi_inductor.vllm_glue.kimi_pass"}}``: vLLM resolves a qualname ``a.b.c`` as
  ``__import__("a.b").__dict__["c"]``, i.e. it imports this module, then looks the name
  up in the top package, and it does so while building the ``CompilationConfig``,
  before it loads plugins (so the plugin cannot be what publishes it).
"""

from __future__ import annotations

import sys
from typing import Any, Mapping

from torch import fx
from vllm.compilation.passes.inductor_pass import InductorPass

from .config import Options, decode_requested, options_from_vllm
from .passes.manager import KimiPasses
from .passes.report import MatchReport


def current_vllm_options() -> Options | None:
    """Options from the current vLLM config's ``additional_config``, if one is set."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return None if config is None else options_from_vllm(config)


def plugin() -> None:
    """The ``vllm.general_plugins`` entry point (runs in every vLLM process, early):
    registers the ``kimi_specialized`` Dynamo backend and the K3 architectures."""
    from vllm import ModelRegistry

    import kimi_inductor

    kimi_inductor.register()
    for arch in K3_ARCHITECTURES:
        ModelRegistry.register_model(arch, f"kimi_inductor.vllm_k3:{arch}")
    _keep_compilable()


K3_ARCHITECTURES = ("KimiLinearForCausalLM", "KimiK3ForConditionalGeneration")


def _keep_compilable() -> None:
    """``VllmConfig._uses_breakable_cudagraph_by_default`` is False for a K3 deployment
    that asks for ``latency_specialized`` (vLLM 0.33.0 lists K3 there, which sets
    compilation mode NONE); unchanged for every other deployment."""
    from vllm.config import VllmConfig

    stock = VllmConfig._uses_breakable_cudagraph_by_default
    if getattr(stock, "kimi_inductor", False):
        return

    def uses_breakable_cudagraph_by_default(self) -> bool:
        model = self.model_config
        if model is not None and set(model.architectures) & set(K3_ARCHITECTURES) and decode_requested(self):
            return False
        return stock(self)

    uses_breakable_cudagraph_by_default.kimi_inductor = True
    VllmConfig._uses_breakable_cudagraph_by_default = uses_breakable_cudagraph_by_default


class KimiInductorPass(InductorPass):
    """kimi_specialized's passes as one vLLM post-grad pass (mode 3)."""

    def __init__(self, options: Options | Mapping[str, Any] | None = None):
        self.options = None if options is None else Options.from_mapping(options)
        self.reports: list[MatchReport] = []

    def _resolved(self) -> Options:
        return self.options or current_vllm_options() or Options()

    def __call__(self, graph: fx.Graph) -> None:
        report = MatchReport(graph=len(self.reports))
        KimiPasses(self._resolved(), report)(graph)
        self.reports.append(report)

    def uuid(self) -> str:
        return KimiPasses(self._resolved(), MatchReport()).uuid().hex()


kimi_pass = KimiInductorPass()  # the instance the JSON / CLI form names, published where vLLM looks
sys.modules[__package__].kimi_pass = kimi_pass
