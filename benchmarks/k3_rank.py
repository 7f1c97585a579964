"""Kimi K3 at one rank's shapes for the whole-decoder benchmarks (``router_flips.py``,
``decode_step.py``): the config, a random checkpoint drawn on the GPU, cache contents."""

from __future__ import annotations

import torch
from torch import Tensor

from kimi_inductor.stock import KimiK3Config
from kimi_inductor.stock import config as stock_config
from kimi_inductor.stock.checkpoint import random_checkpoint
from kimi_inductor.stock.mxfp4 import mxfp4_quantize


def per_rank_config(layers: int = 4, experts: int = 64, tp: int = 8) -> KimiK3Config:
    """Kimi K3 at one TP rank's shapes: heads / tp, dense width / tp, vocab / tp, and
    ``experts`` routed experts of full width (the experts an EP rank holds)."""
    cfg = stock_config._kimi_k3()
    kda, full = stock_config._schedule(layers)
    heads = cfg["num_attention_heads"] // tp
    cfg.update(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
               intermediate_size=cfg["intermediate_size"] // tp, vocab_size=cfg["vocab_size"] // tp,
               num_experts=experts)
    cfg["linear_attn_config"].update(num_heads=heads, kda_layers=kda, full_attn_layers=full)
    return KimiK3Config.from_hf(cfg)


def smoke_config() -> KimiK3Config:
    return KimiK3Config.preset("tiny").replace(num_experts=16, num_experts_per_token=4)


def checkpoint(config: KimiK3Config, seed: int, device: str, mxfp4: bool = False) -> dict[str, Tensor]:
    """``random_checkpoint`` (same scales), with the routed experts, router weights and
    bias drawn on ``device`` (64 x 3 x 11M expert values are a minute of CPU randn); the
    experts MXFP4-quantised (and so loaded packed) with ``mxfp4``."""
    one = random_checkpoint(config.replace(num_experts=1), seed)
    tensors = {k: v for k, v in one.items() if ".experts." not in k}
    gen = torch.Generator(device=device).manual_seed(seed + 1000)
    E, L, I, H = (config.num_experts, config.routed_expert_hidden_size, config.moe_intermediate_size,
                  config.hidden_size)

    def proj(out, inp):
        return (torch.randn(out, inp, generator=gen, device=device) * inp**-0.5).to(torch.bfloat16)

    for i in range(config.num_hidden_layers):
        if not config.is_moe_layer(i):
            continue
        m = f"model.layers.{i}.block_sparse_moe."
        tensors[m + "gate.weight"] = proj(E, H)
        tensors[m + "gate.e_score_correction_bias"] = torch.randn(E, generator=gen, device=device) * 0.1
        for e in range(E):
            for name, shape in (("w1", (I, L)), ("w3", (I, L)), ("w2", (L, I))):
                key = f"{m}experts.{e}.{name}.weight"
                if mxfp4:
                    tensors[key + "_packed"], tensors[key + "_scale"] = mxfp4_quantize(proj(*shape))
                else:
                    tensors[key] = proj(*shape)
    return tensors


def fill_caches(caches, seed: int, device) -> None:
    """Deterministic cache contents for a trial, the same values in every dtype (bf16
    values; the KDA recurrent state is fp32 in every model)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for cache in caches:
        for t in cache:
            vals = torch.randn(t.shape, generator=gen, device=device)
            if t.dim() == 4:  # KDA recurrent state [slots, heads, V, K]
                vals = vals * 0.1
            t.copy_(vals.to(torch.bfloat16) if t.dim() != 4 else vals)
