"""Hugging Face-style Kimi K3 checkpoints: write, read, generate, shard per rank.

Tensor names are the published ones (``model.layers.{i}.self_attn.q_proj.weight``,
``...block_sparse_moe.experts.{e}.w1.weight_packed``, ...); a ``language_model.``
prefix (the multimodal K3 checkpoint) is accepted on read. Routed experts are bf16
``.weight`` or MXFP4 ``.weight_packed`` (uint8, two E2M1 values per byte, low nibble
= even column) + ``.weight_scale`` (uint8 E8M0, one per 32 values: x 2^(s - 127);
``stock.mxfp4``). A checkpoint whose experts are all MXFP4 is loaded packed (the
model's ``experts.w13_weight`` / ``w2_weight`` hold the codes, ``*_weight_scale`` the
scales: no bf16 copy); one with any bf16 expert is loaded as bf16, MXFP4 ones
dequantised.

Loading is strict (``check_tensors``): every tensor the config implies must be there
once, in a floating dtype (MXFP4 ``weight_packed`` / ``weight_scale``: uint8), and
nothing else (a multimodal checkpoint's tensors outside its ``language_model.`` and
``lm_head.`` names, i.e. the vision tower, and MTP layers past ``num_hidden_layers``
are skipped); the config's layer count must match the tensors'.

``rank_state_dict`` maps the global tensors to one rank's parameters for a layout,
as vLLM's loaders do: column-parallel rows and row-parallel columns by TP rank,
the KDA in-projection packed ``[q|k|v|g|f_a|b|pad]`` with f_a replicated and zero
pad rows, MLA ``[q_a|kv_a|gate shard]``, TP experts sliced along the FFN width
(zero-padded to vLLM's minimum), EP experts whole.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from .config import KimiK3Config
from .mxfp4 import mxfp4_dequantize, mxfp4_quantize
from .model import KimiLinearForCausalLM
from .parallel import Parallel

# ------------------------------------------------------------ random weights
def random_checkpoint(config: KimiK3Config, seed: int = 0, experts: str = "bf16") -> dict[str, Tensor]:
    """Global tensors of a random checkpoint.

    Projections keep unit activation variance (std = fan_in^-1/2); the projections
    that end a residual branch (attention and MLP outputs) are scaled by 1/4, the
    depth-scaled init of GPT-2, so that the random stack is not chaotic and bf16
    rounding differences between layouts stay small (docs/testing.md)."""
    if experts not in ("bf16", "mxfp4"):
        raise ValueError(f"experts must be 'bf16' or 'mxfp4', got {experts!r}")
    gen = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16

    def normal(*shape, std=1.0, dtype=bf16):
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def proj(out, inp, branch_end=False):
        return normal(out, inp, std=inp**-0.5 * (0.25 if branch_end else 1.0))

    def norm(n, dtype=bf16):
        return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(dtype)

    c = config
    H, t = c.hidden_size, {}
    t["model.embed_tokens.weight"] = normal(c.vocab_size, H)
    t["lm_head.weight"] = proj(c.vocab_size, H)
    t["model.norm.weight"] = norm(H)
    t["model.output_attn_res_norm.weight"] = norm(H)
    t["model.output_attn_res_proj.weight"] = normal(1, H, std=H**-0.5)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            t[p + name + ".weight"] = norm(H)
        for name in ("self_attention_res_proj", "mlp_res_proj"):
            t[p + name + ".weight"] = normal(1, H, std=2 * H**-0.5)
        a = p + "self_attn."
        if c.layer_kind(i) == "kda":
            heads, D = c.kda_heads, c.kda_head_dim
            P = heads * D
            for name in ("q_proj", "k_proj", "v_proj", "g_proj"):
                t[a + name + ".weight"] = proj(P, H)
            t[a + "f_a_proj.weight"] = proj(D, H)
            t[a + "f_b_proj.weight"] = proj(P, D)
            t[a + "b_proj.weight"] = proj(heads, H)
            for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
                t[a + name + ".weight"] = normal(P, 1, c.conv_size, std=0.5, dtype=torch.float32)
            a_log = torch.zeros(max(heads, D))  # published padded to head_dim, real heads first
            a_log[:heads] = torch.log(torch.rand(heads, generator=gen) * 15 + 1)
            t[a + "A_log"] = a_log
            t[a + "dt_bias"] = normal(P, std=0.5, dtype=torch.float32)
            t[a + "o_norm.weight"] = norm(D, torch.float32)
            t[a + "o_proj.weight"] = proj(H, P, True)
        else:
            N, v = c.num_attention_heads, c.v_head_dim
            t[a + "q_a_proj.weight"] = proj(c.q_lora_rank, H)
            t[a + "q_a_layernorm.weight"] = norm(c.q_lora_rank)
            t[a + "q_b_proj.weight"] = proj(N * c.qk_head_dim, c.q_lora_rank)
            t[a + "kv_a_proj_with_mqa.weight"] = proj(c.latent_row, H)
            t[a + "kv_a_layernorm.weight"] = norm(c.kv_lora_rank)
            t[a + "kv_b_proj.weight"] = proj(N * (c.qk_nope_head_dim + v), c.kv_lora_rank)
            t[a + "g_proj.weight"] = proj(N * v, H)
            t[a + "o_proj.weight"] = proj(H, N * v, True)
            if c.layer_kind(i) == "dsa":
                d = c.dsa_config
                n_idx, d_idx = d["index_n_heads"], d["index_head_dim"]
                t[a + "indexer.wq_b.weight"] = proj(n_idx * d_idx, c.q_lora_rank)
                t[a + "indexer.wk.weight"] = proj(d_idx, H)
                t[a + "indexer.weights_proj.weight"] = proj(n_idx, H)
                t[a + "indexer.k_norm.weight"] = norm(d_idx, torch.float32)
                t[a + "indexer.k_norm.bias"] = normal(d_idx, std=0.1, dtype=torch.float32)
        if c.is_moe_layer(i):
            m, E, L = p + "block_sparse_moe.", c.num_experts, c.routed_expert_hidden_size
            I, S = c.moe_intermediate_size, c.moe_intermediate_size * c.num_shared_experts
            t[m + "gate.weight"] = proj(E, H)
            t[m + "gate.e_score_correction_bias"] = normal(E, std=0.1, dtype=torch.float32)
            t[m + "routed_expert_down_proj.weight"] = proj(L, H)
            t[m + "routed_expert_norm.weight"] = norm(L)
            t[m + "routed_expert_up_proj.weight"] = proj(H, L, True)
            t[m + "shared_experts.gate_proj.weight"] = proj(S, H)
            t[m + "shared_experts.up_proj.weight"] = proj(S, H)
            t[m + "shared_experts.down_proj.weight"] = proj(H, S, True)
            for e in range(E):
                for name, w in (("w1", proj(I, L)), ("w3", proj(I, L)), ("w2", proj(L, I))):
                    key = f"{m}experts.{e}.{name}."
                    if experts == "mxfp4":
                        t[key + "weight_packed"], t[key + "weight_scale"] = mxfp4_quantize(w)
                    else:
                        t[key + "weight"] = w
        else:
            t[p + "mlp.gate_proj.weight"] = proj(c.intermediate_size, H)
            t[p + "mlp.up_proj.weight"] = proj(c.intermediate_size, H)
            t[p + "mlp.down_proj.weight"] = proj(H, c.intermediate_size, True)
    return t


# --------------------------------------------------------------------- files
def save_checkpoint(path: str | Path, config: KimiK3Config, tensors: Mapping[str, Tensor]) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf(), indent=2, sort_keys=True))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})


def _canonical(name: str) -> str:
    if name.startswith("language_model."):
        name = name[len("language_model."):]
        if name.startswith("layers."):
            name = "model." + name
    return name


def load_checkpoint(path: str | Path) -> tuple[KimiK3Config, dict[str, Tensor]]:
    """Read ``config.json`` and every ``*.safetensors`` file of a checkpoint folder,
    strictly (``check_tensors``; a tensor name in two shards is refused too)."""
    path = Path(path)
    config = KimiK3Config.from_hf(json.loads((path / "config.json").read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {path}")
    tensors, origin = {}, {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                key = _canonical(name)
                if key in origin:
                    raise ValueError(f"tensor {key} is in the checkpoint twice: {origin[key][1]} in {origin[key][0]} "
                                     f"and {name} in {f.name}; remove one")
                origin[key] = (f.name, name)
                tensors[key] = fh.get_tensor(name)
    if any(name.startswith("language_model.") for _, name in origin.values()):  # multimodal: drop the towers
        tensors = {k: v for k, v in tensors.items() if k.startswith(("model.", "lm_head."))}
    check_tensors(config, tensors)
    return config, tensors


_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT_FORMS = (("weight",), ("weight_packed", "weight_scale"))  # bf16, or MXFP4 codes + E8M0 scales


def expected_tensors(config: KimiK3Config) -> tuple[list[str], list[str]]:
    """(names every checkpoint of ``config`` holds, routed-expert prefixes): each prefix
    (``...experts.{e}.w1.``) takes ``weight`` or ``weight_packed`` + ``weight_scale``.
    The names ``random_checkpoint`` writes (tests/test_checkpoint.py keeps them equal)."""
    c, names, experts = config, ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                                 "model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight"], []
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + n + ".weight" for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm",
                                              "mlp_res_norm", "self_attention_res_proj", "mlp_res_proj")]
        a = p + "self_attn."
        if c.layer_kind(i) == "kda":
            names += [a + n + ".weight" for n in ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "f_b_proj",
                                                  "b_proj", "q_conv1d", "k_conv1d", "v_conv1d", "o_norm", "o_proj")]
            names += [a + "A_log", a + "dt_bias"]
        else:
            names += [a + n + ".weight" for n in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                                  "kv_a_layernorm", "kv_b_proj", "g_proj", "o_proj")]
            if c.layer_kind(i) == "dsa":
                names += [a + "indexer." + n for n in ("wq_b.weight", "wk.weight", "weights_proj.weight",
                                                       "k_norm.weight", "k_norm.bias")]
        if c.is_moe_layer(i):
            m = p + "block_sparse_moe."
            names += [m + n for n in ("gate.weight", "gate.e_score_correction_bias", "routed_expert_down_proj.weight",
                                      "routed_expert_norm.weight", "routed_expert_up_proj.weight",
                                      "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
                                      "shared_experts.down_proj.weight")]
            experts += [f"{m}experts.{e}.{n}." for e in range(c.num_experts) for n in ("w1", "w3", "w2")]
        else:
            names += [p + "mlp." + n + ".weight" for n in ("gate_proj", "up_proj", "down_proj")]
    return names, experts


def check_tensors(config: KimiK3Config, tensors: Mapping[str, Tensor]) -> None:
    """Refuse a checkpoint that does not match ``config`` exactly (``ValueError`` naming
    the field or tensors): unsupported config flags, a layer count other than the
    tensors', missing tensors (a routed expert's included), tensors the decoder does not
    use, and integer / bool tensors where weights are floating point (they were cast)."""
    config.validate()
    n = config.num_hidden_layers
    mtp = int(config.extra.get("num_nextn_predict_layers") or 0)  # MTP layers follow the decoder's; not loaded
    layers: dict[int, str] = {}
    for name in tensors:
        found = _LAYER.match(name)
        if found:
            layers.setdefault(int(found.group(1)), name)
    beyond = sorted(i for i in layers if i >= n + mtp)
    if beyond:
        raise ValueError(f"config num_hidden_layers = {n} but the checkpoint has tensors of layer {beyond[-1]} "
                         f"(e.g. {layers[beyond[-1]]}): the config does not describe this checkpoint")
    top = max((i for i in layers if i < n), default=-1)
    if top < n - 1:
        raise ValueError(f"config num_hidden_layers = {n} but the checkpoint's tensors stop at layer {top}: "
                         "the config does not describe this checkpoint")
    names, experts = expected_tensors(config)
    known, missing = set(names), [k for k in names if k not in tensors]
    for prefix in experts:
        forms = [[prefix + s for s in form] for form in _EXPERT_FORMS]
        known.update(k for form in forms for k in form)
        given = [form for form in forms if any(k in tensors for k in form)]
        if len(given) > 1:
            raise ValueError(f"routed expert {prefix}* is given both as bf16 ({prefix}weight) and as MXFP4 "
                             f"({prefix}weight_packed); keep one")
        missing += [k for k in given[0] if k not in tensors] if given else \
            [f"{prefix}weight (or {prefix}weight_packed + weight_scale)"]
    unknown = sorted(k for k in tensors if k not in known and not
                     (_LAYER.match(k) and int(_LAYER.match(k).group(1)) >= n))
    if missing or unknown:
        parts = [f"lacks {len(missing)} tensors, e.g. {missing[:3]}"] if missing else []
        parts += [f"has {len(unknown)} tensors the Kimi K3 decoder does not use, e.g. {unknown[:3]}"] if unknown else []
        raise ValueError(f"checkpoint does not match its config: it {'; it '.join(parts)}")
    for name in sorted(known & tensors.keys()):
        t = tensors[name]
        if name.endswith(("weight_packed", "weight_scale")):
            if t.dtype != torch.uint8:
                raise ValueError(f"tensor {name} has dtype {t.dtype}; MXFP4 codes and scales are uint8")
        elif not t.dtype.is_floating_point:
            raise ValueError(f"tensor {name} has dtype {t.dtype}; weights are floating point (bf16 or fp32 as "
                             "published), an integer or bool tensor would be cast silently")


# ------------------------------------------------------------------- sharding
def _rows(t: Tensor, par: Parallel) -> Tensor:
    return t.chunk(par.size, dim=0)[par.rank] if par.size > 1 else t


def _cols(t: Tensor, par: Parallel) -> Tensor:
    return t.chunk(par.size, dim=1)[par.rank] if par.size > 1 else t


def _pad_to(t: Tensor, size: int, dim: int) -> Tensor:
    pad = size - t.shape[dim]
    if pad == 0:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def rank_state_dict(model: KimiLinearForCausalLM, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """One rank's parameters (names of ``model.named_parameters()``) from global tensors."""
    c, par = model.config, model.par
    missing: list[str] = []

    def get(name: str) -> Tensor:
        if name not in tensors:
            missing.append(name)
            return torch.zeros(0)
        return tensors[name]

    def expert(prefix: str, mxfp4: bool) -> list[Tensor]:
        """One expert weight as the model holds it: [bf16], or [codes, scales] (MXFP4)."""
        if mxfp4:
            return [get(prefix + "weight_packed"), get(prefix + "weight_scale")]
        if prefix + "weight" in tensors:
            return [tensors[prefix + "weight"].to(torch.bfloat16)]
        return [mxfp4_dequantize(get(prefix + "weight_packed"), get(prefix + "weight_scale"))]

    out: dict[str, Tensor] = {
        "model.embed_tokens.weight": _rows(get("model.embed_tokens.weight"), par),
        "lm_head.weight": _rows(get("lm_head.weight"), par),
    }
    for name in ("model.norm.weight", "model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight"):
        out[name] = get(name)
    for layer in model.model.layers:
        p = f"model.layers.{layer.layer_idx}."
        for name in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm",
                     "self_attention_res_proj", "mlp_res_proj"):
            out[p + name + ".weight"] = get(p + name + ".weight")
        a = p + "self_attn."
        attn = layer.self_attn
        if layer.kind == "kda":
            w = [_rows(get(a + n + ".weight"), par) for n in ("q_proj", "k_proj", "v_proj", "g_proj")]
            w += [get(a + "f_a_proj.weight"), _rows(get(a + "b_proj.weight"), par)]
            packed = torch.cat(w)
            out[a + "in_proj_qkvgfab.weight"] = _pad_to(packed, packed.shape[0] + attn.in_proj_padding, 0)
            out[a + "f_b_proj.weight"] = _rows(get(a + "f_b_proj.weight"), par)
            conv = [_rows(get(a + n + ".weight").reshape(-1, 1, c.conv_size), par)
                    for n in ("q_conv1d", "k_conv1d", "v_conv1d")]
            out[a + "conv1d.weight"] = torch.cat(conv).float()
            a_log = get(a + "A_log")
            a_log = a_log.reshape(-1)[: c.kda_heads] if a_log.dim() != 4 else a_log.reshape(-1)
            out[a + "A_log"] = _rows(a_log, par).float()
            out[a + "dt_bias"] = _rows(get(a + "dt_bias").reshape(-1), par).float()
            out[a + "o_norm.weight"] = get(a + "o_norm.weight").to(torch.bfloat16)
        else:
            out[a + "fused_qkv_a_g_proj.weight"] = torch.cat([
                get(a + "q_a_proj.weight"), get(a + "kv_a_proj_with_mqa.weight"),
                _rows(get(a + "g_proj.weight"), par)])
            for name in ("q_a_layernorm", "kv_a_layernorm"):
                out[a + name + ".weight"] = get(a + name + ".weight")
            for name in ("q_b_proj", "kv_b_proj"):
                out[a + name + ".weight"] = _rows(get(a + name + ".weight"), par)
            if layer.kind == "dsa":
                for name in ("wq_b.weight", "wk.weight", "weights_proj.weight", "k_norm.weight", "k_norm.bias"):
                    out[a + "indexer." + name] = get(a + "indexer." + name)
        out[a + "o_proj.weight"] = _cols(get(a + "o_proj.weight"), par)
        if layer.is_moe_layer:
            m = p + "block_sparse_moe."
            for name in ("gate.weight", "gate.e_score_correction_bias", "routed_expert_down_proj.weight",
                         "routed_expert_norm.weight", "routed_expert_up_proj.weight"):
                out[m + name] = get(m + name)
            _mlp(out, get, m + "shared_experts.", not par.sequence_parallel, par)
            experts = layer.block_sparse_moe.experts
            mxfp4 = experts.w13_weight.dtype == torch.uint8
            # per stored tensor: values per element along K (bf16 1; MXFP4 codes 2, scales 32)
            per_k = (2, 32) if mxfp4 else (1,)
            local, width = experts.w13_weight.shape[0], experts.w13_weight.shape[1] // 2
            if mxfp4 and not par.sequence_parallel and (c.moe_intermediate_size // par.size) % 32:
                raise ValueError(f"MXFP4 experts TP-sharded over {par.size} ranks: the FFN width "
                                 f"{c.moe_intermediate_size} / {par.size} is not whole 32-value scale groups")
            w13, w2 = [[] for _ in per_k], [[] for _ in per_k]
            for e in range(experts.first_expert, experts.first_expert + local):
                parts = zip(*(expert(f"{m}experts.{e}.{n}.", mxfp4) for n in ("w1", "w3", "w2")))
                for j, (w1, w3, w2e) in enumerate(parts):
                    if not par.sequence_parallel:
                        w1, w3, w2e = _rows(w1, par), _rows(w3, par), _cols(w2e, par)
                    w13[j].append(torch.cat([_pad_to(w1, width, 0), _pad_to(w3, width, 0)]))
                    w2[j].append(_pad_to(w2e, width // per_k[j], 1))
            for j, suffix in enumerate(("", "_scale")[:len(per_k)]):
                out[m + "experts.w13_weight" + suffix] = torch.stack(w13[j])
                out[m + "experts.w2_weight" + suffix] = torch.stack(w2[j])
        else:
            _mlp(out, get, p + "mlp.", not par.sequence_parallel, par)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return out


def _mlp(out: dict, get: Callable[[str], Tensor], prefix: str, sharded: bool, par: Parallel) -> None:
    shard = (lambda t: _rows(t, par)) if sharded else (lambda t: t)
    out[prefix + "gate_up_proj.weight"] = torch.cat(
        [shard(get(prefix + "gate_proj.weight")), shard(get(prefix + "up_proj.weight"))])
    down = get(prefix + "down_proj.weight")
    out[prefix + "down_proj.weight"] = _cols(down, par) if sharded else down


def build_model(config: KimiK3Config, tensors: Mapping[str, Tensor], par: Parallel | None = None,
                device: torch.device | str | None = None,
                dtype: torch.dtype = torch.bfloat16, mxfp4_layout: str = "auto") -> KimiLinearForCausalLM:
    """Construct one rank's stock decoder and load its shard of ``tensors``.

    ``dtype`` is the activation dtype: bf16 as Kimi K3 is served, or fp32, which
    turns every bf16 rounding point into the identity (used to check that layouts
    and rewrites compute the same function; docs/testing.md). MXFP4 experts stay packed;
    ``mxfp4_layout``: "checkpoint" keeps their bytes as stored, "sm90" reorders them for
    the SM90 expert kernel (``KimiMoE.mxfp4_for_sm90``), "auto" does so where that kernel
    runs (an SM90+ GPU with CuTe DSL, bf16 activations, shapes it takes)."""
    from kimi_inductor.kernels import expert_mxfp4

    if mxfp4_layout not in ("auto", "checkpoint", "sm90"):
        raise ValueError(f"mxfp4_layout={mxfp4_layout!r}: use 'auto', 'checkpoint' or 'sm90'")
    check_tensors(config, tensors)
    model = KimiLinearForCausalLM(config, par, device="meta")
    if all(name.endswith(("weight_packed", "weight_scale")) for name in tensors if ".experts." in name):
        for layer in model.model.layers:  # MXFP4 experts stay packed (no bf16 copy)
            if layer.is_moe_layer:
                layer.block_sparse_moe.store_mxfp4()
    params = dict(model.named_parameters())
    state = {k: v.to(device=device or "cpu", dtype=params[k].dtype)
             for k, v in rank_state_dict(model, tensors).items()}
    model.load_state_dict(state, strict=True, assign=True)
    if mxfp4_layout == "sm90" or (mxfp4_layout == "auto" and dtype == torch.bfloat16
                                  and expert_mxfp4.runs_on(device)):
        for layer in model.model.layers:
            moe = layer.block_sparse_moe if layer.is_moe_layer else None
            if moe is None or moe.experts.w13_weight.dtype != torch.uint8:
                continue
            ex = moe.experts
            why = expert_mxfp4.experts_supported(ex.w13_weight, ex.w13_weight_scale, ex.w2_weight, ex.w2_weight_scale)
            if why and mxfp4_layout == "sm90":
                raise ValueError(f"mxfp4_layout='sm90': {why} (load with mxfp4_layout='checkpoint')")
            if not why:
                moe.mxfp4_for_sm90()
    return model.to(dtype) if dtype != torch.bfloat16 else model
