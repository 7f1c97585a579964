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
    index: int
    kind: str  # kda | mla | dsa
    mlp: str  # moe | dense
    spelling: str = ""  # whose ops the layer is written in (passes/spellings/)
    rewritten: bool = False
    reason: str = ""
    notes: dict[str, str] = field(default_factory=dict)  # per-pass details, e.g. the MoE implementation


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
    layout: str = "none"  # as compiled: sp | tp | single | mixed | none
    layout_after: str = "none"  # after the passes (hybrid when hybrid_attention rewrote)
    rows: int | str | None = None  # T, or its symbol's name for a symbolic batch
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
        lines = [f"graph {self.graph}: {'Kimi K3 decoder' if self.decoder else 'not rewritten'}"
                 f" layout={self.layout}" + (f" -> {self.layout_after}" if self.layout_after not in (self.layout, "none") else "")
                 + f" rows={self.rows} G={self.group_size}"
                 + (f" ({self.reason})" if self.reason else "")]
        if self.layers:
            lines.append(f"  {'layer':>5} {'attn':<4} {'mlp':<5} {'rewritten':<9} reason")
            for l in self.layers:
                notes = "".join(f"; {k}: {v}" for k, v in l.notes.items())
                lines.append(f"  {l.index:>5} {l.kind:<4} {l.mlp:<5} {'yes' if l.rewritten else 'no':<9} "
                             f"{l.reason}{notes}")
        for p in self.passes:
            lines.append(f"  pass {p.name}: matched {p.matched}, rewrote {p.rewritten}"
                         + (f", skipped: {'; '.join(p.skipped)}" if p.skipped else "")
                         + f" ({p.seconds * 1e3:.1f} ms)")
        if self.collectives_before:
            lines.append(f"  collectives before {self.collectives_before} after {self.collectives_after}")
        return "\n".join(lines)
