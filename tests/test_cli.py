"""The main job (``demo``) and ``explain`` as a user runs them."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kimi_inductor.explain import explain


@pytest.mark.slow
def test_demo_main_job_writes_its_json(tmp_path):
    out = tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, "-m", "kimi_inductor", "demo", "--ranks", "2", "--q", "4",
                           "--steps", "3", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "AGREE" in proc.stdout and "kimi_specialized {'all_reduce': 26" in proc.stdout
    result = json.loads(out.read_text())
    # sharded_moe (16 rows <= 64) sums partial shared-expert outputs in bf16: the band, not bitwise
    assert result["agree"] is True and result["tolerance_rule"].startswith("bf16 band")
    assert result["measured"] == "median row error vs stock fp32" and result["value"] <= result["tolerance"]
    assert result["step_ms"]["stock"] > 0 and result["step_ms"]["compiled"] > 0
    assert result["all_ranks_identical"] is True
    assert result["collectives_stock"] == {"all_reduce": 1, "all_gather": 10, "reduce_scatter": 9}
    # the embedding's and each attention's all-reduce, two per MoE layer, nothing gathered
    assert result["collectives_compiled"] == {"all_reduce": 26, "all_gather": 0, "reduce_scatter": 0}
    assert all("sharded_moe" in l["rewritten_by"] for l in result["layers"] if l["mlp"] == "moe")
    assert [l["kind"] for l in result["layers"]] == ["kda", "kda", "kda", "mla", "kda", "kda", "kda", "mla", "mla"]
    assert all(l["rewritten"] and l["reason"] for l in result["layers"])


def test_explain_compiles_without_running():
    report, regions = explain("tiny-k3.1", "sp", ranks=4, q=2, requests=4, layer=3, part="attention")
    assert list(regions) == ["before", "hybrid_attention", "mega_moe", "sharded_moe", "lower_kernels", "byte_pages"]
    before, after = regions["before"], regions["hybrid_attention"]
    assert report.layout == "sp" and all(l.rewritten for l in report.layers)
    assert [l.kind for l in report.layers][3] == "dsa"
    assert "c10d.reduce_scatter_tensor" in before and "c10d.all_reduce" in after
    assert "kimi.dsa_decode" in after and "reduce_scatter" not in after
    assert "kimi_kernels.dsa_decode" in regions["lower_kernels"]  # the region after every pass
    assert all(l.rewritten_by == ["hybrid_attention", "lower_kernels"] for l in report.layers if l.mlp == "dense")
    text = report.format()
    assert all(f"{name}: " in text for name in ("hybrid_attention", "mega_moe", "sharded_moe", "lower_kernels"))
    # the meta graph leaves the last AttnRes unread; lowering keeps it so every layer is annotated
    assert all(l.notes["kernels"].endswith("AttnRes: fused x2") for l in report.layers)


@pytest.mark.parametrize("ranks, layout", [(1, "single"), (2, "tp")])
def test_explain_sees_every_layer_of_a_tp_graph(ranks, layout):
    """The meta-device capture keeps the TP graph's output (Inductor's joint-graph constant
    folding replaced it with an empty tensor there, and the last layer went with it)."""
    report, _ = explain("tiny", "tp", ranks=ranks, requests=4)
    assert report.decoder and report.layout == layout and len(report.layers) == 9
    assert all("lower_kernels" in l.rewritten_by for l in report.layers)


@pytest.mark.slow
def test_bench_smoke_runs_the_layer_benchmark_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kimi_inductor", "bench", "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "kda_layer_smoke.json").read_text())["rows"]
    assert rows and rows[0]["rel_err"] < 0.05


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_bench_without_a_gpu_is_refused_up_front(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kimi_inductor", "bench", "--step", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "need a CUDA GPU" in proc.stderr and "--smoke" in proc.stderr


def test_step_benchmark_smoke_compiles_every_layer(tmp_path):
    """``bench --step``'s script on CPU (tiny shapes, eager compilers): kimi_specialized
    rewrote every layer of the whole decoder and equals stock."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import decode_step

    rows = decode_step.main(["--smoke", "--rows", "2", "--q", "1", "--json", str(tmp_path / "step.json")]).rows
    assert rows and rows[0]["rewritten_layers"] == 9 and rows[0]["rel_err"] == 0.0


def test_step_benchmark_on_two_ranks_runs_the_hybrid_step(tmp_path):
    """``decode_step.py --gpus 2``'s plumbing on 2 CPU ranks (gloo), 3 rows (one SP padding
    row): the SP decoder becomes the hybrid step on every rank, every layer rewritten,
    each rank's rows written, and both ranks hold the same gathered output (the same
    distance from stock; the rewrite's numerics against stock are
    tests/test_sharded_moe.py's and test_hybrid_attention.py's)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import decode_step

    rows = decode_step.main(["--smoke", "--gpus", "2", "--rows", "3", "--q", "1", "--json",
                             str(tmp_path / "step.json")]).rows
    assert sorted(r["rank"] for r in rows) == [0, 1]
    for r in rows:
        assert r["layout"] == "hybrid" and r["rewritten_layers"] == 9 and math.isfinite(r["rel_err"])
    assert rows[0]["rel_err"] == rows[1]["rel_err"]


def test_ep_moe_layer_benchmark_with_mxfp4_experts_on_two_ranks():
    """``moe_layer_ep.py --mxfp4``'s plumbing on 2 CPU ranks (gloo), tiny preset: the
    experts held packed (codes + E8M0 scales), the mega_moe rewrite and the
    dequantise-then-dense Inductor baseline both equal to stock on every rank (the same
    reference math on CPU; the GPU run is issue 18's EP 2 measurement)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import moe_layer_ep

    from kimi_inductor.launch import run_ranks

    for rows in run_ranks(moe_layer_ep._measure, 2, [1, 3], True, True):
        assert [r["experts"] for r in rows] == ["mxfp4", "mxfp4"]
        assert all(r["rel_err"] < 1e-2 and r["inductor_rel_err"] < 1e-2 for r in rows)


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


def _run(args, cwd, **env):
    import os

    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=str(cwd),
                          env={**os.environ, **env})


def test_torch_logs_kimi_graphs_in_user_code(tmp_path):
    """TORCH_LOGS=kimi_graphs (docs/passes.md) used to crash every process at ``import
    torch`` (torch parses it before we can register the name)."""
    proc = _run(["-c", "import torch; print('ok')"], tmp_path, TORCH_LOGS="kimi_graphs")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    code = ("import torch\n"
            "from kimi_inductor.backend import KimiSpecialized\n"
            "m = torch.nn.Linear(4, 4)\n"
            "torch.compile(m, backend=KimiSpecialized({'compiler': 'eager'}))(torch.randn(2, 4))\n")
    proc = _run(["-c", code], tmp_path, TORCH_LOGS="kimi_graphs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kimi_inductor graph 0 before hybrid_attention" in proc.stderr
    assert "kimi_inductor graph 0 after lower_kernels" in proc.stderr and "aten.addmm" in proc.stderr
    quiet = _run(["-c", "import logging; logging.basicConfig(level=logging.DEBUG)\n" + code], tmp_path)
    assert quiet.returncode == 0 and "kimi_inductor graph" not in quiet.stderr  # only when asked for


def test_explain_prints_progress_and_torch_logs_kimi_graphs_works_with_python_m(tmp_path):
    proc = _run(["-m", "kimi_inductor", "explain", "--preset", "tiny", "--ranks", "2", "--requests", "2"],
                tmp_path, TORCH_LOGS="kimi_graphs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "graph 0: Kimi K3 decoder layout=sp -> hybrid rows=2 G=2" in proc.stdout
    for line in ("explain: the tiny decoder (9 layers, SP layout)", "capturing the step", "pass hybrid_attention ...",
                 "pass lower_kernels done", "kimi_inductor graph 0 before mega_moe"):
        assert line in proc.stderr, line


def test_demo_prints_progress(capsys):
    from kimi_inductor.__main__ import main

    assert main(["demo", "--ranks", "1", "--steps", "2", "--requests", "1", "--padding", "0", "--q", "1"]) == 0
    out, err = capsys.readouterr()
    assert "AGREE" in out and "step 1/2" not in out
    for line in ("demo: 2 runs of 2 steps (1 rows) on 1 CPU rank", "stock SP bfloat16: building the tiny model",
                 "stock SP bfloat16: step 2/2 done", "kimi_specialized: compiling the decode step",
                 "kimi_specialized: step 1/2 done", "kimi_specialized: step 2/2 done"):
        assert line in err, line


def test_help_shows_a_line_and_the_default_per_flag():
    from kimi_inductor.__main__ import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    for name, sub in subparsers.choices.items():
        flags = [a for a in sub._actions if a.option_strings and a.dest != "help"]
        assert flags and all(a.help for a in flags), name
        text = sub.format_help()
        for a in flags:
            if a.default not in (None, False):
                assert f"(default: {a.default})" in " ".join(text.split()), (name, a.dest)
    assert "(default: 2)" in subparsers.choices["demo"].format_help()


@pytest.mark.parametrize("argv, message", [
    (["demo", "--ranks", "0"], "argument --ranks: must be >= 1, got 0"),
    (["demo", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["demo", "--requests", "0"], "argument --requests: must be >= 1, got 0"),
    (["demo", "--padding", "-1"], "argument --padding: must be >= 0, got -1"),
    (["demo", "--q", "9"], r"argument --q: must be in 1..8, got 9"),
    (["demo", "--ranks", "two"], "argument --ranks: expected an integer, got 'two'"),
    (["demo", "--ranks", "2", "--dcp", "4"], r"argument --dcp: must be 1 or --ranks \(2\), got 4"),
    (["demo", "--ranks", "1", "--dp", "2"], "argument --dp: needs --ranks >= 2 in the SP layout"),
    (["explain", "--layout", "tp", "--dp", "2"], "argument --dp: needs --ranks >= 2 in the SP layout"),
    (["demo", "--dp", "0"], "argument --dp: must be >= 1, got 0"),
    (["explain", "--ranks", "0"], "argument --ranks: must be >= 1, got 0"),
    (["explain", "--requests", "0"], "argument --requests: must be >= 1, got 0"),
    (["explain", "--preset", "tiny", "--layer", "9"], "argument --layer: the tiny preset has layers 0..8, got 9"),
    (["bench", "--only", "kda_layer_q1", "nonexistent"], "argument --only: no benchmark named nonexistent; the suite: "),
    (["bench", "--smoke", "--only", "kda_layer_q1"], "argument --only: not with --smoke or --step"),
    (["bench", "--smoke", "--step"], "argument --step: not with --smoke"),
    (["demo", "--json", "/nonexistent-folder/out.json"], "argument --json: the folder of /nonexistent-folder/out.json"),
    (["explain", "--json", "/nonexistent-folder/r.json"], "argument --json: the folder of /nonexistent-folder/r.json"),
])
def test_bad_values_are_refused_up_front(argv, message, capsys):
    import re

    from kimi_inductor.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("command", ["explain", "demo"])
def test_a_tp_size_the_preset_does_not_split_is_an_error_not_a_traceback(command, capsys):
    """Refused deployments (ValueError on every rank, ``launch.run_ranks``) end as the
    CLI's one-line error."""
    from kimi_inductor.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main([command, "--ranks", "3"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{command}: error: vocab size 512 is not divisible by the TP size 3" in err
    assert "Traceback" not in err


def test_vllms_own_config_refusal_is_one_line(capsys):
    """``explain --vllm`` at a TP size vLLM's config refuses: pydantic's several-line
    error (with its inputs) becomes the CLI's one error line."""
    pytest.importorskip("vllm")
    from kimi_inductor.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["explain", "--vllm", "--ranks", "3"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("must be divisible by tensor parallel size (3).") and "input_value" not in err[-1]

