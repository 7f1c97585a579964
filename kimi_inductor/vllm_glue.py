"""vLLM glue: the general plugin and the post-grad pass adapter (docs/vllm.md).

Importing this module imports vLLM; everything else in kimi_inductor works without it.

* ``plugin()`` is our ``vllm.general_plugins`` entry point: vLLM runs it in every
  process before the model loads. It registers the ``kimi_specialized`` Dynamo backend
  (so ``compilation_config={"mode": 1 or 2, "backend": "kimi_specialized"}`` resolves
  it by name) and publishes ``kimi_inductor.kimi_pass``. It is idempotent.
* ``KimiInductorPass`` is a vLLM ``InductorPass`` running our pass manager, for
  ``compilation_config={"inductor_compile_config": {"post_grad_custom_post_pass":
  KimiInductorPass()}}`` in mode 3. It holds only plain options (vLLM deep-copies the
  config), takes its options from ``additional_config["kimi_inductor"]`` of the
  current vLLM config when given none, and its ``uuid`` covers our sources and options.
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import fx
from vllm.compilation.passes.inductor_pass import InductorPass

from .config import Options, options_from_vllm
from .passes.manager import KimiPasses
from .passes.report import MatchReport


def current_vllm_options() -> Options | None:
    """Options from the current vLLM config's ``additional_config``, if one is set."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return None if config is None else options_from_vllm(config)


def plugin() -> None:
    """The ``vllm.general_plugins`` entry point (runs in every vLLM process, early).

    Registers the ``kimi_specialized`` Dynamo backend, and puts a pass instance at
    ``kimi_inductor.kimi_pass`` so that the JSON/CLI form
    ``{"inductor_passes": {"post_grad_custom_post_pass": "kimi_inductor.kimi_pass"}}``
    resolves (vLLM looks the name up in the package's ``__dict__``)."""
    import kimi_inductor

    kimi_inductor.register()
    if not isinstance(kimi_inductor.__dict__.get("kimi_pass"), KimiInductorPass):
        kimi_inductor.kimi_pass = KimiInductorPass()


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
