"""The stock Kimi K3 text decoder on one rank: decoder layer, backbone, LM head.

One decode step (``KimiLinearModel.forward``), T rows, G ranks:

  x = embed(ids)                     vocab-parallel lookup + all-reduce      [T]
  sp: mask = sp_padding_mask(is_padding); x = sp_shard(x)                    [c]
  bank = empty(rows, NB, hidden); prefix = x; hidden = None
  for layer i:
      h = attn_res(prefix, hidden, bank, ...)         pre-attn mix + input norm
      sp: h = all_gather(h)[:T]
      a = attention(h)                                TP heads; o_proj partial
      tp: a = all_reduce(a)        sp: a = reduce_scatter(pad(a))
      write layer: prefix = a, delta = None; else delta = a
      x = attn_res(prefix, delta, bank, ...)          post-attn mix + norm
      hidden = mlp(x)                                 MoE or dense (layer 0)
  out = attn_res(prefix, hidden, bank, final weights, no norm)
  sp: out = all_gather(out)[:T]
  return out                                          pre-norm hidden [T, hidden]

``attn_res`` updates ``prefix`` and ``bank`` in place; the MLP output enters the
next mix as its delta. Module and parameter names follow vLLM 0.33.0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attn_res import rms_norm
from .config import KimiK3Config
from .dsa import SparseLatentAttention
from .kda import KimiDeltaAttention
from .layers import Linear, RMSNorm
from .mla import MultiHeadLatentAttention
from .moe import DenseMLP, KimiMoE
from .parallel import Parallel, all_gather, all_reduce, sp_all_gather, sp_padding_mask, sp_reduce_scatter, sp_shard
from .state import DecodeStep, LayerCache, check_q

ATTENTION = {"kda": KimiDeltaAttention, "mla": MultiHeadLatentAttention, "dsa": SparseLatentAttention}


class KimiDecoderLayer(nn.Module):
    def __init__(self, config: KimiK3Config, layer_idx: int, par: Parallel, device=None):
        super().__init__()
        self.layer_idx = i = layer_idx
        self.par = par
        self.kind = config.layer_kind(i)
        self.is_moe_layer = config.is_moe_layer(i)
        B = config.attn_res_block_size
        self.is_block_write_layer = i % B == 0
        self.block_write_idx = i // B
        self.prev_valid_blocks = -(-i // B)
        H, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = ATTENTION[self.kind](config, par, device)
        if self.is_moe_layer:
            self.block_sparse_moe = KimiMoE(config, par, device)
        else:
            self.mlp = DenseMLP(config, par, device)
        self.input_layernorm = RMSNorm(H, eps, device=device)
        self.post_attention_layernorm = RMSNorm(H, eps, device=device)
        self.self_attention_res_norm = RMSNorm(H, eps, device=device)
        self.self_attention_res_proj = Linear(H, 1, device=device)
        self.mlp_res_norm = RMSNorm(H, eps, device=device)
        self.mlp_res_proj = Linear(H, 1, device=device)

    @property
    def mlp(self) -> nn.Module:  # vLLM aliases the MoE as ``mlp``
        return self._modules.get("block_sparse_moe") or self._modules["mlp"]

    def _pre_attn_norm(self, hidden: Tensor | None, bank: Tensor, prefix: Tensor) -> Tensor:
        return torch.ops.kimi.attn_res(
            prefix, hidden, bank, self.self_attention_res_norm.weight,
            self.self_attention_res_proj.weight[0], self.input_layernorm.weight,
            self.prev_valid_blocks, self.block_write_idx if self.is_block_write_layer else -1,
            self.self_attention_res_norm.variance_epsilon, self.input_layernorm.variance_epsilon)

    def _post_attn_norm(self, attn: Tensor, bank: Tensor, prefix: Tensor) -> tuple[Tensor, Tensor]:
        prefix, delta = (attn, None) if self.is_block_write_layer else (prefix, attn)
        x = torch.ops.kimi.attn_res(
            prefix, delta, bank, self.mlp_res_norm.weight, self.mlp_res_proj.weight[0],
            self.post_attention_layernorm.weight,
            self.prev_valid_blocks + self.is_block_write_layer, -1,
            self.mlp_res_norm.variance_epsilon, self.post_attention_layernorm.variance_epsilon)
        return x, prefix

    def forward(self, hidden: Tensor | None, prefix: Tensor, bank: Tensor, step: DecodeStep,
                cache: LayerCache, is_padding: Tensor) -> tuple[Tensor, Tensor]:
        h = self._pre_attn_norm(hidden, bank, prefix)
        if self.par.sequence_parallel:
            h = sp_all_gather(h, step.rows, self.par)
        a = self.self_attn(h, step, cache)
        if self.par.sequence_parallel:
            a = sp_reduce_scatter(a, self.par)
        x, prefix = self._post_attn_norm(a, bank, prefix)
        return self.mlp(x, is_padding), prefix


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, par: Parallel, device=None):
        super().__init__()
        self.par = par
        self.shard_size = par.shard(vocab, "vocab size")
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden, dtype=torch.bfloat16, device=device),
                                   requires_grad=False)

    def forward(self, ids: Tensor) -> Tensor:
        if self.par.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.par.rank * self.shard_size
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside[:, None], 0), self.par)


class KimiLinearModel(nn.Module):
    """The backbone: embedding, decoder layers, final AttnRes mix (pre-norm output)."""

    def __init__(self, config: KimiK3Config, par: Parallel, device=None):
        super().__init__()
        self.config, self.par = config, par
        H, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, H, par, device)
        self.layers = nn.ModuleList(
            KimiDecoderLayer(config, i, par, device) for i in range(config.num_hidden_layers))
        self.num_attn_res_blocks = config.num_attn_res_blocks
        self.norm = RMSNorm(H, eps, device=device)
        self.output_attn_res_norm = RMSNorm(H, eps, device=device)
        self.output_attn_res_proj = Linear(H, 1, device=device)

    def forward(self, step: DecodeStep, caches: list[LayerCache]) -> Tensor:
        x = self.embed_tokens(step.input_ids)
        is_padding = step.is_padding
        if self.par.sequence_parallel:
            is_padding = sp_padding_mask(is_padding, self.par)
            x = sp_shard(x, self.par)
        bank = x.new_empty(x.shape[0], self.num_attn_res_blocks, x.shape[1])
        prefix, hidden = x, None
        for layer, cache in zip(self.layers, caches):
            hidden, prefix = layer(hidden, prefix, bank, step, cache, is_padding)
        out = torch.ops.kimi.attn_res(
            prefix, hidden, bank, self.output_attn_res_norm.weight, self.output_attn_res_proj.weight[0],
            None, self.num_attn_res_blocks, -1, self.output_attn_res_norm.variance_epsilon, 0.0)
        if self.par.sequence_parallel:
            out = sp_all_gather(out, step.rows, self.par)
        return out


class KimiLinearForCausalLM(nn.Module):
    """Backbone plus the vocab-parallel LM head; ``forward`` returns pre-norm hidden states."""

    def __init__(self, config: KimiK3Config, par: Parallel | None = None, device=None):
        super().__init__()
        par = par or Parallel()
        self.config, self.par = config, par
        self.model = KimiLinearModel(config, par, device)
        self.lm_head = Linear(config.hidden_size, par.shard(config.vocab_size, "vocab size"), device=device)

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (bf16 as served; fp32 for exact equivalence checks)."""
        return self.model.embed_tokens.weight.dtype

    def forward(self, step: DecodeStep, caches: list[LayerCache]) -> Tensor:
        return self.model(step, caches)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Final RMSNorm, vocab-parallel LM head, gather of the vocab shards -> fp32 logits."""
        logits = F.linear(rms_norm(hidden, self.model.norm.weight, self.model.norm.variance_epsilon),
                          self.lm_head.weight)
        if self.par.size > 1:
            logits = all_gather(logits.t().contiguous(), self.par).t()
        return logits.float()

    def validate_step(self, step: DecodeStep, caches: list[LayerCache]) -> DecodeStep:
        """``step.validate`` with this model's vocabulary and these caches' sizes (KDA
        slots, latent-cache blocks and block size), after checking that the caches are
        this model's and were allocated for the step's q; returns the step."""
        if len(caches) != len(self.model.layers):
            raise ValueError(f"{len(caches)} layer caches for {len(self.model.layers)} layers")
        sizes: dict = {"vocab_size": self.config.vocab_size}
        for layer, cache in zip(self.model.layers, caches):
            if layer.kind == "kda":
                sizes["num_slots"] = cache[0].shape[0]
                q = cache[0].shape[1] - (self.config.conv_size - 1) + 1
                if q != step.q:
                    raise ValueError(f"the caches were allocated for q = {q} tokens per request (KDA conv state "
                                     f"rows), the step has q = {step.q}: allocate_caches(..., q={step.q})")
            else:
                sizes["num_blocks"], sizes["block_size"] = cache[0].shape[0], cache[0].shape[1] * self.par.dcp
        return step.validate(**sizes)

    def allocate_caches(self, num_slots: int, num_blocks: int, block_size: int, q: int,
                        device=None) -> list[LayerCache]:
        """Zeroed per-layer caches: ``num_slots`` KDA state slots (slot 0 is the null
        slot), a paged latent cache of ``num_blocks`` x ``block_size`` tokens (with DCP
        = G each rank holds block_size / G rows of every block); conv state and latent
        caches in the model dtype, the KDA recurrent state in fp32."""
        check_q(q, "allocate_caches")
        out, dtype = [], self.dtype
        for layer in self.model.layers:
            if layer.kind == "kda":
                shapes = KimiDeltaAttention.cache_shapes(self.config, self.par, num_slots, q, dtype)
            else:
                if block_size % self.par.dcp:
                    raise ValueError(f"block size {block_size} is not divisible by the DCP size {self.par.dcp}")
                shapes = ATTENTION[layer.kind].cache_shapes(self.config, num_blocks, block_size // self.par.dcp,
                                                            dtype)
            out.append(tuple(torch.zeros(s, dtype=d, device=device) for s, d in shapes))
        return out
