"""The match report: what each pass did to each layer, and why.

Every pass returns a ``PassInfo`` (its matches, rewrites and reasons) and annotates
``LayerReport`` rows; the backend keeps one ``MatchReport`` per compiled graph.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LayerReport:
    """One decoder layer: what each pass did to it. ``reason`` is hybrid_attention's
    statement (the collectives), ``notes`` mega_moe's (``moe``), sharded_moe's
    (``moe_layout``), lower_kernels' (``kernels``) and the attention's DCP layout (``dcp``)."""

    index: int
    kind: str  # kda | mla | dsa
    mlp: str  # moe | dense
    spelling: str = ""  # whose ops the layer is written in (passes/spellings/)
    rewritten: bool = False  # by some pass
    reason: str = ""
    notes: dict[str, str] = field(default_factory=dict)
    rewritten_by: list[str] = field(default_factory=list)  # the passes that changed this layer


    def statements(self) -> list[tuple[str, str]]:
        """(label, text) per pass that said something about this layer, then the rest."""
        out = [("hybrid_attention", self.reason)] if self.reason else []
        out += [(NOTE_PASSES.get(k, k), v) for k, v in self.notes.items()]
        return out


NOTE_PASSES = {"moe": "mega_moe", "moe_layout": "sharded_moe", "kernels": "lower_kernels"}


@dataclass
class PassInfo:
    name: str
    matched: int = 0
    rewritten: int = 0
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class MatchReport:
    graph: int = 0
    decoder: bool = False
    fragment: str = ""  # a layer fragment's parts ("kda", "moe", "mla, moe"), '' otherwise
    layout: str = "none"  # as compiled: sp | tp | single | mixed | none
    layout_after: str = "none"  # after the passes (hybrid when hybrid_attention rewrote)
    rows: int | str | None = None  # T, or its symbol's name for a symbolic batch
    per_size: bool = False  # a symbolic batch with capture sizes: compiled again at each (by_size.py)
    group_size: int | None = None
    reason: str = ""
    layers: list[LayerReport] = field(default_factory=list)
    passes: list[PassInfo] = field(default_factory=list)
    collectives_before: dict[str, int] = field(default_factory=dict)
    collectives_after: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MatchReport":
        d = dict(d)
        d["layers"] = [LayerReport(**l) for l in d.get("layers", [])]
        d["passes"] = [PassInfo(**p) for p in d.get("passes", [])]
        return cls(**d)

    def format(self) -> str:
        what = ("Kimi K3 decoder" if self.decoder else f"Kimi K3 layer fragment ({self.fragment})" if self.fragment
                else "not rewritten")
        lines = [f"graph {self.graph}: {what}"
                 f" layout={self.layout}" + (f" -> {self.layout_after}" if self.layout_after not in (self.layout, "none") else "")
                 + f" rows={self.rows} G={self.group_size}"
                 + (f" ({self.reason})" if self.reason else "")]
        if self.layers:
            lines.append(f"  {'layer':>5} {'attn':<4} {'mlp':<5} {'spelling':<8} rewritten by")
            for l in self.layers:
                lines.append(f"  {l.index:>5} {l.kind:<4} {l.mlp:<5} {l.spelling:<8} "
                             f"{', '.join(l.rewritten_by) or 'no pass'}")
                lines += [f"  {'':>25}{label}: {text}" for label, text in l.statements()]
        for p in self.passes:
            lines.append(f"  pass {p.name}: matched {p.matched}, rewrote {p.rewritten}"
                         + (f", skipped: {'; '.join(p.skipped)}" if p.skipped else "")
                         + f" ({p.seconds * 1e3:.1f} ms)")
        if self.collectives_before:
            lines.append(f"  collectives before {self.collectives_before} after {self.collectives_after}")
        return "\n".join(lines)
