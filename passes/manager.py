"""The pass manager: runs the enabled passes in pipeline order (``pipeline.PASSES``) as
one Inductor post-grad custom pass, times and logs each, dumps graphs, and fills the
report. The decoder is parsed once; fake values are kept right incrementally
(``graph.MetaUpdater``). A graph that holds no Kimi K3 decoder, or whose deployment is
not the one the decode settings describe, passes every pass unchanged (``refusal``).
A layer fragment (``decoder.py``: layers without the decoder) gets the passes whose
rewrites are local (``FRAGMENT_PASSES``).

``KimiPasses`` is a ``CustomGraphPass``: its ``uuid()`` hashes the source of every
module the rewrites depend on (passes, stock, kernels, recursively), the options, the
dispatch tables as they are now (``dispatch_tables``: a table changed at run time, as a
benchmark's A/B variant or a user's retuning does, changes what the passes emit) and the
environment they read while they run (``environment``: our switches, such as
``KIMI_INDUCTOR_MOE_IN_ROWS``, and whether CuTe DSL imports, which decides the GEMV
fusions), so Inductor's FX graph cache never returns a graph compiled by other passes or
settings (on a cache hit the passes do not run and the report says so).

Logging: ``TORCH_LOGS=kimi_inductor`` prints the report of every compiled graph;
``TORCH_LOGS=kimi_graphs`` also dumps each pass's graph before and after.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

import kimi_inductor.kernels
import kimi_inductor.stock
from kimi_inductor.config import Options
from kimi_inductor.kernels import skinny_gemm
from kimi_inductor.logs import graph_log

from . import collectives
from .decoder import DecoderGraph
from .graph import MetaUpdater
from .pipeline import PASSES
from .report import LayerReport, MatchReport, PassInfo
from .roles import Core

log = logging.getLogger("kimi_inductor.passes")


FRAGMENT_PASSES = ("mega_moe", "lower_kernels", "byte_pages")  # the passes that apply to a layer fragment (local rewrites)


class MatchError(ValueError):
    """Strict mode: a layer of the decoder did not match (the report says why)."""


class PassContext:
    """What every pass gets: the graph, the options, the report and the decoder, parsed
    once per compile (a pass that rewrites decoder calls updates ``decoder``)."""

    def __init__(self, gm: fx.GraphModule, options: Options, report: MatchReport, decoder: DecoderGraph):
        self.gm, self.options, self.report, self.decoder = gm, options, report, decoder

    def mark(self, index: int, rewritten: bool, reason: str) -> None:
        """hybrid_attention's statement about layer ``index``."""
        self.report.layers[index].reason = reason
        if rewritten:
            self.rewrote(index, "hybrid_attention")

    def mark_all(self, rewritten: bool, reason: str) -> None:
        for layer in self.report.layers:
            self.mark(layer.index, rewritten, reason)

    def note(self, index: int, pass_name: str, key: str, text: str, rewritten: bool) -> None:
        """A pass's statement about layer ``index`` (``notes[key]``)."""
        self.report.layers[index].notes[key] = text
        if rewritten:
            self.rewrote(index, pass_name)

    def rewrote(self, index: int, pass_name: str) -> None:
        layer = self.report.layers[index]
        if pass_name not in layer.rewritten_by:
            layer.rewritten_by.append(pass_name)
        layer.rewritten = True


Observer = Callable[[str, fx.GraphModule], None]  # (stage, graph), stage "before <pass>" / "after <pass>"


def refusal(dg: DecoderGraph, options: Options) -> str:
    """Why no pass may touch this graph ('' when they may): it holds no Kimi K3 decoder,
    or it is not the deployment the decode settings describe."""
    if not dg.is_decoder and not dg.is_fragment:
        return "; ".join(dg.problems) or "no decoder layers"
    decode, size = options.decode, dg.group_size or 1
    if dg.is_fragment and (decode.tp or 1) > 1:
        return f"a layer fragment has no TP group, options say decode.tp={decode.tp}"
    if decode.tp is not None and size != decode.tp:
        return f"graph has TP size {size}, options say decode.tp={decode.tp}"
    if decode.dcp is not None and dg.dcp is not None and dg.dcp != decode.dcp:
        return f"graph's MLA layers run decode context parallel {dg.dcp}, options say decode.dcp={decode.dcp}"
    if decode.q is not None and dg.q is not None and dg.q != decode.q:
        return f"graph verifies q={dg.q} tokens per request, options say decode.q={decode.q}"
    if _per_size(dg, options):  # a SymInt would compare by its hint (the backend reads report.per_size)
        return (f"batch rows {dg.tokens} not in decode.capture_sizes {list(decode.capture_sizes)} (a symbolic "
                "batch: compiled again at each capture size, on its first call)")
    if decode.capture_sizes and dg.tokens not in decode.capture_sizes:
        return f"batch rows {dg.tokens} not in decode.capture_sizes {list(decode.capture_sizes)}"
    return ""


def _per_size(dg: DecoderGraph, options: Options) -> bool:
    """A symbolic batch with capture sizes: this compile serves every other size
    (``kimi_inductor/by_size.py`` compiles the graph again at each capture size)."""
    return bool(options.decode.capture_sizes) and dg.tokens is not None and not isinstance(dg.tokens, int)


class KimiPasses(CustomGraphPass):
    def __init__(self, options: Options, report: MatchReport, observer: Observer | None = None):
        self.options, self.report, self.observer = options, report, observer

    def _observe(self, stage: str, gm: fx.GraphModule) -> None:
        if self.observer is not None:
            self.observer(stage, gm)
        if graph_log.isEnabledFor(logging.DEBUG):
            graph_log.debug("kimi_inductor graph %d %s:\n%s", self.report.graph, stage, _readable(gm))

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        report, options = self.report, self.options
        report.collectives_before = collectives.count(graph)
        dg = DecoderGraph.parse(graph)
        report.decoder, report.layout = dg.is_decoder, dg.layout
        report.fragment = ", ".join(c.kind if isinstance(c, Core) else "moe" for c in dg.fragment)
        report.rows = dg.tokens if isinstance(dg.tokens, int) or dg.tokens is None else str(dg.tokens)
        report.group_size = dg.group_size
        report.layers = [LayerReport(l.index, l.kind, l.mlp, spelling=l.spelling, notes=_dcp_note(l))
                         for l in dg.layers]
        report.per_size = _per_size(dg, options)
        report.reason = refusal(dg, options)
        ctx, meta = PassContext(gm, options, report, dg), MetaUpdater(gm)
        if report.reason:
            ctx.mark_all(rewritten=False, reason=report.reason)
        for name in options.passes:
            self._observe(f"before {name}", gm)
            start = time.perf_counter()
            if report.reason:
                info = PassInfo(name, skipped=[report.reason])
            elif dg.is_fragment and name not in FRAGMENT_PASSES:
                info = PassInfo(name, skipped=["a layer fragment: this pass rewrites the whole decoder"])
            else:
                info = PASSES[name]()(gm, ctx)
                gm.recompile()
                meta.update()
            info.seconds = time.perf_counter() - start
            report.passes.append(info)
            self._observe(f"after {name}", gm)
        report.layout_after = dg.layout
        report.collectives_after = collectives.count(graph)
        log.info("kimi_specialized match report\n%s", report.format())
        required = {"hybrid_attention"} & set(options.passes) or set(options.passes)
        if options.strict and dg.layers and not report.per_size and \
                not all(required & set(l.rewritten_by) for l in report.layers):
            raise MatchError(f"kimi_specialized (strict): not every layer was rewritten\n{report.format()}")

    def uuid(self) -> bytes:
        folders = (Path(__file__).parent, Path(kimi_inductor.stock.__file__).parent,
                   Path(kimi_inductor.kernels.__file__).parent)
        files = [f for folder in folders for f in sorted(folder.rglob("*.py"))]
        env = environment()  # first: finding CuTe imports cute_gemv, whose tables then count
        return get_hash_for_files(tuple(str(f) for f in files), extra=self.options.to_json() + dispatch_tables() + env)


def environment() -> str:
    """What the passes read from this process's environment, in a canonical text: every
    ``KIMI_*`` variable as set (our switches, docs/kernels.md) and why CuTe DSL does not
    import ('' when it does)."""
    switches = sorted((k, v) for k, v in os.environ.items() if k.startswith("KIMI_"))
    return repr((switches, skinny_gemm.cute_available()))


def dispatch_tables() -> str:
    """The upper-case module globals of our passes and kernels holding plain values (the
    tables and limits their choices read: ``skinny_gemm.FASTEST``,
    ``mla_decode.MERGE_INTO_UP``, ...) in a canonical text (sets sorted), as they are in
    this process."""
    def plain(v):  # a canonical form, or None where v holds code (ops, dtypes, functions)
        if isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, (tuple, list, set, frozenset)):
            items = [plain(x) for x in v]
            ok = None not in items
            return (sorted(map(repr, items)) if isinstance(v, (set, frozenset)) else items) if ok else None
        if isinstance(v, dict):
            items = [(plain(k), plain(x)) for k, x in v.items()]
            return sorted(map(repr, items)) if all(None not in kv for kv in items) else None
        return None

    prefixes = ("kimi_inductor.kernels.", "kimi_inductor.passes.")
    tables = {name: {k: p for k, v in sorted(vars(mod).items()) if k.isupper() and (p := plain(v)) is not None}
              for name, mod in sorted(sys.modules.items()) if name.startswith(prefixes) and mod is not None}
    return repr(tables)


def _dcp_note(layer) -> dict[str, str]:
    if layer.dcp in (1, None):
        return {}
    return {"dcp": f"DCP {layer.dcp}: latent cache interleaved over the ranks (position p on rank p % "
                   f"{layer.dcp}), query-head all-gather, LSE combine + reduce-scatter over heads"}


def _readable(gm: fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)
