"""The two parallel layouts of the stock decoder and their collectives.

``Parallel`` names the TP group (G ranks) and the layout:

* ``tp``: every rank holds all T rows; attention and MLP weights are TP-sharded and
  each sharded projection ends in an all-reduce.
* ``sp``: the residual stream is row-sharded. ``sp_shard`` zero-pads T rows to a
  multiple of G and keeps this rank's c = ceil(T / G) rows; attention all-gathers
  its input and reduce-scatters its o-projection partial; the MoE runs on the shard
  with experts partitioned over the group (expert parallel); the model's output is
  all-gathered and sliced back to T rows.

Collectives are functional collectives (``torch.distributed._functional_collectives``)
so that Dynamo traces them into ``_c10d_functional`` ops. With G = 1 every collective
is the identity and leaves no node in the graph, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

Layout = Literal["tp", "sp"]

# torch >= 2.14 renames these (the old names warn); torch 2.11 has only the old ones.
_all_gather = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)
_reduce_scatter = getattr(funcol, "reduce_scatter_single", funcol.reduce_scatter_tensor)


@dataclass(frozen=True)
class Parallel:
    """A rank's place in the TP group. ``group=None`` means a single rank.

    ``max_num_tokens`` is the per-rank row capacity of the expert-parallel MoE
    exchange (MegaMoE's symmetric buffer, vLLM's ``max_num_batched_tokens``).
    ``dcp`` is the decode context parallel size: 1, or G (the MLA/DSA latent cache
    sharded over the same ranks, ``mla.py``). ``ep_group``: the routed experts' group
    under SP when it is larger than the TP group (data parallelism); None: the TP group.
    """

    layout: Layout = "tp"
    group: dist.ProcessGroup | None = None
    max_num_tokens: int = 8192
    dcp: int = 1
    ep_group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.layout not in ("tp", "sp"):
            raise ValueError(f"layout must be 'tp' or 'sp', got {self.layout!r}")
        if self.ep_group is not None:
            if self.layout != "sp" or self.size == 1:
                raise ValueError("an expert-parallel group larger than the TP group (data parallelism) needs the "
                                 "SP layout with TP > 1 in this replica (the TP layout shards every expert over "
                                 "the TP group)")
            ep_size, ep_rank = dist.get_world_size(self.ep_group), dist.get_rank(self.ep_group)
            if ep_size % self.size or ep_rank % self.size != self.rank:
                raise ValueError(f"EP rank {ep_rank} of {ep_size} is not d x {self.size} + its TP rank {self.rank}: "
                                 "the EP group must be the data-parallel TP groups one after another")
        if self.dcp not in (1, self.size):
            raise ValueError(f"decode context parallel size must be 1 or the TP size {self.size}, got {self.dcp} "
                             f"(vLLM runs DCP over the TP ranks)")

    @property
    def size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    @property
    def sequence_parallel(self) -> bool:
        """SP is only meaningful with more than one rank (vLLM requires TP > 1)."""
        return self.layout == "sp" and self.size > 1

    @property
    def group_name(self) -> str:
        return "" if self.group is None else self.group.group_name

    @property
    def experts_group(self) -> dist.ProcessGroup | None:
        """The group the routed experts are partitioned over under SP."""
        return self.group if self.ep_group is None else self.ep_group

    @property
    def ep_size(self) -> int:
        return self.size if self.ep_group is None else dist.get_world_size(self.ep_group)

    @property
    def ep_rank(self) -> int:
        return self.rank if self.ep_group is None else dist.get_rank(self.ep_group)

    def shard(self, n: int, what: str = "dimension") -> int:
        """``n / G``, refusing sizes the group does not divide."""
        if n % self.size:
            raise ValueError(f"{what} {n} is not divisible by the TP size {self.size}")
        return n // self.size


def all_reduce(x: torch.Tensor, par: Parallel) -> torch.Tensor:
    if par.size == 1:
        return x
    return funcol.all_reduce(x, "sum", par.group)


def all_gather(x: torch.Tensor, par: Parallel) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0."""
    if par.size == 1:
        return x
    return _all_gather(x, 0, par.group)


def reduce_scatter(x: torch.Tensor, par: Parallel) -> torch.Tensor:
    """Sum over ranks, then keep this rank's 1/G of the rows."""
    if par.size == 1:
        return x
    return _reduce_scatter(x, "sum", 0, par.group)


def _pad_rows(x: torch.Tensor, par: Parallel, value: float = 0.0) -> torch.Tensor:
    pad = (-x.shape[0]) % par.size
    if pad == 0:
        return x
    return F.pad(x, (0, 0) * (x.ndim - 1) + (0, pad), value=value)


def _my_chunk(x: torch.Tensor, par: Parallel) -> torch.Tensor:
    chunk = x.shape[0] // par.size
    return x[par.rank * chunk : (par.rank + 1) * chunk]


def sp_shard(x: torch.Tensor, par: Parallel) -> torch.Tensor:
    """This rank's c rows of ``x`` after zero-padding to a multiple of G."""
    return _my_chunk(_pad_rows(x, par), par)


def sp_padding_mask(is_padding: torch.Tensor, par: Parallel) -> torch.Tensor:
    """This rank's chunk of the row padding mask; SP pad rows are padding (True)."""
    return _my_chunk(_pad_rows(is_padding, par, value=True), par)


def sp_all_gather(x: torch.Tensor, rows: int, par: Parallel) -> torch.Tensor:
    """Gather every rank's shard and drop the SP pad rows (keep ``rows``)."""
    return all_gather(x, par)[:rows]


def sp_reduce_scatter(x: torch.Tensor, par: Parallel) -> torch.Tensor:
    """Zero-pad rows to a multiple of G, sum over ranks, keep this rank's shard."""
    return reduce_scatter(_pad_rows(x, par), par)
