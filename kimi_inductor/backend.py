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

Options are validated when ``torch.compile`` is called (a ``ValueError`` naming the
key), not when the first frame compiles: importing this module (which resolving the
backend's name does) wraps ``torch._dynamo.eval_frame.get_compiler_fn`` so that it
checks a ``kimi_specialized`` backend's options before Dynamo wraps the model.
``strict=True`` raises ``MatchError`` (``from kimi_inductor import MatchError``) through
``torch.compile`` as itself, not wrapped in Dynamo's ``BackendCompilerFailed``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import fx
from torch._dynamo.exc import ShortenTraceback

from .artifact import CompiledGraph, copy_graph
from .by_size import BySize, row_argument
from .config import Options
from .passes.manager import KimiPasses, MatchError, Observer  # MatchError: also kimi_inductor.MatchError
from .passes.report import MatchReport

log = logging.getLogger(__name__)


class StrictMatchError(MatchError, ShortenTraceback):
    """The ``MatchError`` (a ``ValueError``) the backend raises under ``strict=True``.

    Dynamo re-raises its ``ShortenTraceback`` errors as they are instead of wrapping them
    in ``BackendCompilerFailed``, so ``except MatchError`` around the compiled call works."""

    def __init__(self, message: str):
        ShortenTraceback.__init__(self, message, first_useful_frame=None)


def _match_error(err: BaseException) -> MatchError | None:
    """The passes' MatchError behind ``err`` (Inductor may wrap what a post-grad pass raises)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, MatchError):
            return err
        seen.add(id(err))
        err = getattr(err, "inner_exception", None) or err.__cause__ or err.__context__
    return None


def _inductor_pdl() -> dict:
    """Inductor's own Triton kernels launch with programmatic dependent launch as ours do
    (its codegen takes it on SM90+ CUDA only): the small kernels between our ops then
    lose no launch gap either. Each waits before its first dependent read and lets the
    next kernel start only after that, like ``kernels.common.pdl_wait``."""
    from .kernels.common import pdl_allowed

    return {"triton.enable_pdl": True} if pdl_allowed() and hasattr(torch._inductor.config.triton, "enable_pdl") else {}


class KimiSpecialized:
    """A backend object; ``reports`` holds one ``MatchReport`` per compiled graph.
    ``torch.compile(m, backend="kimi_specialized")`` gets one of its own (so that
    ``match_report`` reads that model's reports); without options it takes vLLM's
    ``additional_config`` at its first compile, if a vLLM config is current."""

    _shared: dict[str, "KimiSpecialized"] = {}

    def __init__(self, options: Options | Mapping[str, Any] | None = None, observer: Observer | None = None,
                 options_from_vllm: bool = False):
        self.options = Options.from_mapping(options)
        self.observer = observer  # called with ("before/after <pass>", graph) for every pass
        self.reports: list[MatchReport] = []
        self._options_from_vllm = options_from_vllm

    @classmethod
    def for_options(cls, options: Options | Mapping[str, Any] | None) -> "KimiSpecialized":
        """The backend object the string backend uses for these options."""
        opts = Options.from_mapping(options)
        return cls._shared.setdefault(opts.to_json(), cls(opts))

    def __call__(self, gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> CompiledGraph:
        if self._options_from_vllm:
            self.options, self._options_from_vllm = _vllm_options() or self.options, False
        graph = CompiledGraph.of(None, gm, example_inputs, self.options.to_json())
        compiled, report = self._compile(gm, example_inputs)
        if report.per_size:  # a symbolic batch: compiled again at each capture size (by_size.py)
            where = row_argument(example_inputs, report.rows)
            if where is None:
                report.reason += f" -- not done: the batch symbol {report.rows} is none of the graph's arguments"
                if self.options.strict:
                    raise StrictMatchError(f"kimi_specialized (strict): {report.reason}")
                log.warning("kimi_specialized graph %d: %s", report.graph, report.reason)
            else:
                pristine = graph.graph
                compiled = BySize(compiled, lambda args: self._compile(copy_graph(pristine), args)[0], where,
                                  self.options.decode.capture_sizes)
        graph.compiled = compiled
        return graph

    def _compile(self, gm: fx.GraphModule, example_inputs: list) -> tuple[Callable, MatchReport]:
        from torch._inductor.compile_fx import compile_fx

        report = MatchReport(graph=len(self.reports))
        passes = KimiPasses(self.options, report, self.observer)
        key = _report_key(gm, example_inputs, passes)
        # shape_padding off: Inductor's pad_mm (CUDA, chosen by benchmark) re-spells a GEMM as
        # slice(mm(pad(x), pad(W))), which hides it from the passes (a vLLM KDA group's f_b)
        patches = {"post_grad_custom_post_pass": passes, "shape_padding": False, **_inductor_pdl()}
        try:
            if self.options.compiler == "eager":  # nothing for AOTAutograd's cache to keep: no output code
                with torch._functorch.config.patch(enable_autograd_cache=False):
                    compiled = compile_fx(gm, example_inputs, inner_compile=_eager_inner, config_patches=patches)
            else:
                compiled = compile_fx(gm, example_inputs, config_patches=patches)
        except Exception as err:
            found = _match_error(err)
            if found is None or isinstance(err, StrictMatchError):
                raise
            raise StrictMatchError(str(found)) from None
        if report.passes:
            _store_report(key, report)
        else:  # Inductor's FX graph cache returned the graph: the passes did not run
            report = _load_report(key, report.graph)
        self.reports.append(report)  # only graphs that compiled (Dynamo may restart a compile)
        return compiled, report

    @property
    def report(self) -> MatchReport | None:
        return self.reports[-1] if self.reports else None


def _report_path(key: str) -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "kimi_reports" / f"{key}.json"


def _report_key(gm: fx.GraphModule, example_inputs: list, passes: KimiPasses) -> str:
    """The report's identity: the Dynamo graph, its input types, our passes' uuid."""
    shapes = [(tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else str(x) for x in example_inputs]
    text = f"{gm.code}\n{shapes}".encode() + passes.uuid()
    return hashlib.sha256(text).hexdigest()[:32]


def _store_report(key: str, report: MatchReport) -> None:
    path = _report_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_dict()))


def _load_report(key: str, graph: int) -> MatchReport:
    """The report stored when this graph was compiled (Inductor's cache hit skips the passes)."""
    path = _report_path(key)
    if not path.exists():
        return MatchReport(graph=graph, reason="Inductor's FX graph cache returned this graph and no report was "
                                               "stored for it (the passes did not run)")
    report = MatchReport.from_dict(json.loads(path.read_text()))
    report.graph = graph
    return report


def _eager_inner(gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
    """Inductor's post-grad pipeline (with our passes), then run the graph eagerly. As in
    Inductor's own compile, views are spelled as reshapes first (``view_to_reshape``), so
    the passes see the graph they see under Inductor."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.fx_passes.post_grad import post_grad_passes, view_to_reshape

    view_to_reshape(gm)
    post_grad_passes(gm, kwargs.get("is_inference", True))
    gm.recompile()
    return make_boxed_func(gm.forward)


def kimi_specialized(gm: fx.GraphModule, example_inputs: list,
                     options: Mapping[str, Any] | KimiSpecialized | None = None, mode: str | None = None) -> Callable:
    """The ``torch_dynamo_backends`` entry point. ``torch.compile`` hands each call's own
    backend object as ``options`` (``_validate_options_at_torch_compile``). Inside vLLM
    (compilation modes 1 and 2 pass no options) the options come from
    ``additional_config["kimi_inductor"]``."""
    if isinstance(options, KimiSpecialized):
        return options(gm, example_inputs)
    if options is None:
        options = _vllm_options()
    return KimiSpecialized.for_options(options)(gm, example_inputs)


def _validate_options_at_torch_compile() -> None:
    """Make ``torch.compile(m, backend="kimi_specialized", options=...)`` itself refuse bad
    options (and a ``mode``, which only Inductor's own backend reads), and give each such
    call a backend object of its own: the wrapper's options become that object, so two
    compiled models with equal options no longer share (and overwrite) one object's
    reports. torch.compile keeps a named backend's options in a ``_TorchCompileWrapper``
    and passes it to ``torch._dynamo.optimize``, which resolves it with
    ``eval_frame.get_compiler_fn``; this module is imported while the wrapper looks the
    name up, i.e. before that call, so wrapping it covers the first torch.compile too.
    Without the hook (a torch without that function) options are checked at the first
    call and objects are shared per options, as before."""
    from torch._dynamo import eval_frame

    original = getattr(eval_frame, "get_compiler_fn", None)
    if original is None or getattr(original, "_kimi_validates_options", False):
        return

    @functools.wraps(original)
    def get_compiler_fn(compiler_fn):
        if getattr(compiler_fn, "compiler_fn", None) is kimi_specialized or \
                getattr(compiler_fn, "compiler_name", None) == "kimi_specialized":
            kwargs = getattr(compiler_fn, "kwargs", None)
            if isinstance(kwargs, dict) and not isinstance(kwargs.get("options"), KimiSpecialized):
                if "mode" in kwargs:
                    raise ValueError(f"kimi_specialized takes no torch.compile mode (got {kwargs['mode']!r}): the "
                                     "mode selects Inductor's own settings; drop it (decode runs in vLLM's or your "
                                     "CUDA graphs) or pass options={'compiler': 'inductor' | 'eager'}")
                given = kwargs.get("options")
                kwargs["options"] = KimiSpecialized(given, options_from_vllm=given is None)
        return original(compiler_fn)

    get_compiler_fn._kimi_validates_options = True
    eval_frame.get_compiler_fn = get_compiler_fn


_validate_options_at_torch_compile()


def _vllm_options() -> Options | None:
    try:
        from .vllm_glue import current_vllm_options
    except ImportError:  # no vLLM: plain torch.compile
        return None
    return current_vllm_options()


def match_report(compiled: torch.nn.Module | Callable) -> MatchReport:
    """The latest match report of a model compiled with ``kimi_specialized`` (by
    name or as a ``KimiSpecialized`` object); ``ValueError`` for anything else."""
    obj, options = getattr(getattr(compiled, "dynamo_ctx", None), "callback", None), None
    for _ in range(16):  # Dynamo's wrappers: CatchErrors -> ConvertFrame -> debug -> compile wrapper
        if obj is kimi_specialized:  # the named backend: this torch.compile call's object
            obj = options if isinstance(options, KimiSpecialized) else KimiSpecialized.for_options(options)
        if isinstance(obj, KimiSpecialized):
            if obj.report is None:
                raise ValueError("match_report: nothing compiled yet; torch.compile compiles at the first call, so "
                                 "call the compiled model once, then ask for its report")
            return obj.report
        if isinstance(getattr(obj, "kwargs", None), dict):
            options = obj.kwargs.get("options", options)
        obj = next((getattr(obj, a) for a in ("_torchdynamo_orig_backend", "compiler_fn", "_inner_convert")
                    if getattr(obj, a, obj) is not obj), None)
    raise ValueError(f"match_report: {type(compiled).__name__} is not compiled by kimi_specialized; pass what "
                     "torch.compile(model, backend='kimi_specialized') returned")
