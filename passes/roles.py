"""The decoder's op vocabulary: roles, and the spellings that write them.

A *role* is what a call does in the Kimi K3 decoder; a *spelling* is how one producer
of decoder graphs writes it (our replica's ``kimi::`` ops, vLLM 0.33.0's Triton
launches and custom ops). Passes ask this module for roles and never name an op. Each
spelling is one module of ``spellings/`` defining ``SPELLING``; every module there is
found at import, so adding a spelling is adding one file.

Roles, with the role's argument names whatever a spelling calls them:

    AttnRes       prefix [R, H] (updated in place), delta [R, H] | None, bank [R, NB, H]
                  (updated in place), norm_weight, qk_weight, output_norm_weight,
                  num_blocks, block_write_idx, eps, output_norm_eps; ``output``: the
                  mix [R, H]; ``updated(prefix | bank)``: their values after the call.
                  R is the call's rows: its inputs' first dimension, plus whatever the
                  spelling sizes by rows itself (``set_rows``). Contract, in every
                  spelling: row-wise; prefix += delta when delta is given; the bank's
                  block ``block_write_idx`` (if >= 0) takes the prefix; the mix is the
                  softmax-weighted sum of bank blocks [0, num_blocks) and the prefix.
    Core          an attention core, one anchor call per layer in graph order:
                  kind kda | mla | dsa, tokens per request ``q`` where the call shows it
                  (KDA), decode context parallel size ``dcp``
    Experts       the routed experts of a MoE: kind ``ep`` (experts partitioned over
                  the group, MegaMoE's contract), ``tp`` (TP-sharded experts) or
                  ``layer`` (one opaque op holding top-k, routed and shared experts)
    collectives   all-gather / reduce-scatter / all-reduce over the TP group: each
                  spelling's patterns, emitters and (``complete``) what a pattern cannot
                  bind, used by ``collectives.py``
    row-local ops custom ops whose output row r depends only on row r of given
                  arguments (what ``row_local.py`` may move across a collective)

Spellings are tried in name order; a node matches at most one.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx

aten = torch.ops.aten

ALLOCATIONS = {aten.empty.memory_format, aten.new_empty.default, aten.full.default, aten.zeros.default}


class AttnRes:
    """One AttnRes call in role terms (``kimi::attn_res``'s argument names)."""

    spelling: str
    node: fx.Node

    def arg(self, name: str) -> Any:
        raise NotImplementedError

    def view(self, name: str) -> dict[str, Any]:
        """View information of a mutated argument taken as a view of a base ({} when none)."""
        return {}

    @property
    def output(self) -> fx.Node | None:
        """The node holding the mix."""
        raise NotImplementedError

    def updated(self, name: str) -> fx.Node | None:
        """The node holding ``prefix`` or ``bank`` after the call (None when unread)."""
        raise NotImplementedError

    def set_arg(self, name: str, value: Any, drop_view: bool = False) -> None:
        raise NotImplementedError

    def set_rows(self, g: fx.Graph, rows: Any) -> None:
        """Resize what the call sizes by its rows beyond its tensor inputs (nothing by default)."""


class OpAttnRes(AttnRes):
    """AttnRes as one custom op (``graph.OpCall``) whose arguments carry the role's names;
    the mix is its result, or the new value of its mutable argument ``out`` when given."""

    def __init__(self, call, spelling: str, out: str | None = None):
        self.call, self.node, self.spelling, self.out = call, call.node, spelling, out

    def arg(self, name: str) -> Any:
        return self.call.arg(name)

    def view(self, name: str) -> dict[str, Any]:
        return self.call.view(name)

    @property
    def output(self) -> fx.Node | None:
        return self.call.output(0) if self.out is None else self.call.mutated_output(self.out)

    def updated(self, name: str) -> fx.Node | None:
        return self.call.mutated_output(name)

    def set_arg(self, name: str, value: Any, drop_view: bool = False) -> None:
        self.call.set_arg(name, value, drop_view)

    def set_rows(self, g: fx.Graph, rows: Any) -> None:
        if self.out is not None:  # the op writes the mix into a buffer sized by rows
            self.call.set_arg(self.out, resize_rows(g, self.call.arg(self.out), rows), drop_view=True)


@dataclass
class Core:
    node: fx.Node  # the anchor: the call that places the layer's attention in graph order
    kind: str  # kda | mla | dsa
    spelling: str
    q: int | None = None  # tokens per request, where the call shows it
    dcp: int | None = 1  # decode context parallel size; None where the spelling does not show it


@dataclass
class Experts:
    """kind ``ep`` / ``tp``: the routed experts of a stock MoE (expert-parallel over the
    group / TP-sharded); ``layer``: the whole MoE layer in one op that finds its weights
    by layer name at run time, with ``inputs`` latent, router_logits, shared_in,
    layer_name (read from the call as it is now: passes re-slice them), or ``refusal``
    saying why it cannot be routed through ours."""

    node: fx.Node
    kind: str  # ep | tp | layer
    spelling: str
    bind: Callable[[fx.Node], dict[str, Any]] | None = None  # the call's current inputs by name
    refusal: str = ""

    @property
    def inputs(self) -> dict[str, Any]:
        return {} if self.bind is None else self.bind(self.node)


@dataclass(frozen=True)
class CollectiveSpelling:
    """How one spelling writes the TP collectives. Patterns bind ``x`` (gather input) or
    ``y`` (reduce input), ``group_name`` and, where the op carries it, ``group_size``."""

    gathers: Callable[[], list]  # all_gather(x) along dim 0 (before any [:rows] slice)
    scatters: Callable[[Any], list]  # reduce_scatter(y-pattern) along dim 0
    all_reduces: Callable[[], list]  # all_reduce(y)
    emit_all_reduce: Callable[[fx.Graph, fx.Node, fx.Node, Any], fx.Node]  # (g, after, y, like) -> out
    emit_all_gather: Callable[[fx.Graph, fx.Node, fx.Node, Any], fx.Node]  # (g, after, x, like) -> out [G c]
    emit_reduce_scatter: Callable[[fx.Graph, fx.Node, fx.Node, Any], fx.Node]  # (g, after, y [G c], like) -> [c]
    ops: Callable[[], dict[Any, str]]  # op -> all_reduce | all_gather | reduce_scatter (for counting)
    complete: Callable[[str, fx.Node, dict], None] | None = None  # fills what a match could not bind


@dataclass(frozen=True)
class Spelling:
    name: str
    attn_res: Callable[[fx.Node], AttnRes | None]
    core: Callable[[fx.Node], Core | None]
    experts: Callable[[fx.Node], Experts | None]
    collectives: CollectiveSpelling | None = None
    row_local: dict[str, tuple[str, ...]] = field(default_factory=dict)  # op name -> arguments read row by row
    rms_norm: Callable[[fx.Node], tuple[Any, Any, float] | None] = lambda node: None  # (x, weight, eps): stock's
    situ: Callable[[fx.Node], tuple[Any, float, float] | None] = lambda node: None  # (h, beta, linear_beta)
    notes: str = ""  # what it covers, for docs and reports


def _discover() -> list[Spelling]:
    from . import spellings

    found = []
    for info in sorted(pkgutil.iter_modules(spellings.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{spellings.__name__}.{info.name}")
        spelling = getattr(module, "SPELLING", None)
        if spelling is not None:
            found.append(spelling)
    return found


def _first(kind: str, node: fx.Node):
    if node.op != "call_function":
        return None
    for spelling in SPELLINGS:
        found = getattr(spelling, kind)(node)
        if found is not None:
            return found
    return None


def attn_res(node: fx.Node) -> AttnRes | None:
    return _first("attn_res", node)


def core(node: fx.Node) -> Core | None:
    return _first("core", node)


def experts(node: fx.Node) -> Experts | None:
    return _first("experts", node)


def rms_norm(node: fx.Node) -> tuple[Any, Any, float] | None:
    """(x, weight, eps) where a spelling's op at ``node`` is stock's weighted RMSNorm of x
    (normalise in fp32, round to the weight dtype, scale, back to x's dtype)."""
    return _first("rms_norm", node)


def situ(node: fx.Node) -> tuple[Any, float, float] | None:
    """(h, beta, linear_beta) where a spelling's op yields stock's SiTU-GLU of h at
    ``node`` (its output, which nothing but this op computes) and nothing else reads h."""
    return _first("situ", node)


def collective_spelling(name: str) -> CollectiveSpelling:
    return next(s.collectives for s in SPELLINGS if s.name == name)


def row_local_args(op_name: str) -> tuple[str, ...] | None:
    """Names of the arguments a custom op reads row by row, when some spelling declares
    it row-local (output row r depends only on row r of those)."""
    return next((s.row_local[op_name] for s in SPELLINGS if op_name in s.row_local), None)


def resize_rows(g: fx.Graph, alloc: fx.Node, rows: Any) -> fx.Node:
    """A copy of allocation ``alloc`` (one of ``ALLOCATIONS``) with ``rows`` as its first
    dimension, inserted after it; the caller moves the users."""
    index = 1 if alloc.target is aten.new_empty.default else 0
    args = list(alloc.args)
    args[index] = [rows, *args[index][1:]]
    with g.inserting_after(alloc):
        return g.call_function(alloc.target, tuple(args), dict(alloc.kwargs))


SPELLINGS: list[Spelling] = _discover()  # last: the spelling modules import this one
