"""Explicit decode state: the step's metadata and every layer's caches.

A decode step serves R requests x q tokens each (T = R q rows; q = 1 + speculative
tokens, at most 8). Rows of a request are contiguous. Padding requests (CUDA-graph
padding) have KDA slot 0, sequence length 0, cache slot -1 and ``is_padding`` set.

``DecodeStep`` (identical on every rank):
  input_ids     [T] int64
  state_slots   [R, q] int32   KDA state slots; token t writes its state into
                               ``state_slots[r, t]``, the step starts from
                               ``state_slots[r, num_accepted[r] - 1]``; the conv state
                               lives at ``state_slots[r, 0]``; slot <= 0: padding.
  num_accepted  [R] int32      tokens the previous step accepted (1..q; 1 when q = 1)
  slot_mapping  [T] int64      latent-cache slot of each new token (-1: not written)
  block_table   [R, nb] int32  cache blocks of each request
  seq_lens      [R] int32      context length including this step's q tokens
  is_padding    [T] bool       rows that are CUDA-graph padding

Per-layer caches (``LayerCache`` tuples, per rank):
  KDA  (conv_state [S, K-1+q-1, 3 P_l] bf16, recurrent_state [S, H_l, V, K] fp32)
  MLA  (kv_cache [blocks, block_size, kv_lora_rank + rope] bf16,)  replicated
  DSA  (kv_cache, index_cache [blocks, block_size, index_head_dim] bf16)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import Tensor

LayerCache = tuple[Tensor, ...]

MAX_Q = 8  # tokens per request: vLLM's verify kernels take at most 8 (the fused KDA kernel pads to 16)


def check_q(q, where: str) -> None:
    """Refuse q (tokens per request, 1 + speculative tokens) outside 1..8 with a
    ``ValueError`` naming ``where``. A symbolic q (a dynamic-shape trace) is not
    checked here; the op checks it again when it runs."""
    if isinstance(q, int) and not 1 <= q <= MAX_Q:
        raise ValueError(f"{where}: q = {q} tokens per request is outside 1..{MAX_Q} (q = 1 + speculative "
                         f"tokens; verify at most {MAX_Q - 1} speculative tokens per step)")


def tokens_per_request(rows, requests, where: str):
    """q of an op that gets T = R q token rows and R requests (block-table rows),
    checked as ``check_q`` does; T must be a multiple of R."""
    if isinstance(rows, int) and isinstance(requests, int) and (requests < 1 or rows % requests):
        raise ValueError(f"{where}: {rows} token rows do not split into {requests} requests of q tokens each "
                         "(rows must be requests x q, the block table one row per request)")
    q = rows // requests
    check_q(q, where)
    return q


@dataclass
class DecodeStep:
    input_ids: Tensor
    state_slots: Tensor
    num_accepted: Tensor
    slot_mapping: Tensor
    block_table: Tensor
    seq_lens: Tensor
    is_padding: Tensor

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def q(self) -> int:
        return self.state_slots.shape[1]

    def to(self, device: torch.device | str) -> "DecodeStep":
        return pytree.tree_map_only(Tensor, lambda t: t.to(device), self)


pytree.register_dataclass(DecodeStep)
