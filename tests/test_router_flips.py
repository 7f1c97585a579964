"""The analysis of ``benchmarks/router_flips.py`` (issue 15, item 9(b)) on made-up router
logits: which (step, layer) a row's selected experts first differ at, the margin there,
and the tolerance rule of docs/testing.md. The GPU run is tests/test_gpu_router_flips.py."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
import router_flips  # noqa: E402


def test_margin_is_the_gap_between_the_kth_and_next_score():
    score = torch.tensor([[0.9, 0.5, 0.7, 0.1, 0.45]], dtype=torch.float64)
    assert torch.allclose(router_flips.margin(score, 2), torch.tensor([0.2], dtype=torch.float64))
    assert torch.allclose(router_flips.margin(score, 3), torch.tensor([0.05], dtype=torch.float64))


def test_first_flip_is_reported_with_the_reference_margin():
    k, E = 2, 4
    bias = {1: torch.zeros(E), 2: torch.tensor([0.0, 0.0, 0.0, 0.5])}
    ref = {l: torch.zeros(1, 3, 2, E) for l in bias}  # [trial, step, row, E]
    ref[1][..., :] = torch.tensor([2.0, 1.0, 0.99, -1.0])  # experts 0, 1 win; 1 vs 2 is a near tie
    ref[2][..., :] = torch.tensor([2.0, 1.0, -1.0, -3.0])
    run = {l: v.clone() for l, v in ref.items()}
    run[1][0, 1, 0, 2] = 1.02  # row 0: expert 2 overtakes 1 at step 1, layer 1
    run[2][0, 2, 1, 3] = 3.0  # row 1: expert 3 (biased) overtakes 1 at step 2, layer 2
    flips = router_flips.first_flips(ref, run, bias, k)
    by_row = {f["row"]: f["flip"] for f in flips}
    assert by_row[0]["step"] == 1 and by_row[0]["layer"] == 1
    s = torch.sigmoid(torch.tensor([1.0, 0.99]).double())  # the fp32 logits, scored in fp64
    assert abs(by_row[0]["margin"] - float(s[0] - s[1])) < 1e-12
    assert by_row[0]["lost"] == [(1, 2)] and by_row[0]["gained"] == [(2, 3)]  # (expert, rank under fp32)
    assert by_row[0]["margin"] <= 2 * by_row[0]["dscore"]
    assert by_row[1]["step"] == 2 and by_row[1]["layer"] == 2 and by_row[1]["gained"] == [(3, 3)]
    assert router_flips.first_flips(ref, ref, bias, k)[0]["flip"] is None


def _variant(forced, unflipped, move, flips=()):
    return dict(forced_median_error=forced[0], forced_max_error=forced[1], median_error_unflipped=unflipped[0],
                max_error_unflipped=unflipped[1], score_move={1: move}, flips=list(flips))


def test_rule_bounds_unflipped_rows_and_forced_routing_by_bf16_stocks_band():
    out = {"variants": {"bf16": _variant((0.006, 0.023), (0.006, 0.017), 3e-3),
                        "bf16_all": _variant((0.005, 0.021), (0.005, 0.020), 3.4e-3),
                        "fp32_all": _variant((1e-6, 5e-6), (1e-6, 5e-6), 1e-7)}}
    assert router_flips.check(out) == []
    out["variants"]["bf16_all"]["max_error_unflipped"] = 0.05  # a row off with its routing unchanged
    out["variants"]["bf16_all"]["score_move"][1] = 1e-2  # the router's inputs moved 3x more than bf16 stock's
    out["variants"]["fp32_all"]["max_error_unflipped"] = 8.7e-4  # TF32 in the fp32 model (before the fix)
    bad = router_flips.check(out)
    assert len(bad) == 3 and all(name in " ".join(bad) for name in ("max_error_unflipped", "score move",
                                                                      "fp32_all"))
