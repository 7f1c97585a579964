"""Structural match of the whole Kimi K3 decoder in a post-grad graph.

Anchors are ops, never node names: the attention core ops (one per layer, in graph
order), the AttnRes op (2 L + 1 calls: pre- and post-attention per layer, then the
final mix) and the collectives of ``collectives.py``. For layer i:

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
not a decoder the passes understand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from . import collectives
from .collectives import Collective
from .graph import OpCall, ancestors, calls

import kimi_inductor.kernels  # noqa: F401  (registers kimi_kernels::*)

kimi = torch.ops.kimi
aten = torch.ops.aten

ATTENTION_CORES = {kimi.kda_decode.default: "kda", kimi.mla_decode.default: "mla",
                   kimi.dsa_decode.default: "dsa", torch.ops.kimi_kernels.dsa_decode.default: "dsa",
                   torch.ops.kimi_kernels.kda_decode.default: "kda",
                   torch.ops.kimi_kernels.mla_decode.default: "mla",
                   kimi.mla_decode_dcp.default: "mla", torch.ops.kimi_kernels.mla_decode_dcp.default: "mla"}
ATTN_RES = [kimi.attn_res.default, torch.ops.kimi_kernels.attn_res.default]  # stock, lowered
DCP_CORES = {kimi.mla_decode_dcp.default, torch.ops.kimi_kernels.mla_decode_dcp.default}  # "dsa" with a selection
ROUTED_EXPERTS = {kimi.fused_experts.default, kimi.ep_experts.default,
                  torch.ops.kimi_kernels.mega_moe.default, torch.ops.kimi_kernels.expert_ffn.default}
ALLOCATIONS = {aten.empty.memory_format, aten.new_empty.default, aten.full.default, aten.zeros.default}


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
    kind: str
    core: OpCall
    pre: OpCall
    post: OpCall
    next_res: OpCall
    attn_out: fx.Node
    mlp_in: fx.Node
    mlp_out: fx.Node
    mlp_nodes: set[fx.Node]
    moe: OpCall | None
    gather: Collective | None = None
    scatter: Collective | None = None
    reduce: Collective | None = None

    @property
    def mlp(self) -> str:
        return "moe" if self.moe is not None else "dense"

    @property
    def dcp(self) -> int:
        """Decode context parallel size of the attention (1 without DCP)."""
        return self.core.arg("dcp_size") if self.core.op in DCP_CORES else 1


@dataclass
class DecoderGraph:
    layers: list[Layer] = field(default_factory=list)
    final: OpCall | None = None
    exit_gather: Collective | None = None
    entry: Entry | None = None
    bank: fx.Node | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def is_decoder(self) -> bool:
        return bool(self.layers) and not self.problems

    @property
    def layout(self) -> str:
        """``sp``, ``tp``, ``single`` (no TP collectives) or ``mixed``."""
        if not self.layers:
            return "none"
        sp = [l.gather is not None and l.scatter is not None for l in self.layers]
        if all(sp) and self.entry is not None and self.exit_gather is not None:
            return "sp"
        if not any(l.gather or l.scatter for l in self.layers) and self.entry is None:
            return "tp" if any(l.reduce for l in self.layers) else "single"
        return "mixed"

    @property
    def rows(self) -> Any:
        return self.layers[0].gather.bindings["rows"] if self.layers and self.layers[0].gather else None

    @property
    def q(self) -> int | None:
        """Tokens per request, from the KDA state slots [R, q] (None without KDA layers)."""
        for l in self.layers:
            if l.kind == "kda":
                slots = l.core.arg("state_slots")
                val = slots.meta.get("val") if isinstance(slots, fx.Node) else None
                return None if val is None else val.shape[1]
        return None

    @property
    def group_size(self) -> int | None:
        for l in self.layers:
            for c in (l.gather, l.scatter, l.reduce):
                if c is not None and "group_size" in c.bindings:
                    return c.bindings["group_size"]
        return None

    @classmethod
    def parse(cls, graph: fx.Graph) -> "DecoderGraph":
        out = cls()
        cores = calls(graph, ATTENTION_CORES)
        res = calls(graph, ATTN_RES)
        if not cores or not res:
            out.problems.append("not a Kimi K3 decoder graph: no kimi::attn_res / attention core ops")
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
            mlp_in, mlp_out = post.output(0), nxt.arg("delta")
            if mlp_in is None or mlp_out is None:
                out.problems.append(f"layer {i}: its MLP output does not enter the next AttnRes as delta")
                continue
            region = _between(mlp_in, mlp_out)
            moe = next((c for n in region if (c := OpCall.of(n)) is not None and c.op in ROUTED_EXPERTS), None)
            pre_out = pre.output(0)
            kind = ATTENTION_CORES[core.op]
            if core.op in DCP_CORES and core.arg("selected") is not None:
                kind = "dsa"
            out.layers.append(Layer(
                index=i, kind=kind, core=core, pre=pre, post=post, next_res=nxt,
                attn_out=attn_out, mlp_in=mlp_in, mlp_out=mlp_out, mlp_nodes=region, moe=moe,
                gather=gathers.get(pre_out), scatter=scatters.get(attn_out), reduce=reduces.get(attn_out)))
        out.final = res[-1]
        out.exit_gather = gathers.get(out.final.output(0))
        out.entry = _entry(res[0])
        bank = res[0].arg("bank")
        if isinstance(bank, fx.Node) and bank.target in ALLOCATIONS:
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


def _entry(first: OpCall) -> Entry | None:
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
