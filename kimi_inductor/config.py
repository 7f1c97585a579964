"""Options of the ``kimi_specialized`` backend, given as ``torch.compile(options=...)``.

    torch.compile(model, backend="kimi_specialized", options={
        "passes": ["hybrid_attention", "lower_kernels"],  # which rewrites run (pipeline order)
        "decode": {"tp": 4, "q": 4, "dcp": 1,    # the deployment's decode settings
                   "capture_sizes": [8, 16]},    # rewrite only these batch rows (empty: all)
        "strict": False,                         # raise when a layer does not match
        "compiler": "inductor",                  # or "eager": no code generation
    })

Everything is validated here, with the offending key named; the options are one
frozen dataclass passed down to every pass.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

PASS_ORDER = ("hybrid_attention", "lower_kernels")
COMPILERS = ("inductor", "eager")


@dataclass(frozen=True)
class DecodeSettings:
    tp: int | None = None  # TP group size G the graph must have (None: any)
    q: int | None = None  # tokens per request, 1 + speculative tokens (None: any)
    dcp: int = 1  # decode context parallel size (1 or G)
    capture_sizes: tuple[int, ...] = ()  # batch rows T to rewrite (empty: every T)

    def __post_init__(self) -> None:
        if self.tp is not None and self.tp not in (1, 2, 4, 8, 16):
            raise ValueError(f"decode.tp must be one of 1, 2, 4, 8, 16, got {self.tp}")
        if self.q is not None and not 1 <= self.q <= 8:
            raise ValueError(f"decode.q (1 + speculative tokens) must be in 1..8, got {self.q}")
        if self.dcp != 1 and self.dcp != self.tp:
            raise ValueError(f"decode.dcp must be 1 or equal to decode.tp, got dcp={self.dcp} tp={self.tp}")


@dataclass(frozen=True)
class Options:
    passes: tuple[str, ...] = PASS_ORDER
    decode: DecodeSettings = field(default_factory=DecodeSettings)
    strict: bool = False
    compiler: str = "inductor"

    def __post_init__(self) -> None:
        unknown = [p for p in self.passes if p not in PASS_ORDER]
        if unknown:
            raise ValueError(f"unknown passes {unknown}; available: {list(PASS_ORDER)}")
        if self.compiler not in COMPILERS:
            raise ValueError(f"compiler must be one of {COMPILERS}, got {self.compiler!r}")

    @classmethod
    def from_mapping(cls, options: "Options | Mapping[str, Any] | None") -> "Options":
        if options is None:
            return cls()
        if isinstance(options, Options):
            return options
        unknown = set(options) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown kimi_specialized options {sorted(unknown)}; "
                             f"expected {[f.name for f in dataclasses.fields(cls)]}")
        kwargs = dict(options)
        if "passes" in kwargs:
            kwargs["passes"] = tuple(sorted(kwargs["passes"], key=_pass_rank))
        if "decode" in kwargs and not isinstance(kwargs["decode"], DecodeSettings):
            decode = dict(kwargs["decode"])
            bad = set(decode) - {f.name for f in dataclasses.fields(DecodeSettings)}
            if bad:
                raise ValueError(f"unknown decode settings {sorted(bad)}")
            decode["capture_sizes"] = tuple(decode.get("capture_sizes", ()))
            kwargs["decode"] = DecodeSettings(**decode)
        return cls(**kwargs)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def _pass_rank(name: str) -> int:
    if name not in PASS_ORDER:
        raise ValueError(f"unknown pass {name!r}; available: {list(PASS_ORDER)}")
    return PASS_ORDER.index(name)
