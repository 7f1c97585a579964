"""A deterministic stand-in for vLLM's scheduler: a fixed batch of decoding requests.

``DecodeBatch`` owns the bookkeeping a runner does between steps: every live
request verifies q tokens per step (q = 1: plain decode), is assigned q KDA state
slots and its own latent-cache blocks, and advances its context by the number of
tokens accepted (drawn at random in 1..q, the same on every rank for a seed).
Padding requests (CUDA-graph padding) carry slot 0, no blocks and no context.
Caches start empty; decoding fills them (prefill is out of scope).
"""

from __future__ import annotations

import torch

from .state import DecodeStep


class DecodeBatch:
    def __init__(self, requests: int, q: int = 1, padding: int = 0, vocab: int = 512,
                 block_size: int = 4, max_context: int = 256, seed: int = 0):
        if not 1 <= q <= 8:
            raise ValueError(f"q (tokens per request) must be in 1..8, got {q}")
        self.requests, self.q, self.padding = requests, q, padding
        self.vocab, self.block_size = vocab, block_size
        self.blocks_per_request = -(-max_context // block_size)
        self.max_context = self.blocks_per_request * block_size
        self.gen = torch.Generator().manual_seed(seed)
        self.context = torch.zeros(requests, dtype=torch.int64)
        self.accepted = torch.ones(requests, dtype=torch.int32)

    @property
    def rows(self) -> int:
        return (self.requests + self.padding) * self.q

    @property
    def num_slots(self) -> int:
        return 1 + self.requests * self.q  # slot 0 is the null slot

    @property
    def num_blocks(self) -> int:
        return 1 + self.requests * self.blocks_per_request  # block 0 is never written

    def step(self) -> DecodeStep:
        R, q, P = self.requests, self.q, self.padding
        if int(self.context.max()) + q > self.max_context:
            raise ValueError(f"a request would exceed max_context={self.max_context}")
        live = torch.arange(R)
        slots = torch.zeros(R + P, q, dtype=torch.int32)
        slots[:R] = (1 + live[:, None] * q + torch.arange(q)).int()
        table = torch.zeros(R + P, self.blocks_per_request, dtype=torch.int32)
        table[:R] = (1 + live[:, None] * self.blocks_per_request + torch.arange(self.blocks_per_request)).int()
        pos = self.context[:, None] + torch.arange(q)  # [R, q]
        slot_mapping = torch.full((R + P, q), -1, dtype=torch.int64)
        slot_mapping[:R] = table[:R].long().gather(1, pos // self.block_size) * self.block_size + pos % self.block_size
        seq_lens = torch.zeros(R + P, dtype=torch.int32)
        seq_lens[:R] = (self.context + q).int()
        accepted = torch.ones(R + P, dtype=torch.int32)
        accepted[:R] = self.accepted
        is_padding = torch.zeros(R + P, q, dtype=torch.bool)
        is_padding[R:] = True
        ids = torch.randint(0, self.vocab, (R + P, q), generator=self.gen)
        ids[R:] = 0
        return DecodeStep(
            input_ids=ids.view(-1), state_slots=slots, num_accepted=accepted,
            slot_mapping=slot_mapping.view(-1), block_table=table, seq_lens=seq_lens,
            is_padding=is_padding.view(-1))

    def accept(self) -> None:
        """After a step: each request accepts 1..q of its tokens (always 1 for q = 1)."""
        self.accepted = torch.randint(1, self.q + 1, (self.requests,), generator=self.gen, dtype=torch.int32)
        self.context += self.accepted.long()

    def real_rows(self) -> torch.Tensor:
        """Row indices that belong to live requests."""
        return torch.arange(self.requests * self.q)
