"""benchmarks/step_breakdown.py: kernels given to parts of the step by AttnRes position."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from step_breakdown import ATTN_RES, breakdown, kernel_profile, top_kernels  # noqa: E402

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


def test_timeline_is_each_kernels_mean_offset_from_its_calls_start(monkeypatch):
    # two calls of three kernels; the second starts early (PDL) in both
    events = [("gemv", 0.0, 10.0), ("kda", 8.0, 5.0), ("o_proj", 12.0, 4.0),
              ("gemv", 100.0, 12.0), ("kda", 109.0, 5.0), ("o_proj", 113.0, 6.0)]
    monkeypatch.setattr("step_breakdown.kernel_events", lambda fn, calls: events)
    assert kernel_profile(None, calls=2)[1] == [dict(kernel="gemv", start_us=0.0, end_us=11.0),
                                                 dict(kernel="kda", start_us=8.5, end_us=13.5),
                                                 dict(kernel="o_proj", start_us=12.5, end_us=17.5)]
    events.pop()  # a call short of a kernel: no one timeline
    with pytest.raises(ValueError, match="5 kernels in 2 calls"):
        kernel_profile(None, calls=2)
