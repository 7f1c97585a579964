"""vLLM 0.33.0's MLA decode core, read from its graph and replaced by our kernel
(``kimi_kernels.mla_decode``); used by ``lower_kernels``.

Matches (B decode rows, one token per request, so B is also the block table's rows; N
heads, L = kv_lora_rank, R = rope dims; the paged latent cache [blocks, block_size, L + R],
contiguous: position p of request b is row p % block_size of block
``block_tables[b, p // block_size]``)::

    ins = auto_functionalized_v2(_C.fused_kimi_k3_mla_decode_q_concat_kv_cache_insert,
              ql_nope [B, N, L], q_pe [B, N, R], kv_c_normed [B, L], k_pe [B, R],
              slot_mapping [B], block_size, positions=None, cos_sin_cache=None,
              bases=[mqa_q [B, N, L + R], kv_cache])
    dec = auto_functionalized_v2(_C.mla_decode_kvcache, query=ins[1] (read by nothing else),
              kv_cache=ins[2], scale, block_tables [B, nb], seq_lens [B], bases=[out [B, N, L]])

(``_C.mla_decode_kvcache`` is vLLM's CPU MLA backend's ``forward_mqa``) and produces::

    new = auto_functionalized_v2(kimi_kernels.mla_decode, ql_nope, q_pe, kv_c_normed, k_pe,
              slot_mapping, block_tables, seq_lens, scale, bases=[kv_cache])
    dec[1] (out) -> new[0];  ins[2] (the cache after) -> new[1]

(where kv_c_normed is a RMSNorm of kv_c read by the insert alone: kv_c, with the
norm's weight and eps as ``kv_norm_weight`` / ``kv_norm_eps``, applied by our cache write)

The same function: both write row b's ``[kv_c_normed | k_pe]`` at ``slot_mapping[b]``
(slots < 0, vLLM's padding, are not written), then attend row b (position
``seq_lens[b] - 1``) over positions [0, seq_lens[b]) of the cache: scores ``(mqa_q .
row) * scale``, softmax and the sum of ``row[:L]`` in fp32, rounded once to the query
dtype; a request with seq_len 0 gives zeros. The rows beyond the decode rows (vLLM's
padding) are outside the pair, so they stay as vLLM leaves them.

Checked, else the pair is kept and ``bind`` says why: mqa_q feeds only the CPU backend's
decode (with DCP it is all-gathered first; another backend decodes with another op), no
RoPE in the insert (K3's MLA is NoPE), block_size the cache's, cache dtype the query's,
cache and buffers whole bases (not views), the cache contiguous, one query row per
request. vLLM's fp8 cache inserts are other ops, which the vLLM spelling does not read as
MLA anchors (such a graph does not parse as a decoder: no pass touches it).

The choice is documented, not measured: the decode replaced is the CPU backend's
reference kernel; on SM90 vLLM decodes with FLASH_ATTN_MLA (FlashAttention 3), which is
not matched and so stays (measured against ours: docs/performance.md, "MLA decode core").
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .gemm_neighbours import rms_norm_of
from .graph import OpCall, erase_unused

INSERT = "_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert"
DECODE = "_C::mla_decode_kvcache"
INPUTS = ("ql_nope", "q_pe", "kv_c_normed", "k_pe", "slot_mapping")


@dataclass
class MlaGroup:
    insert: OpCall
    decode: OpCall
    latent: int  # L
    rope: int  # R
    dtype: torch.dtype


def _val(node):
    return node.meta["val"]


def _same(a, b) -> bool:
    """Sizes equal for every value of their symbols (the same symbol when symbolic)."""
    return statically_known_true(a == b)


def bind(insert_node: fx.Node) -> MlaGroup | str:
    """vLLM's MLA decode pair that starts at the insert ``insert_node``, or why not."""
    ins = OpCall.of(insert_node)
    if ins is None or ins.op._schema.name != INSERT or insert_node.target is not auto_functionalized_v2:
        return "not vLLM's functionalized bf16 query-concat + cache insert"
    if ins.arg("positions") is not None or ins.arg("cos_sin_cache") is not None:
        return "its insert applies RoPE (positions / cos_sin_cache given): ours takes K3's NoPE MLA"
    if ins.view("mqa_q") or ins.view("kv_cache"):
        return "its query buffer or cache is a view of a larger base"
    mqa_q, cache = ins.mutated_output("mqa_q"), ins.mutated_output("kv_cache")
    users = list(mqa_q.users) if mqa_q is not None else []
    dec = OpCall.of(users[0]) if len(users) == 1 else None
    if dec is None or dec.op._schema.name != DECODE or not dec.wrapped:
        return (f"its query feeds {[str(u.target) for u in users]}, not the CPU MLA backend's {DECODE} alone "
                "(another backend's decode, or DCP's query all-gather)")
    if dec.arg("query") is not mqa_q or dec.arg("kv_cache") is not cache or dec.view("out") \
            or dec.mutated_output("out") is None:
        return f"its {DECODE} does not read the query and cache the insert wrote into a whole output buffer"
    ql, q_pe, kv_c, k_pe, slots = (_val(ins.arg(k)) for k in INPUTS)
    kv, out, table, seq_lens = (_val(x) for x in (ins.arg("kv_cache"), dec.arg("out"), dec.arg("block_tables"),
                                                  dec.arg("seq_lens")))
    (B, N, L), R = ql.shape, q_pe.shape[-1]
    if kv.dtype != ql.dtype or out.dtype != ql.dtype:
        return f"cache {kv.dtype}, output {out.dtype}, query {ql.dtype} (ours: all the query's dtype)"
    if kv.dim() != 3 or ins.arg("block_size") != kv.shape[1] or not kv.is_contiguous():
        return (f"cache {tuple(kv.shape)} stride {kv.stride()}, block_size {ins.arg('block_size')} "
                "(ours: a contiguous [blocks, block_size, L + R] cache)")
    expected = ((q_pe, (B, N, R)), (kv_c, (B, L)), (k_pe, (B, R)), (slots, (B,)), (out, (B, N, L)),
                (kv, (*kv.shape[:2], L + R)), (table, (B, table.shape[-1])), (seq_lens, (B,)))
    if not all(t.dim() == len(s) and all(map(_same, t.shape, s)) for t, s in expected):
        return (f"query {tuple(ql.shape)} for {table.shape[0]} requests, kv_c {tuple(kv_c.shape)}, k_pe "
                f"{tuple(k_pe.shape)}, cache rows {kv.shape[-1]} (ours: one token per request, rows [kv_c | k_pe])")
    node = insert_node.next
    while node is not dec.node:  # ours goes where the decode is: the new cache is read after it
        if node in cache.users:
            return "its cache is read between the insert and the decode"
        node = node.next
    return MlaGroup(ins, dec, latent=L, rope=R, dtype=ql.dtype)


def lower(g: fx.Graph, group: MlaGroup) -> fx.Node:
    """Emit our op in place of the pair (see the module docstring); returns its node."""
    ins, dec = group.insert, group.decode
    out, cache = dec.mutated_output("out"), ins.mutated_output("kv_cache")
    kwargs = dict(ql_nope=ins.arg("ql_nope"), q_pe=ins.arg("q_pe"), kv_c=ins.arg("kv_c_normed"), k_pe=ins.arg("k_pe"),
                  slot_mapping=ins.arg("slot_mapping"), block_table=dec.arg("block_tables"),
                  seq_lens=dec.arg("seq_lens"), scale=dec.arg("scale"), _kv_cache_base_index=0,
                  _all_bases=[ins.arg("kv_cache")])
    norm = rms_norm_of(kwargs["kv_c"])  # read by the insert alone: our cache write applies it
    if norm is not None:
        kwargs.update(kv_c=norm[0], kv_norm_weight=norm[1], kv_norm_eps=norm[2])
    with g.inserting_before(dec.node):
        new = g.call_function(auto_functionalized_v2, (torch.ops.kimi_kernels.mla_decode.default,), kwargs)
        values = [g.call_function(operator.getitem, (new, i)) for i in (0, 1)]
    new.meta["val"] = (out.meta["val"], cache.meta["val"])  # later matches in the pass read values
    for old, value in zip((out, cache), values):
        value.meta["val"] = old.meta["val"]
        old.replace_all_uses_with(value)
    erase_unused(g, [out, dec.node, *ins.node.users, ins.node])
    return new
