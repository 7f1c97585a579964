"""``kimi_vllm::mega_moe``: vLLM's K3 MoE layer run through our expert-parallel op;
``kimi_vllm::sharded_moe``: the same layer on all rows, split over the TP group.

    (shared, routed) = kimi_vllm.mega_moe(latent, router_logits, shared_in, layer_name)

stands where vLLM's graph has ``vllm.moe_forward_shared(latent, router_logits, shared_in,
None, layer_name, 0)`` (the ``mega_moe`` pass swaps one for the other) and returns what
it returns: latent [c, L] bf16 (this rank's c rows: the SP / hybrid row shard, or all
rows without SP), router_logits [c, E] fp32, shared_in [c, H] bf16; shared [c, H] bf16
(the shared experts of ``shared_in``), routed [c, L] bf16 (the weighted sum of each
row's top-k experts, wherever they live).

At run time, as vLLM's own op, it finds the layer (vLLM's ``MoERunner``) by name in the
forward context and uses, as loaded:

* its shared experts module and its router (``select_experts``: vLLM's routing, bias for
  selection only, renormalised and scaled weights);
* its routed experts, with vLLM's contiguous expert-parallel partition (rank r holds
  experts [r E_local, (r + 1) E_local): checked against the layer's expert map) and
  SiTU's two betas from the layer's MoE config. The experts are either bf16 (fp16, fp32)
  ``w13_weight`` [E_local, 2 I, L] (gate rows, then up rows) and ``w2_weight``
  [E_local, L, I], or MXFP4 as the checkpoint ships them (``stock.mxfp4``: two E2M1
  codes per byte along the input dimension, low nibble the even element; one E8M0 scale
  per 32 inputs): ``w13_weight`` [E_local, 2 I, L / 2] + ``w13_weight_scale``
  [E_local, 2 I, L / 32], ``w2_weight`` [E_local, L, I / 2] + ``w2_weight_scale``
  [E_local, L, I / 32], all uint8 and contiguous. vLLM keeps that layout only under its
  ``mxfp4`` quant method with the emulation MoE backend (``moe_backend="emulation"``,
  W4A16); our op takes those tensors as they are (no copy). Where our SM90 MXFP4 kernel
  runs (an SM90+ GPU with CuTe DSL, bf16 activations, shapes and scales it takes), the
  first call reorders each layer's bytes in place into that kernel's layout
  (``kernels.expert_mxfp4.mma_layout``: the same storage, 5-D views) and vLLM's own MoE
  path for that layer then refuses to run (``ValueError``: it would read the reordered
  bytes); ``KIMI_VLLM_MXFP4_LAYOUT=checkpoint``, set before a layer's first bf16 call,
  keeps the checkpoint layout (the Triton kernel). MXFP4 experts another backend re-laid
  out (Marlin, Triton swizzle, CUTLASS scales, ...) and every other quantization raise
  ``ValueError`` naming the cause and the fix;
* ``forward_context.is_padding`` [T] (all T rows of the step): the rows of this shard
  that are padding (or the SP pad beyond T) get expert id -1 and weight 0, so no rank
  computes them; their routed output is zero (vLLM computes and discards them).

The routed experts then run as ``kimi_kernels::mega_moe`` over vLLM's EP group
(dispatch all-gather, grouped experts, combine reduce-scatter; DeepGEMM on SM100). The
layer's ``max_num_tokens`` bounds the rows.

    (shared_r, routed_r) = kimi_vllm.sharded_moe(latent, router_logits, shared_in, layer_name)

takes all T rows of the hybrid step (the ``sharded_moe`` pass puts it where either op
was) and returns this rank's partials: shared_r [T, H] bf16 (the shared experts' width
block r of G) and routed_r [T, L] fp32 (this rank's local experts on every row, through
``kimi_kernels::expert_ffn``); the graph sums each over the TP group, which must be the
EP group or, with data parallelism, one of the DP replicas' TP groups that make it up
(the op then gathers its DP peers' rows for the experts and reduce-scatters back).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor
from vllm.utils.torch_utils import LayerNameType, _resolve_layer_name

from .kernels import expert_ffn
from .kernels import mega_moe as ep

NAMESPACE = "kimi_vllm"
NO_SHARDED_MOE = ("set sharded_moe_rows to 0 (additional_config['kimi_inductor']['sharded_moe_rows'] under vLLM, "
                  "options={'decode': {'sharded_moe_rows': 0}} with torch.compile)")


def _layer(layer_name):
    from vllm.forward_context import get_forward_context

    return get_forward_context().no_compile_layers[_resolve_layer_name(layer_name)]


def _padding(rows: int, sequence_parallel: bool) -> Tensor | None:
    """[rows] bool: which of this rank's rows are padding (None: none known)."""
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.forward_context import get_forward_context

    is_padding = get_forward_context().is_padding
    if is_padding is None:
        return None
    start = get_tensor_model_parallel_rank() * rows if sequence_parallel else 0
    mask = torch.ones(rows, dtype=torch.bool, device=is_padding.device)  # SP pad rows beyond T
    own = is_padding[start:start + rows]
    mask[:own.numel()] = own
    return mask


_CONTIGUOUS: set[str] = set()  # layers whose expert map was checked (vLLM's warmup runs before CUDA-graph capture)


_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_FIX = ("load MXFP4 experts with vLLM's 'mxfp4' quant method (quantization_config.quant_method 'mxfp4') and "
        "request its emulation MXFP4 MoE backend (moe_backend='emulation' / --moe-backend emulation; vLLM needs "
        "amd-quark for it) so that the experts keep the checkpoint layout, or leave 'mega_moe' out of the passes")


def _checkpoint_mxfp4(w13: Tensor, w2: Tensor, w13_scale, w2_scale) -> bool:
    """Whether the four tensors are MXFP4 experts in the checkpoint layout (module docstring)."""
    if w13_scale is None or w2_scale is None or w13.dim() != 3:
        return False
    E, two_i, half_l = w13.shape
    L, I = 2 * half_l, two_i // 2
    want = ((w13, (E, 2 * I, L // 2)), (w13_scale, (E, 2 * I, L // 32)),
            (w2, (E, L, I // 2)), (w2_scale, (E, L, I // 32)))
    return L % 32 == 0 and I % 32 == 0 and all(
        t.dtype == torch.uint8 and t.is_contiguous() and tuple(t.shape) == shape for t, shape in want)


def _mxfp4_scales(runner) -> tuple[Tensor, Tensor]:
    """(w13_scale, w2_scale) of routed experts vLLM keeps in the MXFP4 checkpoint layout
    (its emulation MoE backend, W4A16); ``ValueError`` with the cause and the fix for any
    other quantized experts."""
    experts = runner.routed_experts
    method = getattr(experts, "quant_method", None)
    backend = getattr(getattr(method, "mxfp4_backend", None), "value", None)
    scales = getattr(experts, "w13_weight_scale", None), getattr(experts, "w2_weight_scale", None)
    if backend != "EMULATION":
        how = f"MXFP4 MoE backend {backend}, which re-lays them out for its kernel" if backend else \
            "no MXFP4 MoE backend"
        cause = f"{experts.w13_weight.dtype} experts of {type(method).__name__} with {how}"
    elif not getattr(getattr(method, "moe_quant_config", None), "use_mxfp4_w4a16", False):
        cause = "MXFP4 experts with quantized activations (our op runs them W4A16)"
    elif not _checkpoint_mxfp4(experts.w13_weight, experts.w2_weight, *scales):
        shapes = [None if t is None else tuple(t.shape) for t in (experts.w13_weight, scales[0], experts.w2_weight,
                                                                  scales[1])]
        cause = f"MXFP4 experts not in the checkpoint layout (w13, w13_scale, w2, w2_scale: {shapes})"
    else:
        return scales
    raise ValueError(f"kimi_vllm.mega_moe runs bf16 experts or MXFP4 experts in the checkpoint layout; layer "
                     f"{runner.layer_name} has {cause}. Fix: {_FIX}")


_SM90: dict[tuple, tuple | None] = {}  # (layer, storage) -> views in the SM90 layout, or None: kept as loaded


def _sm90_layout(runner, w13: Tensor, w2: Tensor, w13_scale: Tensor, w2_scale: Tensor,
                 dtype: torch.dtype | None) -> tuple | None:
    """The layer's MXFP4 experts as 5-D views in the SM90 kernel's layout: reordered in
    place on the first call with bf16 activations (``dtype``) where that kernel takes them,
    after which vLLM's own path for the layer refuses and every call gets the views (the
    bytes are in no other layout). None: kept as loaded. Decided once per layer (the
    scale check reads the scales back to the host)."""
    from .kernels import expert_mxfp4

    name, key = runner.layer_name, (runner.layer_name, w13.data_ptr())
    if key in _SM90:  # decided: the views (the bytes moved), or kept as loaded
        return _SM90[key]
    if dtype != torch.bfloat16 or os.environ.get("KIMI_VLLM_MXFP4_LAYOUT", "auto") == "checkpoint":
        return None
    if not expert_mxfp4.runs_on(w13.device) or expert_mxfp4.experts_supported(w13, w13_scale, w2, w2_scale):
        _SM90[key] = None
        return None
    if w13.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"kimi_vllm.mega_moe: layer {name}'s MXFP4 experts are reordered for the SM90 kernel on "
                           "their first call, which must come before CUDA-graph capture (vLLM's warmup does)")
    views = []
    for (codes, scales), gate_up in (((w13, w13_scale), True), ((w2, w2_scale), False)):
        c, t = expert_mxfp4.mma_layout(codes, scales, gate_up)
        for dst, src in ((codes, c), (scales, t)):
            dst.view(-1).copy_(src.view(-1))
            views.append(dst.view(src.shape))
    _refuse_vllm_path(runner)
    _SM90[key] = (views[0], views[2], views[1], views[3])
    return _SM90[key]


def _refuse_vllm_path(runner) -> None:
    """vLLM's own MoE entry points for this layer raise (its experts' bytes are reordered)."""
    experts = runner.routed_experts
    method = experts.quant_method
    for entry in ("apply", "apply_monolithic"):
        original = getattr(method, entry, None)
        if original is None:
            continue

        def refuse(*args, _original=original, layer=None, **kwargs):
            if layer is experts:
                raise ValueError(f"layer {runner.layer_name}: its MXFP4 experts were reordered in place for "
                                 "kimi_vllm.mega_moe's SM90 kernel, and vLLM's own MoE path cannot read them; "
                                 "set KIMI_VLLM_MXFP4_LAYOUT=checkpoint to keep the checkpoint layout")
            return _original(*args, layer=layer, **kwargs)
        setattr(method, entry, refuse)


def _experts(runner, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, int]:
    """(w13, w2, w13_scale, w2_scale, first global expert id) of this rank, as vLLM loaded
    them (the scales None for bf16 experts); MXFP4 experts in the SM90 kernel's layout
    where it runs, from the first call with bf16 activations (``dtype``; ``_sm90_layout``)."""
    experts, config = runner.routed_experts, runner.moe_config
    w13, w2 = experts.w13_weight, experts.w2_weight
    scales = (None, None) if w13.dtype in _FLOATS else _mxfp4_scales(runner)
    if scales[0] is not None:
        w13, w2, *scales = _sm90_layout(runner, w13, w2, *scales, dtype) or (w13, w2, *scales)
    first = config.ep_rank * w13.shape[0]
    expert_map = experts.expert_map
    if expert_map is not None and runner.layer_name not in _CONTIGUOUS:  # checked once (a host sync): warmup
        local = torch.arange(w13.shape[0], dtype=expert_map.dtype, device=expert_map.device)
        if not torch.equal(expert_map[first:first + w13.shape[0]], local):
            raise ValueError(f"layer {runner.layer_name}: its experts are not the contiguous block "
                             f"[{first}, {first + w13.shape[0]}) (EPLB or a non-linear expert placement); "
                             "kimi_vllm.mega_moe needs vLLM's default linear placement")
        _CONTIGUOUS.add(runner.layer_name)
    return w13, w2, *scales, first


def _group_name(runner) -> str:
    from vllm.distributed import get_ep_group

    return get_ep_group().device_group.group_name if runner.moe_config.ep_size > 1 else ""


def _routing(runner, latent: Tensor, router_logits: Tensor, pad: Tensor | None) -> tuple[Tensor, Tensor]:
    """(weights [c, k] fp32, ids [c, k] int32) by vLLM's router; padding rows: weight 0, id -1."""
    weights, ids = runner.router.select_experts(hidden_states=latent, router_logits=router_logits)
    if pad is not None:
        weights = weights.masked_fill(pad[:, None], 0.0)
        ids = ids.masked_fill(pad[:, None], -1)
    return weights.float(), ids.int()


def _betas(runner) -> tuple[float, float]:
    config = runner.moe_config
    betas = (config.activation_situ_beta, config.activation_situ_linear_beta)
    if None in betas:
        raise ValueError(f"layer {runner.layer_name}: kimi_vllm's MoE ops run SiTU experts with both betas set; its "
                         f"MoE config has activation_situ_beta, activation_situ_linear_beta = {betas}")
    return betas


@torch.library.custom_op(f"{NAMESPACE}::mega_moe", mutates_args=())
def mega_moe(latent: Tensor, router_logits: Tensor, shared_in: Tensor,
             layer_name: LayerNameType) -> tuple[Tensor, Tensor]:
    runner = _layer(layer_name)
    config = runner.moe_config
    shared = runner._shared_experts._layer(shared_in)
    weights, ids = _routing(runner, latent, router_logits, _padding(latent.shape[0], config.is_sequence_parallel))
    w13, w2, w13_scale, w2_scale, first = _experts(runner, latent.dtype)
    routed = ep.mega_moe(latent, weights, ids, w13, w2, first, _group_name(runner), config.max_num_tokens,
                         *_betas(runner), w13_scale, w2_scale)
    return shared, routed


@mega_moe.register_fake
def _(latent, router_logits, shared_in, layer_name):
    return torch.empty_like(shared_in), torch.empty_like(latent)


# ------------------------------------------------------------------- all rows, TP-sharded
def tp_shard() -> tuple[int, int, str]:
    """(G, r, '') for the sharded layout: this rank is r of the G-rank TP group, and the
    EP group is that TP group, or (data parallel) the DP replicas' TP groups one after
    another (EP rank = DP rank x G + r, vLLM's order: ``dp_peers``); else (G, r, why not)."""
    from vllm.distributed import get_dp_group, get_ep_group, get_tp_group
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if not model_parallel_is_initialized():
        return 1, 0, "vLLM's parallel state is not initialised (the graph is compiled outside a vLLM worker)"
    tp, ep, dp = get_tp_group(), get_ep_group(), get_dp_group()
    if (ep.world_size, ep.rank_in_group) != (dp.world_size * tp.world_size,
                                             dp.rank_in_group * tp.world_size + tp.rank_in_group):
        return tp.world_size, tp.rank_in_group, (
            f"vLLM's EP group ({ep.world_size} ranks, this rank {ep.rank_in_group}) is neither its TP group "
            f"({tp.world_size}) nor its {dp.world_size} DP replicas' TP groups in order")
    return tp.world_size, tp.rank_in_group, ""


def dp_peers():
    """vLLM's DP group (this rank's peers: the ranks of the same TP rank in every DP
    replica) when DP > 1, else None. With ``tp_shard``'s layout, the experts of the peers'
    EP ranks serve this TP group's rows too."""
    from vllm.distributed import get_dp_group

    dp = get_dp_group()
    return dp if dp.world_size > 1 else None


def same_rows_on_every_replica(layer_name: str) -> None:
    """Raise unless every DP replica steps with this step's row count (its DP metadata:
    vLLM pads the replicas' batches equal when it runs CUDA graphs, not otherwise):
    sharded_moe's DP form all-gathers equal row blocks from its peers."""
    from vllm.forward_context import get_forward_context

    meta = get_forward_context().dp_metadata
    sizes = [] if meta is None else meta.num_tokens_across_dp_cpu.tolist()
    if any(n != sizes[0] for n in sizes):
        raise ValueError(f"layer {layer_name}: kimi_vllm.sharded_moe gathers its DP peers' rows, so every DP replica "
                         f"must step with the same rows; this step's are {sizes} (vLLM pads them equal when it runs "
                         f"CUDA graphs). Fix: run with CUDA graphs, or {NO_SHARDED_MOE}")


def _shared_partial(runner, x: Tensor, G: int, r: int) -> Tensor:
    """x [T, H] -> this rank's partial [T, H] of the layer's shared experts: gate and up
    rows s_r = [r D/G, (r + 1) D/G) of their width D, SiTU as vLLM's module applies it,
    then columns s_r of the down-projection (bf16 GEMMs; the partials sum to the MLP).
    Replicated weights are sliced (views); weights vLLM already TP-shards
    (``VLLM_KIMI_K3_SHARD_SP_SHARED_EXPERT``) are the rank's block as they are."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    mlp = runner._shared_experts._layer
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    if not all(isinstance(p.quant_method, UnquantizedLinearMethod) for p in (gate_up, down)):
        raise ValueError(f"layer {runner.layer_name}: kimi_vllm.sharded_moe splits unquantized shared experts; "
                         f"these are {type(gate_up.quant_method).__name__}. Fix: {NO_SHARDED_MOE} (or leave 'sharded_moe' "
                         "out of the passes)")
    w_gu, w_down = gate_up.weight, down.weight
    width = w_gu.shape[0] // 2
    if getattr(mlp, "shard_sequence_parallel", False):
        gate, up = w_gu[:width], w_gu[width:]
    else:
        if width % G:
            raise ValueError(f"layer {runner.layer_name}: the shared experts' width {width} does not split over "
                             f"{G} ranks. Fix: {NO_SHARDED_MOE}")
        d = width // G
        gate, up, w_down = w_gu[r * d:(r + 1) * d], w_gu[width + r * d:width + (r + 1) * d], w_down[:, r * d:(r + 1) * d]
    h = mlp.act_fn(torch.cat((x @ gate.t(), x @ up.t()), dim=1))
    return h @ w_down.t()


@torch.library.custom_op(f"{NAMESPACE}::sharded_moe", mutates_args=())
def sharded_moe(latent: Tensor, router_logits: Tensor, shared_in: Tensor,
                layer_name: LayerNameType) -> tuple[Tensor, Tensor]:
    """The layer on all T rows of the step (the hybrid step's), split over the TP group:
    (shared [T, H] bf16, routed [T, L] fp32) are this rank's partials, the shared experts'
    column block (``_shared_partial``) and the weighted sum of this rank's local experts
    on every row (``kimi_kernels.expert_ffn``, ids of other ranks' experts skipped,
    padding rows routed nowhere); summed over the group they are ``moe_forward_shared``'s
    pair (the ``sharded_moe`` pass emits the sums). Rows: the step's rows in order, so
    row t is ``forward_context.is_padding[t]``'s. With data parallelism (``dp_peers``) the
    local experts run on every DP replica's T rows (latent, weights and global ids
    all-gathered from the peers in one fp32 message) and their fp32 partials are
    reduce-scattered back: routed is then this TP group's rows' sum over the peers' experts
    (every replica steps with the same T, as vLLM pads its DP replicas' batches)."""
    runner = _layer(layer_name)
    G, r, why = tp_shard()
    if why:
        raise ValueError(f"layer {runner.layer_name}: kimi_vllm.sharded_moe cannot run: {why}. Fix: {NO_SHARDED_MOE}")
    shared = _shared_partial(runner, shared_in, G, r)
    weights, ids = _routing(runner, latent, router_logits, _padding(latent.shape[0], False))
    peers = dp_peers()
    if peers is not None:
        same_rows_on_every_replica(runner.layer_name)
        k, L = ids.shape[1], latent.shape[1]
        message = peers.all_gather(torch.cat([latent.float(), weights, ids.float()], 1), 0)
        latent, weights, ids = message[:, :L].to(latent.dtype), message[:, L:L + k], message[:, L + k:].int()
    w13, w2, w13_scale, w2_scale, first = _experts(runner, latent.dtype)
    routed = expert_ffn.expert_ffn(latent, weights, ids - first if first else ids, w13, w2, *_betas(runner),
                                   w13_scale, w2_scale)
    if peers is not None:
        routed = peers.reduce_scatter(routed, 0)
    return shared, routed


@sharded_moe.register_fake
def _(latent, router_logits, shared_in, layer_name):
    return torch.empty_like(shared_in), latent.new_empty(latent.shape, dtype=torch.float32)
