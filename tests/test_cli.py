"""The main job (``demo``) and ``explain`` as a user runs them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_inductor.explain import explain


@pytest.mark.slow
def test_demo_main_job_writes_its_json(tmp_path):
    out = tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, "-m", "kimi_inductor", "demo", "--ranks", "2", "--q", "4",
                           "--steps", "3", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "AGREE" in proc.stdout and "kimi_specialized {'all_reduce': 10" in proc.stdout
    result = json.loads(out.read_text())
    assert result["agree"] is True and result["max_abs_diff"] == 0.0 and result["tolerance"] == 0.0
    assert result["collectives_stock"] == {"all_reduce": 1, "all_gather": 10, "reduce_scatter": 9}
    assert result["collectives_compiled"] == {"all_reduce": 10, "all_gather": 8, "reduce_scatter": 0}
    assert [l["kind"] for l in result["layers"]] == ["kda", "kda", "kda", "mla", "kda", "kda", "kda", "mla", "mla"]
    assert all(l["rewritten"] and l["reason"] for l in result["layers"])


def test_explain_compiles_without_running():
    report, regions = explain("tiny-k3.1", "sp", ranks=4, q=2, requests=4, layer=3, part="attention")
    assert list(regions) == ["before", "hybrid_attention", "mega_moe", "lower_kernels"]
    before, after = regions["before"], regions["hybrid_attention"]
    assert report.layout == "sp" and all(l.rewritten for l in report.layers)
    assert [l.kind for l in report.layers][3] == "dsa"
    assert "c10d.reduce_scatter_tensor" in before and "c10d.all_reduce" in after
    assert "kimi.dsa_decode" in after and "reduce_scatter" not in after
    assert "kimi_kernels.dsa_decode" in regions["lower_kernels"]  # the region after every pass
    assert all(l.rewritten_by == ["hybrid_attention", "lower_kernels"] for l in report.layers if l.mlp == "dense")
    text = report.format()
    assert all(f"{name}: " in text for name in ("hybrid_attention", "mega_moe", "lower_kernels"))
    # the meta graph leaves the last AttnRes unread; lowering keeps it so every layer is annotated
    assert all(l.notes["kernels"].endswith("AttnRes: fused x2") for l in report.layers)


@pytest.mark.slow
def test_bench_smoke_runs_the_layer_benchmark_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kimi_inductor", "bench", "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "kda_layer_smoke.json").read_text())["rows"]
    assert rows and rows[0]["rel_err"] < 0.05


def test_runs_without_triton():
    """``pip install -e .`` where Triton has no wheel: every module imports and each op
    runs its CPU reference (the README's main job must not need the test extra)."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, kimi_inductor.backend, kimi_inductor.demo, kimi_inductor.kernels as k\n"
            "assert k.attn_res.supported(128, torch.bfloat16) == 'Triton is not installed'\n"
            "from helpers import compile_tiny\n"
            "backend, out = compile_tiny(layout='tp', requests=1, padding=0, q=1)\n"
            "assert torch.isfinite(out).all()\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          cwd=str(Path(__file__).parent))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
