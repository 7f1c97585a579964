"""Kimi K3 text-decoder configuration, read from a Hugging Face ``config.json``.

Field names are the checkpoint's own (``hidden_size``, ``linear_attn_config``,
``num_experts_per_token``, ...). Layer lists in ``linear_attn_config`` and
``dsa_config`` are 1-based, as in the published files; every helper here takes a
0-based layer index.

Presets:
  ``kimi-k3``    the released dims (93 layers, hidden 7168, 896 experts).
  ``kimi-k3.1``  the same with the 24 MLA layers replaced by DSA.
  ``tiny``       every mechanism at toy size (KDA, MLA, dense layer 0, MoE, three
                 AttnRes bank slots); head, expert and vocab counts divide by 1, 2,
                 4 and 8 ranks.
  ``tiny-k3.1``  ``tiny`` with its MLA layers as DSA.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class KimiK3Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    linear_attn_config: dict[str, Any]
    intermediate_size: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int
    attn_res_block_size: int
    num_key_value_heads: int | None = None
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    dsa_config: dict[str, Any] | None = None
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    latent_moe_use_norm: bool = True
    moe_router_activation_func: str = "sigmoid"
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    topk_method: str = "noaux_tc"
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # vLLM pads a TP-sharded expert's intermediate slice up to this many rows.
    min_moe_intermediate_per_partition: int = 256
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "KimiK3Config":
        """Build from a ``config.json`` dict (top-level K3 or its ``text_config``)."""
        text = config.get("text_config", config)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: copy.deepcopy(v) for k, v in text.items() if k in names}
        extra = {k: v for k, v in text.items() if k not in names}
        missing = sorted(
            f.name
            for f in dataclasses.fields(cls)
            if f.name not in known
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        )
        if missing:
            raise ValueError(f"Kimi K3 config is missing fields {missing}")
        cfg = cls(**known, extra=extra)
        cfg.validate()
        return cfg

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` text config (round-trips through ``from_hf``)."""
        out = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}
        out.pop("extra")
        out.update(copy.deepcopy(self.extra))
        out.setdefault("model_type", "kimi_linear")
        out.setdefault("architectures", ["KimiLinearForCausalLM"])
        out.setdefault("torch_dtype", "bfloat16")
        return out

    def replace(self, **changes: Any) -> "KimiK3Config":
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        la = self.linear_attn_config
        for key in ("num_heads", "head_dim", "short_conv_kernel_size", "kda_layers"):
            if key not in la:
                raise ValueError(f"linear_attn_config lacks {key!r}")
        if not la.get("use_full_rank_gate", False):
            raise ValueError("Kimi K3 KDA needs linear_attn_config.use_full_rank_gate")
        bound = la.get("gate_lower_bound")
        if bound is None or not -5.0 <= bound < 0:
            raise ValueError(f"KDA gate_lower_bound must be in [-5, 0), got {bound}")
        if not self.mla_use_nope:
            raise ValueError("Kimi K3 MLA is NoPE-only (mla_use_nope must be true)")
        # flags whose other value the replica does not implement (it would ignore them)
        for key, value, what in (
                ("mla_use_output_gate", True, "MLA without its output gate"),
                ("latent_moe_use_norm", True, "a latent MoE without routed_expert_norm"),
                ("tie_word_embeddings", False, "an LM head tied to the embedding")):
            if getattr(self, key) is not value:
                raise ValueError(f"config {key} = {getattr(self, key)!r}: the Kimi K3 replica does not implement "
                                 f"{what}; it supports only {key} = {str(value).lower()}")
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise ValueError(f"config rms_norm_eps must be a number in (0, 1), got {eps!r} (<= 0 divides by zero "
                             "in RMSNorm; Kimi K3 uses 1e-5)")
        if self.moe_router_activation_func != "sigmoid" or self.hidden_act != "situ":
            raise ValueError("Kimi K3 uses a sigmoid router and SiTU activations")
        if self.dsa_config is not None:
            bad = [i for i in self.dsa_config["dsa_layers"] if i in la["kda_layers"]]
            if bad:
                raise ValueError(f"dsa_config lists KDA layers {bad}")

    # ----------------------------------------------------------------- schedule
    def layer_kind(self, i: int) -> str:
        """``"kda"``, ``"mla"`` or ``"dsa"`` for 0-based layer ``i``."""
        if (i + 1) in self.linear_attn_config["kda_layers"]:
            return "kda"
        if self.dsa_config is not None and (i + 1) in self.dsa_config["dsa_layers"]:
            return "dsa"
        return "mla"

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def num_attn_res_blocks(self) -> int:
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size)

    # -------------------------------------------------------------- derived dims
    @property
    def kda_heads(self) -> int:
        return self.linear_attn_config["num_heads"]

    @property
    def kda_head_dim(self) -> int:
        return self.linear_attn_config["head_dim"]

    @property
    def conv_size(self) -> int:
        return self.linear_attn_config["short_conv_kernel_size"]

    @property
    def gate_lower_bound(self) -> float:
        return self.linear_attn_config["gate_lower_bound"]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_row(self) -> int:
        """Values per token in the MLA latent cache (kv_lora_rank + rope dims)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def preset(cls, name: str) -> "KimiK3Config":
        try:
            return cls.from_hf(PRESETS[name]())
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None


def _schedule(num_layers: int) -> tuple[list[int], list[int]]:
    """K3's layer schedule (1-based): attention every 4th layer and the last one."""
    full = [i for i in range(1, num_layers + 1) if i % 4 == 0 or i == num_layers]
    kda = [i for i in range(1, num_layers + 1) if i not in full]
    return kda, full


def _kimi_k3() -> dict[str, Any]:
    kda, full = _schedule(93)
    return {
        "model_type": "kimi_linear",
        "vocab_size": 163840,
        "hidden_size": 7168,
        "num_hidden_layers": 93,
        "num_attention_heads": 96,
        "num_key_value_heads": 96,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "linear_attn_config": {
            "num_heads": 96,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
            "kda_layers": kda,
            "full_attn_layers": full,
        },
        "intermediate_size": 33792,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_experts": 896,
        "num_experts_per_token": 16,
        "num_shared_experts": 2,
        "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "topk_method": "noaux_tc",
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 12,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "max_position_embeddings": 1048576,
        "rope_theta": 10000.0,
        "num_nextn_predict_layers": 0,
    }


def _with_dsa(cfg: dict[str, Any], heads: int, head_dim: int, topk: int) -> dict[str, Any]:
    # K3.1 field names are not public in vLLM 0.33.0; these follow DeepSeek V3.2's
    # index_* names (docs/architecture.md, "DSA").
    cfg = copy.deepcopy(cfg)
    cfg["dsa_config"] = {
        "dsa_layers": list(cfg["linear_attn_config"]["full_attn_layers"]),
        "index_n_heads": heads,
        "index_head_dim": head_dim,
        "index_topk": topk,
    }
    return cfg


def _tiny() -> dict[str, Any]:
    kda, full = _schedule(9)
    cfg = _kimi_k3()
    cfg.update(
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=9,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        intermediate_size=256,
        num_experts=8,
        num_experts_per_token=2,
        moe_intermediate_size=32,
        routed_expert_hidden_size=64,
        attn_res_block_size=4,
    )
    cfg["linear_attn_config"].update(num_heads=8, head_dim=16, kda_layers=kda, full_attn_layers=full)
    return cfg


PRESETS = {
    "kimi-k3": _kimi_k3,
    "kimi-k3.1": lambda: _with_dsa(_kimi_k3(), heads=32, head_dim=128, topk=2048),
    "tiny": _tiny,
    "tiny-k3.1": lambda: _with_dsa(_tiny(), heads=4, head_dim=16, topk=8),
}
