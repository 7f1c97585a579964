"""Options of the ``kimi_specialized`` backend, given as ``torch.compile(options=...)``.

    torch.compile(model, backend="kimi_specialized", options={
        "passes": ["hybrid_attention", "mega_moe", "sharded_moe", "lower_kernels", "byte_pages"],  # pipeline order
        "decode": {"tp": 4, "q": 4, "dcp": 1,    # the deployment's decode settings
                   "capture_sizes": [8, 16],     # rewrite only these batch rows (empty: all)
                   "sharded_moe_rows": 64},      # sharded_moe up to this many rows (0: never)
        "strict": False,                         # raise when a layer does not match
        "compiler": "inductor",                  # or "eager": no code generation
    })

Everything is validated here, with the offending key named (types too: ``strict``
is a bool, counts are ints, lists are lists), and ``torch.compile`` itself raises the
``ValueError`` (backend.py); the options are one frozen dataclass passed down to every
pass.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

from .passes.pipeline import PASS_ORDER  # the pass registry
COMPILERS = ("inductor", "eager")


def _int(value: Any, key: str) -> int:
    """An int option (bool and float are refused: ``True`` and ``4.0`` are not counts)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an int, got {type(value).__name__} {value!r}")
    return value


@dataclass(frozen=True)
class DecodeSettings:
    tp: int | None = None  # TP group size G the graph must have (None: any)
    q: int | None = None  # tokens per request, 1 + speculative tokens (None: any)
    dcp: int | None = None  # decode context parallel size the graph's MLA layers must have, 1 or G (None: any)
    capture_sizes: tuple[int, ...] = ()  # batch rows T to rewrite (empty: every T)
    sharded_moe_rows: int = 64  # sharded_moe rewrites MoE layers of steps with at most this many rows

    def __post_init__(self) -> None:
        if self.tp is not None and _int(self.tp, "decode.tp") not in (1, 2, 4, 8, 16):
            raise ValueError(f"decode.tp must be one of 1, 2, 4, 8, 16, got {self.tp}")
        if self.q is not None and not 1 <= _int(self.q, "decode.q") <= 8:
            raise ValueError(f"decode.q (1 + speculative tokens) must be in 1..8, got {self.q}")
        if self.dcp is not None and _int(self.dcp, "decode.dcp") != 1 and self.dcp != self.tp:
            raise ValueError(f"decode.dcp must be 1 or equal to decode.tp, got dcp={self.dcp} tp={self.tp}")
        object.__setattr__(self, "capture_sizes", _sequence(self.capture_sizes, "decode.capture_sizes", "[8, 16]"))
        for size in self.capture_sizes:
            if _int(size, "decode.capture_sizes entries") < 1:
                raise ValueError(f"decode.capture_sizes entries must be positive row counts, got {size}")
        if _int(self.sharded_moe_rows, "decode.sharded_moe_rows") < 0:
            raise ValueError(f"decode.sharded_moe_rows must be >= 0 (0: never), got {self.sharded_moe_rows}")

    @classmethod
    def from_mapping(cls, decode: "DecodeSettings | Mapping[str, Any]") -> "DecodeSettings":
        if isinstance(decode, DecodeSettings):
            return decode
        fields = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(decode, Mapping):
            raise ValueError(f"decode must be a dict with keys {fields}, got {type(decode).__name__} {decode!r}")
        bad = set(decode) - set(fields)
        if bad:
            raise ValueError(f"unknown decode settings {sorted(bad)}; expected {fields}")
        return cls(**decode)


@dataclass(frozen=True)
class Options:
    passes: tuple[str, ...] = PASS_ORDER
    decode: DecodeSettings = field(default_factory=DecodeSettings)
    strict: bool = False
    compiler: str = "inductor"

    def __post_init__(self) -> None:
        object.__setattr__(self, "passes", _sequence(self.passes, "passes", "['mega_moe']"))
        if not all(isinstance(p, str) for p in self.passes):
            raise ValueError(f"passes must be a list of pass names, got {self.passes!r}")
        unknown = [p for p in self.passes if p not in PASS_ORDER]
        if unknown:
            raise ValueError(f"unknown passes {unknown}; available: {list(PASS_ORDER)}")
        repeated = sorted({p for p in self.passes if self.passes.count(p) > 1})
        if repeated:
            raise ValueError(f"passes lists {repeated} more than once; each pass runs at most once")
        if not isinstance(self.decode, DecodeSettings):
            raise ValueError(f"decode must be a DecodeSettings or a dict, got {type(self.decode).__name__}")
        if not isinstance(self.strict, bool):
            raise ValueError(f"strict must be True or False, got {type(self.strict).__name__} {self.strict!r}")
        if self.compiler not in COMPILERS:
            raise ValueError(f"compiler must be one of {COMPILERS}, got {self.compiler!r}")

    @classmethod
    def from_mapping(cls, options: "Options | Mapping[str, Any] | None") -> "Options":
        if options is None:
            return cls()
        if isinstance(options, Options):
            return options
        fields = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(options, Mapping):
            raise ValueError(f"kimi_specialized options must be a dict with keys {fields}, got "
                             f"{type(options).__name__} {options!r}")
        unknown = set(options) - set(fields)
        if unknown:
            raise ValueError(f"unknown kimi_specialized options {sorted(unknown)}; expected {fields}")
        kwargs = dict(options)
        if "passes" in kwargs:
            passes = _sequence(kwargs["passes"], "passes", "['mega_moe']")
            kwargs["passes"] = tuple(sorted(passes, key=lambda p: _pass_rank(p) if isinstance(p, str) else -1))
        if "decode" in kwargs:
            kwargs["decode"] = DecodeSettings.from_mapping(kwargs["decode"])
        return cls(**kwargs)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def _sequence(value: Any, key: str, example: str) -> tuple:
    """A list option as a tuple; a string is refused (``"mega_moe"`` is not ``["mega_moe"]``)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{key} must be a list, e.g. {example}, got {type(value).__name__} {value!r}")
    return tuple(value)


def _pass_rank(name: str) -> int:
    if name not in PASS_ORDER:
        raise ValueError(f"unknown pass {name!r}; available: {list(PASS_ORDER)}")
    return PASS_ORDER.index(name)


# --------------------------------------------------------------------------- vLLM
# vLLM deployment settings live under one namespaced ``additional_config`` key.
# vLLM 0.33.0 itself reads ``additional_config["decode_backend"]`` (its SM100-only
# specialized decode), so our switch must never be that top-level key.
VLLM_KEY = "kimi_inductor"
VLLM_KEYS = ("decode_backend", "mla_core", "passes", "strict", "compiler", "sharded_moe_rows")
SUPPORTED_TP = (1, 2, 4, 8, 16)
MAX_SPECULATIVE_TOKENS = 7  # verify kernels take at most 8 tokens per request


@dataclass(frozen=True)
class DecodeConfig:
    """The deployment's decode settings (the seed's fields, same meanings)."""

    max_context: int  # model_config.max_model_len
    mla_core: str  # "auto" | "tokenspeed" | "trtllm" (vLLM's names; our MLA core is one kernel)
    dcp: int  # parallel_config.decode_context_parallel_size
    q: int  # 1 + speculative_config.num_speculative_tokens
    capture_sizes: tuple[int, ...]  # compilation_config.cudagraph_capture_sizes


def vllm_settings(vllm_config) -> dict[str, Any]:
    """``additional_config["kimi_inductor"]``, its keys checked (a misspelt key would
    otherwise be dropped silently)."""
    extra = getattr(vllm_config, "additional_config", None)
    settings = extra.get(VLLM_KEY, {}) if isinstance(extra, dict) else {}
    if not isinstance(settings, dict):
        raise ValueError(f"additional_config[{VLLM_KEY!r}] must be a dict, got {type(settings).__name__}")
    bad = sorted(set(settings) - set(VLLM_KEYS))
    if bad:
        raise ValueError(f"unknown additional_config[{VLLM_KEY!r}] keys {bad}; expected some of {list(VLLM_KEYS)}")
    mla_core = settings.get("mla_core", "auto")
    if mla_core not in ("auto", "tokenspeed", "trtllm"):
        raise ValueError(f"Kimi K3 MLA core {mla_core!r} (additional_config[{VLLM_KEY!r}]['mla_core']): expected "
                         "auto, tokenspeed or trtllm")
    return settings


def decode_requested(vllm_config) -> bool:
    """Whether the deployment asks for kimi_specialized's decode (``decode_backend`` is
    ``latency_specialized``; no validation: ``specialized_decode_config`` does that)."""
    return vllm_settings(vllm_config).get("decode_backend", "auto") == "latency_specialized"


def specialized_decode_config(vllm_config, capability: tuple[int, int] | None = None) -> DecodeConfig | None:
    """The deployment's kimi_specialized decode settings; None for the stock decode.

    Reads ``additional_config["kimi_inductor"]["decode_backend"]``: "auto" (default)
    -> None; "latency_specialized" -> a ``DecodeConfig``, or ``ValueError`` naming the
    first unsupported property of the deployment. ``capability`` overrides the GPU's
    compute capability (default: the current CUDA device's)."""
    settings = vllm_settings(vllm_config)
    backend = settings.get("decode_backend", "auto")
    if backend == "auto":
        return None
    if backend != "latency_specialized":
        raise ValueError("Supported decode_backend values are auto/latency_specialized")  # the seed's words
    reason = unsupported(vllm_config, capability)
    if reason is not None:
        raise ValueError(f"kimi_specialized decode does not support {reason}")
    spec = vllm_config.speculative_config
    return DecodeConfig(
        max_context=vllm_config.model_config.max_model_len,
        mla_core=settings.get("mla_core", "auto"),
        dcp=vllm_config.parallel_config.decode_context_parallel_size,
        q=1 + spec.num_speculative_tokens if spec is not None else 1,
        capture_sizes=tuple(vllm_config.compilation_config.cudagraph_capture_sizes or ()),
    )


def unsupported(vllm_config, capability: tuple[int, int] | None = None) -> str | None:
    """The first reason this deployment cannot run kimi_specialized's decode, or None."""
    import torch

    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    if extra.get("decode_backend", "auto") != "auto":
        return ("vLLM's own specialized decode (additional_config['decode_backend']) at the same time: "
                "set only additional_config['kimi_inductor']")
    if capability is None and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
    if capability is None:
        return "a machine without a CUDA GPU (SM90 or SM100 needed)"
    if capability[0] not in (9, 10):
        return f"this GPU (SM{capability[0]}{capability[1]}; SM90 or SM100/103 needed)"
    model = vllm_config.model_config
    if model is None:
        return "a deployment without a model config"
    text = model.hf_text_config
    moe = (getattr(text, "hidden_act", None) == "situ"
           and getattr(text, "activation_situ_beta", None) == 4.0
           and getattr(text, "activation_situ_linear_beta", None) == 25.0
           and getattr(text, "moe_router_activation_func", None) == "sigmoid"
           and getattr(text, "num_expert_group", 1) == 1 and getattr(text, "topk_group", 1) == 1
           and getattr(text, "routed_expert_hidden_size", None) is not None
           and getattr(text, "num_experts", None) is not None)
    if not moe:
        return "MoE configs but the one-group sigmoid SiTU (4, 25) latent MoE of Kimi K3"
    parallel = vllm_config.parallel_config
    tp = parallel.tensor_parallel_size
    if tp not in SUPPORTED_TP:
        return "TP other than 1/2/4/8/16"
    if parallel.pipeline_parallel_size != 1:
        return "pipeline parallelism"
    if parallel.decode_context_parallel_size not in (1, tp):
        return "decode context parallel other than 1 or TP"
    if getattr(vllm_config, "lora_config", None) is not None:
        return "LoRA"
    spec = vllm_config.speculative_config
    if spec is not None and spec.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
        return f"more than {MAX_SPECULATIVE_TOKENS} speculative tokens"
    if kda_dtypes(vllm_config) != (torch.bfloat16, torch.float32):
        return ("KDA cache dtypes other than a BF16 conv state and an FP32 recurrent state "
                "(mamba cache dtype)")
    return None


def kda_dtypes(vllm_config):
    """(conv, recurrent) KDA state dtypes the deployment's cache config selects (vLLM
    0.33.0's ``MambaStateDtypeCalculator.kda_state_dtype`` semantics)."""
    import torch

    model_dtype = vllm_config.model_config.dtype
    cache = vllm_config.cache_config
    conv = cache.mamba_cache_dtype
    names = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
             "float32": torch.float32, "float": torch.float32}
    if conv == "auto":
        conv_dtype = model_dtype if isinstance(model_dtype, torch.dtype) else names[model_dtype]
    elif conv in names:
        conv_dtype = names[conv]
    else:
        raise ValueError(f"unsupported mamba cache dtype {conv!r}")
    ssm = cache.mamba_ssm_cache_dtype
    if ssm == "auto":
        recurrent = torch.float32
    elif ssm in ("float32", "bfloat16"):
        recurrent = names[ssm]
    else:
        raise ValueError(f"KDA recurrent state supports only auto, float32, and bfloat16; got {ssm}")
    return conv_dtype, recurrent


def options_from_vllm(vllm_config) -> Options:
    """Backend options for a vLLM deployment: ``additional_config["kimi_inductor"]``
    (passes, strict, compiler, sharded_moe_rows) plus the decode settings vLLM's config
    implies."""
    given = vllm_settings(vllm_config)
    settings = {k: v for k, v in given.items() if k in ("passes", "strict", "compiler")}
    decode = {"sharded_moe_rows": given["sharded_moe_rows"]} if "sharded_moe_rows" in given else {}
    implied = specialized_decode_config(vllm_config)
    if implied is not None:
        decode.update(tp=vllm_config.parallel_config.tensor_parallel_size, q=implied.q, dcp=implied.dcp,
                      capture_sizes=list(implied.capture_sizes))
    if decode:
        settings["decode"] = decode
    return Options.from_mapping(settings)
