"""KimiK3Config: presets, schedule, HF round trip, refusals."""

import pytest

from kimi_inductor.stock import KimiK3Config, Parallel
from kimi_inductor.stock.kda import KimiDeltaAttention


def test_k3_schedule_matches_the_release():
    c = KimiK3Config.preset("kimi-k3")
    kinds = [c.layer_kind(i) for i in range(c.num_hidden_layers)]
    mla = [i for i, k in enumerate(kinds) if k == "mla"]
    assert mla == list(range(3, 92, 4)) + [92] and len(mla) == 24 and kinds.count("kda") == 69
    assert not c.is_moe_layer(0) and all(c.is_moe_layer(i) for i in range(1, 93))
    assert c.num_attn_res_blocks == 8 and c.latent_row == 576 and c.qk_head_dim == 192


def test_k31_replaces_every_mla_layer_by_dsa():
    c = KimiK3Config.preset("kimi-k3.1")
    kinds = [c.layer_kind(i) for i in range(93)]
    assert kinds.count("dsa") == 24 and "mla" not in kinds
    assert c.dsa_config["index_n_heads"] == 32 and c.dsa_config["index_topk"] == 2048


@pytest.mark.parametrize("preset", ["tiny", "tiny-k3.1"])
def test_tiny_keeps_every_mechanism_and_divides_by_8(preset):
    c = KimiK3Config.preset(preset)
    kinds = {c.layer_kind(i) for i in range(c.num_hidden_layers)}
    assert "kda" in kinds and kinds & {"mla", "dsa"}
    assert not c.is_moe_layer(0) and c.is_moe_layer(1)
    writes = [i for i in range(c.num_hidden_layers) if i % c.attn_res_block_size == 0]
    assert len(writes) >= 2 and c.num_attn_res_blocks >= 2
    for n in (c.kda_heads, c.num_attention_heads, c.num_experts, c.vocab_size):
        assert all(n % g == 0 for g in (1, 2, 4, 8))


def test_hf_round_trip_and_text_config():
    c = KimiK3Config.preset("tiny-k3.1")
    assert KimiK3Config.from_hf(c.to_hf()) == c
    assert KimiK3Config.from_hf({"text_config": c.to_hf(), "model_type": "kimi_k3"}) == c


@pytest.mark.parametrize("change, message", [
    ({"gate_lower_bound": -6.0}, "gate_lower_bound"),
    ({"use_full_rank_gate": False}, "use_full_rank_gate"),
])
def test_bad_kda_config_is_refused(change, message):
    hf = KimiK3Config.preset("tiny").to_hf()
    hf["linear_attn_config"].update(change)
    with pytest.raises(ValueError, match=message):
        KimiK3Config.from_hf(hf)


def test_missing_field_is_named():
    hf = KimiK3Config.preset("tiny").to_hf()
    del hf["kv_lora_rank"]
    with pytest.raises(ValueError, match="kv_lora_rank"):
        KimiK3Config.from_hf(hf)


class _FakeGroupPar(Parallel):
    """A Parallel whose size is fixed, to size per-rank weights without a process group."""

    def __init__(self, size):
        object.__setattr__(self, "layout", "tp")
        object.__setattr__(self, "group", None)
        object.__setattr__(self, "max_num_tokens", 8192)
        object.__setattr__(self, "_size", size)

    @property
    def size(self):
        return self._size


@pytest.mark.parametrize("G, width", [(1, 49376), (2, 24752), (4, 12448), (8, 6288), (16, 3216)])
def test_kda_in_proj_width_per_rank_is_padded_to_16(G, width):
    # kimi_k3_stock.md 6.1: per-rank packed width incl. padding
    c = KimiK3Config.preset("kimi-k3")
    attn = KimiDeltaAttention(c, _FakeGroupPar(G), device="meta")
    assert attn.in_proj_qkvgfab.weight.shape == (width, 7168)
