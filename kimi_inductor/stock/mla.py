"""MLA (NoPE, gated) decode: the module and its core op ``kimi::mla_decode``.

Per rank (N_l = heads / G; L = kv_lora_rank, R = rope dims, qk = nope + R):
  fused_qkv_a_g_proj  x -> [q_a q_lora | kv_a L+R (both replicated) | gate N_l v]
  q_a / kv_a RMSNorm  (eps = rms_norm_eps)
  q_b_proj            q_c -> q [T, N_l, nope | R]  (no rotary embedding: NoPE)
  absorption          ql = q_nope W_UK  [T, N_l, L] with kv_b viewed [N_l, nope+v, L]
  kimi::mla_decode    writes [kv_c | k_pe] (576 values per token in K3) into the
                      latent cache, attends over it -> [T, N_l, L]
  v up-projection     latent W_UV^T -> [T, N_l v]
  output gate         attn * sigmoid(gate) (fp32, one rounding)
  o_proj              all-reduced in TP, a partial in SP.

``kimi::mla_decode`` stands where vLLM calls ``impl.forward_mqa`` (FlashMLA et al.)
after the fused query-concat / cache-insert kernel. For query token j of request
r (position seq_len - q + j) it scores every cached position s <= that position:
``([ql | q_pe] . cache[s]) qk^-1/2``, softmax in fp32, and returns
``sum_s p_s cache[s][:L]`` in bf16. Requests with ``seq_len == 0`` are padding:
zero output. Tokens with ``slot_mapping < 0`` are not written.

With decode context parallelism (``Parallel.dcp = G``, ``dcp.py``) the cache is
sharded by position over the ranks: the layer all-gathers the query heads, calls
``kimi::mla_decode_dcp`` (cache write of the positions this rank owns, attention of
all G N heads over its positions -> partial output and log-sum-exp) and combines the
partials (LSE all-gather, reduce-scatter over heads).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from . import dcp
from .config import KimiK3Config
from .layers import Linear, RMSNorm
from .library import stock_op
from .parallel import Parallel, all_reduce
from .state import DecodeStep, LayerCache, tokens_per_request


def write_cache(cache: Tensor, slot_mapping: Tensor, rows: Tensor) -> None:
    """Store ``rows`` [T, d] at ``slot_mapping`` of a paged cache [blocks, block, d];
    slots < 0 are not written (they rewrite slot 0, of the never-used block 0, with
    its own value: no data-dependent shapes, so the reference stays capturable)."""
    flat = cache.view(-1, cache.shape[-1])
    keep = (slot_mapping >= 0)[:, None]
    slots = slot_mapping.clamp(min=0)
    flat[slots] = torch.where(keep, rows.to(cache.dtype), flat[slots])


def gather_context(cache: Tensor, block_table: Tensor) -> Tensor:
    """Every request's cache rows in position order: [R, blocks * block_size, d]."""
    R = block_table.shape[0]
    return cache[block_table.long()].reshape(R, -1, cache.shape[-1])


def causal_mask(seq_lens: Tensor, q: int, width: int) -> Tensor:
    """[R, q, width] over an unsharded cache: query j of request r sees positions <= seq_len - q + j."""
    return dcp.causal_mask_at(torch.arange(width, device=seq_lens.device), seq_lens, q)


def latent_attention(query: Tensor, context: Tensor, mask: Tensor, latent: int, scale: float,
                     with_lse: bool = False):
    """query [R, q, N, L+R], context [R, W, L+R], mask [R, q, W] -> [R, q, N, L] fp32
    (and the log-sum-exp of the scores [R, q, N], -inf where nothing is visible)."""
    scores = torch.einsum("rqnd,rwd->rqnw", query.float(), context.float()) * scale
    scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows: padding
    out = torch.einsum("rqnw,rwd->rqnd", probs, context[..., :latent].float())
    return (out, torch.logsumexp(scores, dim=-1)) if with_lse else out


def _fake(ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, scale):
    tokens_per_request(ql_nope.shape[0], block_table.shape[0], "kimi::mla_decode")
    return ql_nope.new_empty(ql_nope.shape)


@stock_op("mla_decode", mutates_args=("kv_cache",), fake=_fake)
def mla_decode(
    ql_nope: Tensor,
    q_pe: Tensor,
    kv_c: Tensor,
    k_pe: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
) -> Tensor:
    tokens_per_request(ql_nope.shape[0], block_table.shape[0], "kimi::mla_decode")
    write_cache(kv_cache, slot_mapping, torch.cat([kv_c, k_pe], dim=-1))
    return attend_cache(ql_nope, q_pe, kv_cache, block_table, seq_lens, scale)


def _dcp_fake(ql_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, selected, dcp_rank,
              dcp_size, scale):
    T, N, L = ql_nope.shape
    tokens_per_request(T, block_table.shape[0], "kimi::mla_decode_dcp")
    return ql_nope.new_empty(T, N, L, dtype=torch.float32), ql_nope.new_empty(T, N, dtype=torch.float32)


@stock_op("mla_decode_dcp", mutates_args=("kv_cache",), fake=_dcp_fake)
def mla_decode_dcp(
    ql_nope: Tensor,
    q_pe: Tensor,
    kv_c: Tensor,
    k_pe: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    selected: Optional[Tensor],
    dcp_rank: int,
    dcp_size: int,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """One rank's share of DCP attention: all G N heads (ql_nope [T, G N, L]) over the
    positions this rank holds; ``selected`` [T, W_local] (DSA) narrows them further.
    Returns the partial output [T, G N, L] and log-sum-exp [T, G N], both fp32."""
    tokens_per_request(ql_nope.shape[0], block_table.shape[0], "kimi::mla_decode_dcp")
    write_cache(kv_cache, dcp.local_slots(slot_mapping, kv_cache.shape[1], dcp_rank, dcp_size),
                torch.cat([kv_c, k_pe], dim=-1))
    return attend_cache(ql_nope, q_pe, kv_cache, block_table, seq_lens, scale, dcp_rank, dcp_size, selected,
                        with_lse=True)


def attend_cache(ql_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                 scale: float, dcp_rank: int = 0, dcp_size: int = 1, selected: Tensor | None = None,
                 with_lse: bool = False):
    """The core after the cache write: every request's query rows [T, N, L | R] over the
    cache positions this rank holds (all of them without DCP), causal, narrowed by
    ``selected`` [T, W] (DSA) -> [T, N, L] in the query dtype, or with ``with_lse`` the
    fp32 output and its log-sum-exp [T, N]."""
    R = block_table.shape[0]
    T, N, L = ql_nope.shape
    q = T // R
    context = gather_context(kv_cache, block_table)
    positions = dcp.context_positions(context.shape[1], kv_cache.shape[1], dcp_rank, dcp_size, context.device)
    mask = dcp.causal_mask_at(positions, seq_lens, q)
    if selected is not None:
        mask = mask & selected.view(R, q, -1)
    query = torch.cat([ql_nope, q_pe], dim=-1).view(R, q, N, -1)
    if with_lse:
        out, lse = latent_attention(query, context, mask, L, scale, with_lse=True)
        return out.reshape(T, N, L), lse.reshape(T, N)
    return latent_attention(query, context, mask, L, scale).reshape(T, N, L).to(ql_nope.dtype)


def output_gate(attn: Tensor, gate: Tensor) -> Tensor:
    """The sigmoid output gate: attn * sigmoid(gate) in fp32, rounded once to attn's dtype."""
    return (attn.float() * torch.sigmoid(gate.float())).to(attn.dtype)


class MultiHeadLatentAttention(nn.Module):
    """vLLM 0.33.0's K3 ``MultiHeadLatentAttention`` on one rank."""

    def __init__(self, config: KimiK3Config, par: Parallel, device=None):
        super().__init__()
        self.par = par
        self.num_local_heads = N = par.shard(config.num_attention_heads, "attention heads")
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.scale = config.qk_head_dim**-0.5
        H, eps = config.hidden_size, config.rms_norm_eps
        rows = config.q_lora_rank + config.latent_row + N * config.v_head_dim
        self.fused_qkv_a_g_proj = Linear(H, rows, device=device)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps, device=device)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, eps, device=device)
        self.q_b_proj = Linear(config.q_lora_rank, N * config.qk_head_dim, device=device)
        self.kv_b_proj = Linear(config.kv_lora_rank, N * (config.qk_nope_head_dim + config.v_head_dim),
                                device=device)
        self.o_proj = Linear(N * config.v_head_dim, H, device=device)

    def project(self, x: Tensor):
        """Projections and absorption: (q_c, ql_nope, q_pe, kv_c, k_pe, gate)."""
        N, L, R = self.num_local_heads, self.kv_lora_rank, self.qk_rope_head_dim
        qkv_lora, gate = self.fused_qkv_a_g_proj(x).split(
            [self.q_lora_rank + L + R, N * self.v_head_dim], dim=-1)
        q_c, kv_c, k_pe = qkv_lora.split([self.q_lora_rank, L, R], dim=-1)
        q_c, kv_c = self.q_a_layernorm(q_c), self.kv_a_layernorm(kv_c)
        q = self.q_b_proj(q_c).view(-1, N, self.qk_nope_head_dim + R)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, R], dim=-1)
        w_uk = self.kv_b_proj.weight.view(N, -1, L)[:, : self.qk_nope_head_dim]  # [N, nope, L]
        ql_nope = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        return q_c, ql_nope, q_pe, kv_c, k_pe, gate

    def output(self, latent: Tensor, gate: Tensor) -> Tensor:
        """v up-projection, sigmoid output gate, o_proj (+ all-reduce in TP)."""
        N, L = self.num_local_heads, self.kv_lora_rank
        w_uv = self.kv_b_proj.weight.view(N, -1, L)[:, self.qk_nope_head_dim :]  # [N, v, L]
        attn = torch.bmm(latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        attn = attn.reshape(latent.shape[0], -1)
        out = self.o_proj(output_gate(attn, gate))
        return out if self.par.sequence_parallel else all_reduce(out, self.par)

    def forward(self, x: Tensor, step: DecodeStep, cache: LayerCache) -> Tensor:
        _, ql_nope, q_pe, kv_c, k_pe, gate = self.project(x)
        (kv_cache,) = cache
        if self.par.dcp > 1:
            latent = self.dcp_attention(ql_nope, q_pe, kv_c, k_pe, kv_cache, step)
        else:
            latent = torch.ops.kimi.mla_decode(
                ql_nope, q_pe, kv_c, k_pe, kv_cache, step.slot_mapping, step.block_table,
                step.seq_lens, self.scale)
        return self.output(latent, gate)

    def dcp_attention(self, ql_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                      step: DecodeStep, selected: Tensor | None = None) -> Tensor:
        """Query-head all-gather, this rank's partial attention, LSE combine (``dcp.py``)."""
        par = self.par
        query = dcp.gather_heads(torch.cat([ql_nope, q_pe], dim=-1), par)  # one all-gather, as vLLM
        ql_all, q_pe_all = query.split([ql_nope.shape[-1], q_pe.shape[-1]], dim=-1)
        out, lse = torch.ops.kimi.mla_decode_dcp(
            ql_all, q_pe_all, kv_c, k_pe, kv_cache, step.slot_mapping, step.block_table, step.seq_lens,
            selected, par.rank, par.size, self.scale)
        return dcp.combine(out, lse, par).to(ql_nope.dtype)

    @staticmethod
    def cache_shapes(config: KimiK3Config, num_blocks: int, block_size: int, dtype: torch.dtype):
        """``block_size``: this rank's rows per block (the virtual block / DCP size)."""
        return (((num_blocks, block_size, config.latent_row), dtype),)
