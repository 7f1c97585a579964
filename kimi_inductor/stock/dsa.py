"""DSA (Kimi K3.1's sparse MLA): the lightning indexer and ``kimi::dsa_decode``.

vLLM 0.33.0 has no DSA for Kimi K3. This follows DeepSeek V3.2's indexer as vLLM
implements it, with K3.1's published shape (32 heads x 128, top-2048, no RoPE, the
key LayerNorm eps taken from rms_norm_eps); docs/architecture.md lists what is
inferred. The indexer is replicated on every TP rank:
  index_q  = wq_b(q_c)               [T, n_idx, d_idx]  (normalised q latent)
  index_k  = k_norm(wk(x))           [T, d_idx]         (LayerNorm, cached per token)
  index_w  = weights_proj(x) n_idx^-1/2 d_idx^-1/2    [T, n_idx] fp32
``kimi::dsa_decode`` writes the token's latent row and indexer key, scores every
visible position ``I[t, s] = sum_h index_w[t, h] relu(index_q[t, h] . index_k[s])``,
keeps the ``topk`` best (all when fewer are visible) and runs the MLA core of
``mla.py`` over those positions only. Keys are kept in bf16 (V3.2 stores FP8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import dcp
from .config import KimiK3Config
from .layers import Linear
from .library import stock_op
from .mla import MultiHeadLatentAttention, attend_cache, causal_mask, gather_context, write_cache
from .parallel import Parallel, all_gather
from .state import DecodeStep, LayerCache, tokens_per_request


def index_scores(index_q: Tensor, index_w: Tensor, keys: Tensor, visible: Tensor) -> Tensor:
    """index_q [R, q, n, d], index_w [R, q, n], keys [R, W, d], visible [R, q, W] -> I
    [R, q, W] fp32, -inf where not visible."""
    logits = torch.einsum("rqnd,rwd->rqnw", index_q.float(), keys.float()).relu()
    return (logits * index_w.float().unsqueeze(-1)).sum(2).masked_fill(~visible, float("-inf"))


def topk_mask(scores: Tensor, topk: int) -> Tensor:
    """The ``topk`` best visible positions of each row of ``scores`` [..., W] in position
    order (all when fewer); ties go to the earlier position, so that every layout of
    the cache (DCP included) selects the same positions (the random test model's
    indexer ReLU makes ties common)."""
    k = min(topk, scores.shape[-1])
    best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, best, True)
    return chosen & (scores > float("-inf"))


def _fake(ql_nope, q_pe, kv_c, k_pe, index_q, index_k, index_w, kv_cache, index_cache,
          slot_mapping, block_table, seq_lens, topk, scale):
    tokens_per_request(ql_nope.shape[0], block_table.shape[0], "kimi::dsa_decode")
    return ql_nope.new_empty(ql_nope.shape)


@stock_op("dsa_decode", mutates_args=("kv_cache", "index_cache"), fake=_fake)
def dsa_decode(
    ql_nope: Tensor,
    q_pe: Tensor,
    kv_c: Tensor,
    k_pe: Tensor,
    index_q: Tensor,
    index_k: Tensor,
    index_w: Tensor,
    kv_cache: Tensor,
    index_cache: Tensor,
    slot_mapping: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    topk: int,
    scale: float,
) -> Tensor:
    tokens_per_request(ql_nope.shape[0], block_table.shape[0], "kimi::dsa_decode")
    write_cache(kv_cache, slot_mapping, torch.cat([kv_c, k_pe], dim=-1))
    write_cache(index_cache, slot_mapping, index_k)
    selected = select_topk(index_q, index_w, index_cache, block_table, seq_lens, topk)
    return attend_cache(ql_nope, q_pe, kv_cache, block_table, seq_lens, scale, selected=selected)


def select_topk(index_q: Tensor, index_w: Tensor, index_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                topk: int) -> Tensor:
    """The indexer's choice over the (written) index cache: [R, q, W] bool, W the block
    table's capacity; index_q [T, n, d], index_w [T, n] with T = R q."""
    R = block_table.shape[0]
    q = index_q.shape[0] // R
    keys = gather_context(index_cache, block_table)
    visible = causal_mask(seq_lens, q, keys.shape[1])
    return topk_mask(index_scores(index_q.view(R, q, *index_q.shape[1:]), index_w.view(R, q, -1), keys, visible),
                     topk)


def select_topk_dcp(scores: Tensor, topk: int, block_local: int, par: Parallel) -> Tensor:
    """Every rank's indexer scores [T, W_local] (all-gathered, put in position order) ->
    this rank's share of the ``topk`` best positions over all ranks: the same choice on
    every rank, and the one ``topk_mask`` makes without DCP."""
    T, W = scores.shape
    G = par.size
    every = all_gather(scores.contiguous(), par).view(G, T, W).transpose(0, 1).reshape(T, G * W)
    positions = torch.cat([dcp.context_positions(W, block_local, g, G, scores.device) for g in range(G)])
    chosen = topk_mask(every[:, torch.argsort(positions)], topk)[:, positions]
    return chosen.view(T, G, W)[:, par.rank]


def _index_dcp_fake(index_q, index_k, index_w, index_cache, slot_mapping, block_table, seq_lens, dcp_rank,
                    dcp_size):
    tokens_per_request(index_q.shape[0], block_table.shape[0], "kimi::dsa_index_dcp")
    width = block_table.shape[1] * index_cache.shape[1]
    return index_q.new_empty(index_q.shape[0], width, dtype=torch.float32)


@stock_op("dsa_index_dcp", mutates_args=("index_cache",), fake=_index_dcp_fake)
def dsa_index_dcp(index_q: Tensor, index_k: Tensor, index_w: Tensor, index_cache: Tensor, slot_mapping: Tensor,
                  block_table: Tensor, seq_lens: Tensor, dcp_rank: int, dcp_size: int) -> Tensor:
    """DCP: write the indexer keys this rank owns, score this rank's positions -> [T, W_local]."""
    R = block_table.shape[0]
    q = tokens_per_request(index_q.shape[0], R, "kimi::dsa_index_dcp")
    block = index_cache.shape[1]
    write_cache(index_cache, dcp.local_slots(slot_mapping, block, dcp_rank, dcp_size), index_k)
    keys = gather_context(index_cache, block_table)
    visible = dcp.causal_mask_at(dcp.context_positions(keys.shape[1], block, dcp_rank, dcp_size, keys.device),
                                 seq_lens, q)
    scores = index_scores(index_q.view(R, q, *index_q.shape[1:]), index_w.view(R, q, -1), keys, visible)
    return scores.reshape(index_q.shape[0], -1)


class Indexer(nn.Module):
    def __init__(self, config: KimiK3Config, device=None):
        super().__init__()
        dsa = config.dsa_config
        self.n_head, self.head_dim, self.topk = dsa["index_n_heads"], dsa["index_head_dim"], dsa["index_topk"]
        self.eps = config.rms_norm_eps
        self.wq_b = Linear(config.q_lora_rank, self.n_head * self.head_dim, device=device)
        self.wk = Linear(config.hidden_size, self.head_dim, device=device)
        self.weights_proj = Linear(config.hidden_size, self.n_head, device=device)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=self.eps, dtype=torch.float32, device=device)
        self.k_norm.requires_grad_(False)

    def forward(self, x: Tensor, q_c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        index_q = self.wq_b(q_c).view(-1, self.n_head, self.head_dim)
        k = self.wk(x)
        index_k = F.layer_norm(k.float(), (self.head_dim,), self.k_norm.weight, self.k_norm.bias,
                               self.eps).to(k.dtype)
        index_w = self.weights_proj(x).float() * (self.n_head**-0.5 * self.head_dim**-0.5)
        return index_q, index_k, index_w


class SparseLatentAttention(MultiHeadLatentAttention):
    """K3.1's DSA layer: the MLA projections plus the indexer (``self_attn.indexer``)."""

    def __init__(self, config: KimiK3Config, par: Parallel, device=None):
        super().__init__(config, par, device)
        self.indexer = Indexer(config, device)

    def forward(self, x: Tensor, step: DecodeStep, cache: LayerCache) -> Tensor:
        q_c, ql_nope, q_pe, kv_c, k_pe, gate = self.project(x)
        index_q, index_k, index_w = self.indexer(x, q_c)
        kv_cache, index_cache = cache
        if self.par.dcp > 1:
            scores = torch.ops.kimi.dsa_index_dcp(index_q, index_k, index_w, index_cache, step.slot_mapping,
                                                  step.block_table, step.seq_lens, self.par.rank, self.par.size)
            selected = select_topk_dcp(scores, self.indexer.topk, index_cache.shape[1], self.par)
            return self.output(self.dcp_attention(ql_nope, q_pe, kv_c, k_pe, kv_cache, step, selected), gate)
        latent = torch.ops.kimi.dsa_decode(
            ql_nope, q_pe, kv_c, k_pe, index_q, index_k, index_w, kv_cache, index_cache,
            step.slot_mapping, step.block_table, step.seq_lens, self.indexer.topk, self.scale)
        return self.output(latent, gate)

    @staticmethod
    def cache_shapes(config: KimiK3Config, num_blocks: int, block_size: int, dtype: torch.dtype):
        index_dim = config.dsa_config["index_head_dim"]
        return MultiHeadLatentAttention.cache_shapes(config, num_blocks, block_size, dtype) + (
            ((num_blocks, block_size, index_dim), dtype),)
