"""benchmarks/step_breakdown.py: kernels given to parts of the step by AttnRes position."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from step_breakdown import ATTN_RES, breakdown, top_kernels  # noqa: E402

LAYERS = [("kda", "dense"), ("mla", "moe")]


def one_step() -> list[tuple[str, float]]:
    return [("embedding", 1.0), (ATTN_RES, 2.0), ("gemm", 3.0), ("_kda_decode_kernel", 4.0), (ATTN_RES, 2.0),
            ("gemm", 5.0), (ATTN_RES, 2.0), ("_mla_split_kernel", 6.0), ("_combine_kernel", 1.0),
            ("ncclDevKernel_AllReduce", 7.0), (ATTN_RES, 2.0), ("router", 8.0), ("_up_kernel", 9.0),
            ("_down_kernel", 10.0), ("_combine_kernel", 11.0), (ATTN_RES, 2.0), ("norm", 12.0)]


def test_parts_of_two_steps():
    parts = breakdown(one_step() * 2, LAYERS, calls=2)
    assert parts == {"attention kda": 7.0, "attention mla": 7.0, "attn_res": 10.0, "moe non-expert": 8.0,
                     "experts": 30.0, "dense mlp": 5.0, "collectives": 7.0, "entry / exit": 13.0}
    assert sum(parts.values()) == sum(us for _, us in one_step())


def test_a_step_the_attn_res_count_does_not_delimit_is_refused():
    with pytest.raises(ValueError, match="4 AttnRes kernels for 1 steps of 2 layers"):
        breakdown([k for k in one_step() if k != (ATTN_RES, 2.0)] + [(ATTN_RES, 2.0)] * 4, LAYERS, calls=1)


def test_top_kernels_per_part():
    top = top_kernels(one_step() * 2, LAYERS, calls=2, n=2)
    assert top["experts"] == [("_combine_kernel", 11.0), ("_down_kernel", 10.0)]
    assert top["attention mla"] == [("_mla_split_kernel", 6.0), ("_combine_kernel", 1.0)]
    assert top["collectives"] == [("ncclDevKernel_AllReduce", 7.0)]
