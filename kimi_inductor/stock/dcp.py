"""Decode context parallelism (DCP = G) for the MLA / DSA latent cache, as vLLM 0.33.0
lays it out (interleave size 1, its default ``cp_kv_cache_interleave_size``).

Cache layout. The block table is the same on every rank and counts *virtual* blocks of
B_v = G B_l positions. Global position p of a request lives on rank p % G, in block
``table[p // B_v]`` of that rank's cache [blocks, B_l, row], at row (p % B_v) // G. So a
rank holds every G-th position of every request, and its context index i (table entry
i // B_l, row i % B_l) is global position (i // B_l) B_v + (i % B_l) G + rank. Slot
mappings stay global (block id x B_v + offset); each rank writes only what it owns.

Decode (vLLM's ``query_gather`` + ``cp_lse_ag_out_rs``): every rank all-gathers the
query heads of the group (its N heads -> all G N), attends over its slice of every
request with all heads, returning each head's partial output and log-sum-exp; the LSEs
are all-gathered, each partial is weighted by exp(lse_r - lse) and the outputs are
reduce-scattered over heads, so each rank ends with its own N heads. Per MLA/DSA layer
that is 2 all-gathers (queries, LSEs) and 1 reduce-scatter inside the attention (plus,
for DSA, the all-gather of the indexer scores: the top-k is taken over every rank's
positions in position order, the same on every rank and the same as without DCP).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .parallel import Parallel, all_gather, reduce_scatter


def local_slots(slot_mapping: Tensor, block_local: int, rank: int, size: int) -> Tensor:
    """Global slots -> this rank's cache slots; -1 where another rank owns the position."""
    virtual = block_local * size
    block, offset = slot_mapping // virtual, slot_mapping % virtual
    mine = (slot_mapping >= 0) & (offset % size == rank)
    return torch.where(mine, block * block_local + offset // size, -1)


def context_positions(width: int, block_local: int, rank: int, size: int, device) -> Tensor:
    """Global position of each of this rank's ``width`` context indices of a request."""
    i = torch.arange(width, device=device)
    return (i // block_local) * block_local * size + (i % block_local) * size + rank


def causal_mask_at(positions: Tensor, seq_lens: Tensor, q: int) -> Tensor:
    """[R, q, W]: query j of request r sees the positions <= seq_len - q + j."""
    last = seq_lens.long()[:, None] - q + torch.arange(q, device=seq_lens.device)
    return positions[None, None, :] <= last[:, :, None]


def gather_heads(x: Tensor, par: Parallel) -> Tensor:
    """[T, N, D] on each rank -> [T, G N, D] (rank g's heads at [g N, (g + 1) N))."""
    T, N, D = x.shape
    return all_gather(x.contiguous(), par).view(par.size, T, N, D).transpose(0, 1).reshape(T, par.size * N, D)


def combine(out: Tensor, lse: Tensor, par: Parallel) -> Tensor:
    """Partials of all G N heads over this rank's positions (out [T, G N, L] fp32, lse
    [T, G N]) -> the full attention of this rank's N heads, [T, N, L] fp32."""
    T, GN, L = out.shape
    G = par.size
    lses = all_gather(lse.contiguous(), par).view(G, T, GN)
    top = lses.amax(0)
    top = torch.where(torch.isfinite(top), top, 0.0)
    total = torch.exp(lses - top).sum(0)
    weight = torch.where(total > 0, torch.exp(lse - top) / total.clamp(min=1e-30), 0.0)
    heads = (out * weight[..., None]).view(T, G, GN // G, L).permute(1, 2, 0, 3).reshape(GN, T, L)
    return reduce_scatter(heads.contiguous(), par).transpose(0, 1)

