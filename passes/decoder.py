"""Structural match of the whole Kimi K3 decoder in a post-grad graph.

Anchors are roles (``roles.py``), never node names or one spelling's ops: the
attention cores (one per layer, in graph order), AttnRes (2 L + 1 calls: pre- and
post-attention per layer, then the final mix), routed experts and the collectives of
``collectives.py``. For layer i:

  pre  = AttnRes[2i]      its output feeds the attention (via an SP gather in SP)
  core = attention core   kda / mla / dsa
  post = AttnRes[2i+1]    reads the attention output (delta, or prefix at a block
                          write layer), via an SP reduce-scatter (SP) or an
                          all-reduce (TP, G > 1)
  MLP  = the nodes between post's output and AttnRes[2i+2]'s delta; a MoE when it
         holds a routed-experts op
The graph's entry shard (``pad`` + rank slice of the embedding, seen as the first
AttnRes' prefix), the residual bank allocation and the exit gather complete it.
``DecoderGraph.parse`` never mutates the graph; ``problems`` says why a graph is
not a decoder the passes understand. The pass manager parses once per compile; a pass
that replaces a decoder call or collective updates the ``DecoderGraph`` it was given
(``replaced``, or the fields it rewrote).

A **layer fragment** is a graph of Kimi K3 layers without the decoder around them, as a
user compiles one ``KimiDeltaAttention`` / ``MultiLatentAttention`` / ``KimiMoE`` module:
Kimi-spelled attention cores and / or routed-experts calls, no AttnRes, no collectives in
the graph (a per-rank layer: an attention's o-projection is the partial sum; an
expert-parallel MoE's exchange is inside its op). It is not a decoder (``is_decoder`` is
False); only the passes whose rewrites are local apply to it (``manager.FRAGMENT_PASSES``:
mega_moe, lower_kernels), and the report says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from . import collectives, roles
from .collectives import Collective
from .graph import OpCall, ancestors
from .roles import AttnRes, Core, Experts

aten = torch.ops.aten


@dataclass
class Entry:
    """The SP entry shard of the embedding: rows [start, end) of pad(embedding)."""

    embedding: fx.Node
    pad: Any  # the constant_pad_nd pad list, or None when T divides by G
    start: Any
    end: Any
    slice_node: fx.Node | None  # explicit slice node, or None when v2 view info holds it


@dataclass
class Layer:
    index: int
    core: Core
    pre: AttnRes
    post: AttnRes
    next_res: AttnRes
    attn_out: fx.Node
    mlp_in: fx.Node
    mlp_out: fx.Node
    moe: Experts | None
    gather: Collective | None = None
    scatter: Collective | None = None
    reduce: Collective | None = None

    @property
    def kind(self) -> str:
        return self.core.kind

    @property
    def spelling(self) -> str:
        return self.core.spelling

    @property
    def mlp(self) -> str:
        return "moe" if self.moe is not None else "dense"

    @property
    def dcp(self) -> int:
        """Decode context parallel size of the attention (1 without DCP)."""
        return self.core.dcp

    @property
    def mlp_nodes(self) -> set[fx.Node]:
        return _between(self.mlp_in, self.mlp_out)


@dataclass
class DecoderGraph:
    layers: list[Layer] = field(default_factory=list)
    final: AttnRes | None = None
    exit_gather: Collective | None = None
    entry: Entry | None = None
    bank: fx.Node | None = None
    problems: list[str] = field(default_factory=list)
    hybrid: bool = False  # set by hybrid_attention
    fragment: list[Core | Experts] = field(default_factory=list)  # a layer fragment's cores and experts

    @property
    def is_decoder(self) -> bool:
        return bool(self.layers) and not self.problems

    @property
    def is_fragment(self) -> bool:
        return bool(self.fragment)

    @property
    def layout(self) -> str:
        """``sp``, ``tp``, ``single`` (no TP collectives), ``hybrid`` (after
        hybrid_attention), ``mixed``, ``fragment`` or ``none``."""
        if not self.layers:
            return "fragment" if self.fragment else "none"
        if self.hybrid:
            return "hybrid"
        sp = [l.gather is not None and l.scatter is not None for l in self.layers]
        if all(sp) and self.entry is not None and self.exit_gather is not None:
            return "sp"
        if not any(l.gather or l.scatter for l in self.layers) and self.entry is None:
            return "tp" if any(l.reduce for l in self.layers) else "single"
        return "mixed"

    @property
    def rows(self) -> Any:
        """T as the SP gathers slice it (None without SP gathers)."""
        return self.layers[0].gather.bindings["rows"] if self.layers and self.layers[0].gather else None

    @property
    def tokens(self) -> Any:
        """T, the step's batch rows: the SP gathers' rows, else the AttnRes rows (a
        fragment's: the rows of its first part's first argument)."""
        if self.fragment:
            call = OpCall.of(self.fragment[0].node)
            first = call.arg(call.op._schema.arguments[0].name)
            return first.meta["val"].shape[0] if isinstance(first, fx.Node) and "val" in first.meta else None
        if self.rows is not None or not self.layers:
            return self.rows
        val = self.layers[0].pre.output.meta.get("val") if self.layers[0].pre.output is not None else None
        return None if val is None else val.shape[0]

    @property
    def cores(self) -> list[Core]:
        """Every attention core: its layers' and a fragment's."""
        return [l.core for l in self.layers] + [c for c in self.fragment if isinstance(c, Core)]

    @property
    def q(self) -> int | None:
        """Tokens per request where a core shows it (KDA state slots [R, q])."""
        return next((c.q for c in self.cores if c.q is not None), None)

    @property
    def dcp(self) -> int | None:
        """Decode context parallel size of its MLA / DSA layers (None without one, or
        where the spelling does not show it)."""
        return next((c.dcp for c in self.cores if c.kind != "kda" and c.dcp is not None), None)

    @property
    def group_size(self) -> int | None:
        for l in self.layers:
            for c in (l.gather, l.scatter, l.reduce):
                if c is not None and "group_size" in c.bindings:
                    return c.bindings["group_size"]
        return None

    def replaced(self, old: fx.Node, new: fx.Node) -> None:
        """A pass put ``new`` in place of the decoder call ``old`` (same role)."""
        for l in self.layers:
            if l.core.node is old:
                l.core = roles.core(new)
            for name in ("pre", "post", "next_res"):
                if getattr(l, name).node is old:
                    setattr(l, name, roles.attn_res(new))
            if l.moe is not None and l.moe.node is old:
                l.moe = roles.experts(new)
        if self.final is not None and self.final.node is old:
            self.final = roles.attn_res(new)
        self.fragment = [c if c.node is not old else roles.core(new) if isinstance(c, Core) else roles.experts(new)
                         for c in self.fragment]

    @classmethod
    def parse(cls, graph: fx.Graph) -> "DecoderGraph":
        out = cls()
        cores, res, parts = [], [], []  # parts: cores and routed experts, in graph order
        for node in graph.nodes:
            if (c := roles.core(node)) is not None:
                cores.append(c)
                parts.append(c)
            elif (r := roles.attn_res(node)) is not None:
                res.append(r)
            elif (e := roles.experts(node)) is not None:
                parts.append(e)
        if parts and not res and all(c.spelling == "kimi" for c in parts):
            n = sum(collectives.count(graph).values())
            if n:
                out.problems.append(f"a layer fragment (layers without AttnRes) with {n} collective(s): "
                                    "the passes rewrite a TP layer only inside the whole decoder")
            else:
                out.fragment = parts
            return out
        if not cores or not res:
            out.problems.append("not a Kimi K3 decoder graph: no AttnRes / attention core calls in any "
                                f"known spelling ({', '.join(s.name for s in roles.SPELLINGS)})")
            return out
        L = len(cores)
        if len(res) != 2 * L + 1:
            out.problems.append(f"{len(res)} AttnRes calls for {L} attention layers (expected {2 * L + 1})")
            return out
        position = {n: i for i, n in enumerate(graph.nodes)}
        gathers, scatters, reduces = {}, {}, {}
        for node in graph.nodes:
            if (m := collectives.sp_gather(node)) is not None:
                gathers[m.input] = m
            elif (m := collectives.sp_scatter(node)) is not None:
                scatters[m.out] = m
            elif (m := collectives.all_reduce(node)) is not None:
                reduces[m.out] = m
        for i, core in enumerate(cores):
            pre, post, nxt = res[2 * i], res[2 * i + 1], res[2 * i + 2]
            if not position[pre.node] < position[core.node] < position[post.node]:
                out.problems.append(f"layer {i}: AttnRes calls are not around its attention core")
                continue
            delta = post.arg("delta")
            attn_out = delta if delta is not None else post.arg("prefix")
            mlp_in, mlp_out = post.output, nxt.arg("delta")
            if mlp_in is None or mlp_out is None:
                out.problems.append(f"layer {i}: its MLP output does not enter the next AttnRes as delta")
                continue
            moe = next((e for n in _between(mlp_in, mlp_out) if (e := roles.experts(n)) is not None), None)
            out.layers.append(Layer(
                index=i, core=core, pre=pre, post=post, next_res=nxt, attn_out=attn_out,
                mlp_in=mlp_in, mlp_out=mlp_out, moe=moe, gather=gathers.get(pre.output),
                scatter=scatters.get(attn_out), reduce=reduces.get(attn_out)))
        out.final = res[-1]
        out.exit_gather = gathers.get(out.final.output)
        out.entry = _entry(res[0])
        bank = res[0].arg("bank")
        if isinstance(bank, fx.Node) and bank.target in roles.ALLOCATIONS:
            out.bank = bank
        return out


def _between(src: fx.Node, dst: fx.Node) -> set[fx.Node]:
    """Nodes on a path from ``src`` to ``dst`` (both included)."""
    down, todo = {src}, [src]
    while todo:
        for user in todo.pop().users:
            if user not in down:
                down.add(user)
                todo.append(user)
    return (ancestors(dst) | {dst}) & down


def _entry(first: AttnRes) -> Entry | None:
    """The SP shard of the embedding that the first AttnRes takes as its prefix."""
    prefix, view = first.arg("prefix"), first.view("prefix")
    slice_node = None
    if view.get("slice_dim") == 0:
        base, start, end = prefix, view["slice_start"], view["slice_end"]
    elif isinstance(prefix, fx.Node) and prefix.target is aten.slice.Tensor and prefix.args[1] == 0:
        base, start, end = prefix.args[0], prefix.args[2], prefix.args[3]
        slice_node = prefix
    else:
        return None
    pad = None
    if isinstance(base, fx.Node) and base.target is aten.constant_pad_nd.default:
        base, pad = base.args[0], base.args[1]
    return Entry(embedding=base, pad=pad, start=start, end=end, slice_node=slice_node)
