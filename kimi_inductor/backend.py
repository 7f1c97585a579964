"""The ``kimi_specialized`` torch.compile backend.

    torch.compile(model, backend="kimi_specialized", options={...})

resolves through the ``torch_dynamo_backends`` entry point, with no import of this
package needed. The entry point is the plain function ``kimi_specialized``; nothing
here registers that name at import time (that would make the entry-point lookup
register it twice). ``kimi_inductor.register()`` registers it for source-tree use.

A graph is compiled by Inductor with our passes as its post-grad custom pass
(``passes.manager.KimiPasses``); ``compiler="eager"`` runs the same post-grad
pipeline and then executes the rewritten graph as is (no code generation). A graph
that holds no Kimi K3 decoder passes through the same compiler unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import fx

from .config import Options
from .passes.manager import KimiPasses, Observer
from .passes.report import MatchReport


class KimiSpecialized:
    """A backend object; ``reports`` holds one ``MatchReport`` per compiled graph."""

    _shared: dict[str, "KimiSpecialized"] = {}

    def __init__(self, options: Options | Mapping[str, Any] | None = None, observer: Observer | None = None):
        self.options = Options.from_mapping(options)
        self.observer = observer  # called with ("before/after <pass>", graph) for every pass
        self.reports: list[MatchReport] = []

    @classmethod
    def for_options(cls, options: Mapping[str, Any] | None) -> "KimiSpecialized":
        """The backend object the string backend uses for these options."""
        opts = Options.from_mapping(options)
        return cls._shared.setdefault(opts.to_json(), cls(opts))

    def __call__(self, gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        report = MatchReport(graph=len(self.reports))
        patches = {"post_grad_custom_post_pass": KimiPasses(self.options, report, self.observer)}
        if self.options.compiler == "eager":
            compiled = compile_fx(gm, example_inputs, inner_compile=_eager_inner, config_patches=patches)
        else:
            compiled = compile_fx(gm, example_inputs, config_patches=patches)
        if not report.passes:
            report.reason = ("Inductor's FX graph cache returned this graph: the passes did not run again "
                             "(the cache key covers their source and options)")
        self.reports.append(report)  # only graphs that compiled (Dynamo may restart a compile)
        return compiled

    @property
    def report(self) -> MatchReport | None:
        return self.reports[-1] if self.reports else None


def _eager_inner(gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
    """Inductor's post-grad pipeline (with our passes), then run the graph eagerly."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.fx_passes.post_grad import post_grad_passes

    post_grad_passes(gm, kwargs.get("is_inference", True))
    gm.recompile()
    return make_boxed_func(gm.forward)


def kimi_specialized(gm: fx.GraphModule, example_inputs: list, options: Mapping[str, Any] | None = None,
                     mode: str | None = None) -> Callable:
    """The ``torch_dynamo_backends`` entry point."""
    return KimiSpecialized.for_options(options)(gm, example_inputs)


def match_report(compiled: torch.nn.Module | Callable) -> MatchReport | None:
    """The latest match report of a model compiled with ``kimi_specialized`` (by
    name or as a ``KimiSpecialized`` object); None for other backends."""
    obj, options = getattr(getattr(compiled, "dynamo_ctx", None), "callback", None), None
    for _ in range(16):  # Dynamo's wrappers: CatchErrors -> ConvertFrame -> debug -> compile wrapper
        if isinstance(obj, KimiSpecialized):
            return obj.report
        if obj is kimi_specialized:
            return KimiSpecialized.for_options(options).report
        if isinstance(getattr(obj, "kwargs", None), dict):
            options = obj.kwargs.get("options", options)
        obj = next((getattr(obj, a) for a in ("_torchdynamo_orig_backend", "compiler_fn", "_inner_convert")
                    if getattr(obj, a, obj) is not obj), None)
    return None
