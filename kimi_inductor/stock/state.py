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

    def validate(self, vocab_size: int | None = None, block_size: int | None = None,
                 num_blocks: int | None = None, num_slots: int | None = None) -> "DecodeStep":
        """Refuse a step the decoder would run silently wrong (``ValueError`` naming the
        field, the request and the fix); returns the step. The model never calls it (it
        reads tensor values: a host sync); the CLI and ``harness.decode`` do, through
        ``KimiLinearForCausalLM.validate_step``, which fills in the sizes.

        Always: shapes (T = R q rows), q in 1..8, num_accepted in 1..q, token ids >= 0,
        seq_lens >= 0 and >= q for live requests (seq_len > 0), padding requests
        (seq_len 0) exactly the ``is_padding`` rows, live requests' KDA slot 0 positive
        (slot <= 0 is padding: zero output), no KDA slot written by two tokens. With
        ``vocab_size``: token ids below it (ids past a rank's vocab shard were a silent zero
        embedding). With ``block_size``: seq_lens within the block table's capacity, the
        blocks a live request uses non-negative, below ``num_blocks`` and not shared with
        another request (both would write the same cache rows). With ``num_slots``: KDA
        slots below it."""
        R, q = _shape(self.state_slots, "state_slots", 2)
        check_q(q, "DecodeStep.state_slots [R, q]")
        T = R * q
        for name, want in (("input_ids", (T,)), ("num_accepted", (R,)), ("slot_mapping", (T,)),
                           ("seq_lens", (R,)), ("is_padding", (T,))):
            if tuple(getattr(self, name).shape) != want:
                raise ValueError(f"DecodeStep.{name} has shape {tuple(getattr(self, name).shape)}, expected {want} "
                                 f"(R = {R} requests x q = {q} tokens, from state_slots)")
        nb = _shape(self.block_table, "block_table", 2)[1]
        if self.block_table.shape[0] != R:
            raise ValueError(f"DecodeStep.block_table has {self.block_table.shape[0]} rows, expected one per "
                             f"request ({R})")
        if self.is_padding.dtype != torch.bool:
            raise ValueError(f"DecodeStep.is_padding must be bool, got {self.is_padding.dtype}")
        for name in ("input_ids", "state_slots", "num_accepted", "slot_mapping", "block_table", "seq_lens"):
            t = getattr(self, name)
            if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                raise ValueError(f"DecodeStep.{name} must be an integer tensor, got {t.dtype}")
        if self.input_ids.device.type == "meta":
            return self  # no values to check
        ids, slots, accepted = self.input_ids.cpu().long(), self.state_slots.cpu().long(), self.num_accepted.cpu()
        seq, table, padding = self.seq_lens.cpu().long(), self.block_table.cpu().long(), self.is_padding.cpu()

        def bad(mask: Tensor, what) -> None:  # what(i): the message for the first offending index i
            if bool(mask.any()):
                raise ValueError(what(int(mask.reshape(-1).nonzero()[0, 0])))

        vocab, outside = "", ids < 0
        if vocab_size is not None:
            vocab, outside = f" 0..{vocab_size - 1}", outside | (ids >= vocab_size)
        bad(outside, lambda i: f"DecodeStep.input_ids[{i}] = {int(ids[i])} is outside the vocabulary{vocab}")
        bad((accepted < 1) | (accepted > q),
            lambda i: f"DecodeStep.num_accepted[{i}] = {int(accepted[i])} is outside 1..q = 1..{q} (tokens the "
                      "previous step accepted; 1 for new and padding requests)")
        bad(seq < 0, lambda i: f"DecodeStep.seq_lens[{i}] = {int(seq[i])} is negative")
        live = seq > 0
        bad(live & (seq < q), lambda i: f"DecodeStep.seq_lens[{i}] = {int(seq[i])} is below q = {q}: a live "
                                        "request's length counts this step's q tokens")
        bad(padding.view(R, q) != ~live[:, None],
            lambda i: f"DecodeStep.is_padding[{i}] = {bool(padding[i])} but request {i // q} has seq_len "
                      f"{int(seq[i // q])}: a request is padding (all its rows) exactly when its seq_len is 0")
        bad(live & (slots[:, 0] <= 0),
            lambda i: f"DecodeStep.state_slots[{i}, 0] = {int(slots[i, 0])} marks request {i} as padding (slot <= 0)"
                      f" but its seq_len is {int(seq[i])}: KDA would output zeros; give it a state slot > 0")
        if num_slots is not None:
            bad(slots >= num_slots, lambda i: f"DecodeStep.state_slots[{i // q}, {i % q}] = "
                                              f"{int(slots.view(-1)[i])} is not one of the {num_slots} KDA state slots")
        used = slots[live].reshape(-1)
        used = used[used > 0]
        if used.unique().numel() != used.numel():
            raise ValueError("DecodeStep.state_slots: a KDA state slot appears twice among live requests (two "
                             "tokens would write one state); give every token its own slot")
        if block_size is None:
            return self
        bad(seq > nb * block_size, lambda i: f"DecodeStep.seq_lens[{i}] = {int(seq[i])} exceeds the block table's "
                                             f"capacity, {nb} blocks x {block_size} = {nb * block_size} positions")
        owner: dict[int, int] = {}
        for r in live.nonzero().view(-1).tolist():
            for j, block in enumerate(table[r, : -(-int(seq[r]) // block_size)].tolist()):
                if block < 0 or (num_blocks is not None and block >= num_blocks):
                    raise ValueError(f"DecodeStep.block_table[{r}, {j}] = {block} is not a cache block "
                                     f"(0..{num_blocks - 1 if num_blocks is not None else 'num_blocks - 1'})")
                if owner.setdefault(block, r) != r or table[r, :j].eq(block).any():
                    raise ValueError(f"DecodeStep.block_table: block {block} is used by request {owner[block]} and "
                                     f"by request {r} (block_table[{r}, {j}]); each request needs its own blocks")
        return self


def _shape(t: Tensor, name: str, dims: int) -> tuple[int, ...]:
    if t.dim() != dims:
        raise ValueError(f"DecodeStep.{name} must have {dims} dims, got shape {tuple(t.shape)}")
    return tuple(t.shape)


pytree.register_dataclass(DecodeStep)
