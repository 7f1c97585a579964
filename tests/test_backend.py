"""The kimi_specialized backend: registration, options, pass-through, reports, strictness."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import compile_tiny

import kimi_inductor
from kimi_inductor.backend import KimiSpecialized, match_report
from kimi_inductor.config import PASS_ORDER, DecodeSettings, Options
from kimi_inductor.passes.manager import KimiPasses, MatchError
from kimi_inductor.passes.report import MatchReport


def run_fresh(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


def test_entry_point_works_in_a_fresh_process_without_importing_us():
    proc = run_fresh("""
        import torch
        assert "kimi_specialized" in torch._dynamo.list_backends(exclude_tags=())
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        x = torch.randn(2, 4)
        compiled = torch.compile(m, backend="kimi_specialized", options={"compiler": "eager"})
        assert torch.allclose(compiled(x), m(x))
        from kimi_inductor.backend import match_report
        assert match_report(compiled).reason.startswith("not a Kimi K3 decoder graph")
        print("ok")
    """)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_match_report_of_something_not_compiled_by_us_says_what_to_pass():
    m = torch.nn.Linear(4, 4)
    for other in (m, torch.compile(m, backend="eager")):
        with pytest.raises(ValueError, match="not compiled by kimi_specialized; pass what torch.compile"):
            match_report(other)


def test_match_report_is_the_compiled_models_own():
    """Two models compiled with equal options keep their own reports (the named
    backend gives each torch.compile call its own object); before the first call there
    is no report, and match_report says to call the model first."""
    kimi_inductor.register()  # as the entry point does where the package is installed
    opts = {"compiler": "eager"}
    a = torch.compile(torch.nn.Linear(4, 4), backend="kimi_specialized", options=opts)
    with pytest.raises(ValueError, match="nothing compiled yet"):
        match_report(a)
    a(torch.randn(2, 4))
    first = match_report(a)
    b = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), backend="kimi_specialized",
                      options=opts)
    b(torch.randn(2, 4))
    assert match_report(a) is first and match_report(b) is not first
    assert first.graph == match_report(b).graph == 0


def test_a_torch_compile_mode_is_refused():
    kimi_inductor.register()
    with pytest.raises(ValueError, match="takes no torch.compile mode .got 'max-autotune'"):
        torch.compile(torch.nn.Linear(4, 4), backend="kimi_specialized", mode="max-autotune")


def test_register_is_idempotent():
    kimi_inductor.register()
    kimi_inductor.register()
    assert "kimi_specialized" in torch._dynamo.list_backends(exclude_tags=())


def _graphs_by_stage():
    """An observer recording each pass's graph code before and after it."""
    seen = {}
    return seen, lambda stage, gm: seen.__setitem__(stage, gm.code)


def _untouched(seen, report) -> None:
    """Every pass left the graph as it found it and says why."""
    for p in report.passes:
        assert seen[f"before {p.name}"] == seen[f"after {p.name}"], p.name
        assert p.rewritten == 0 and p.skipped == [report.reason], p


@pytest.mark.parametrize("width", [8, 7168])
def test_a_model_that_is_not_kimi_passes_through_unchanged(width):
    """Not a decoder: no pass touches it (at 7168 -> 12288 bf16, a K3-sized GEMM that
    lower_kernels would take in a decoder)."""
    torch._dynamo.reset()
    out, dtype = (3, torch.float32) if width == 8 else (12288, torch.bfloat16)
    m = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, out)).to(dtype)
    x = torch.randn(5, width, dtype=dtype)
    seen, observe = _graphs_by_stage()
    backend = KimiSpecialized({"compiler": "eager"}, observer=observe)
    compiled = torch.compile(m, backend=backend)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x))
    report = match_report(compiled)
    assert report is backend.report and not report.decoder and report.layers == []
    assert "not a Kimi K3 decoder graph" in report.reason
    _untouched(seen, report)


@pytest.mark.parametrize("options, message", [
    ({"pases": []}, "unknown kimi_specialized options"),
    ({"passes": ["fuse_everything"]}, "unknown pass"),
    ({"compiler": "tvm"}, "compiler must be one of"),
    ({"decode": {"q": 9}}, r"decode.q \(1 \+ speculative tokens\) must be in 1..8"),
    ({"decode": {"tp": 3}}, "decode.tp must be one of"),
    ({"decode": {"tp": 4, "dcp": 2}}, "decode.dcp must be 1 or equal to decode.tp"),
    ({"decode": {"batch": 2}}, "unknown decode settings"),
    ({"strict": "no"}, "strict must be True or False, got str 'no'"),
    ({"strict": 0}, "strict must be True or False, got int 0"),
    ({"decode": {"q": 4.0}}, "decode.q must be an int, got float 4.0"),
    ({"decode": {"q": True}}, "decode.q must be an int, got bool True"),
    ({"decode": {"tp": 2.0}}, "decode.tp must be an int, got float"),
    ({"decode": {"capture_sizes": ["8"]}}, "decode.capture_sizes entries must be an int, got str '8'"),
    ({"decode": {"capture_sizes": 8}}, r"decode.capture_sizes must be a list, e.g. \[8, 16\], got int 8"),
    ({"decode": {"capture_sizes": [0]}}, "decode.capture_sizes entries must be positive"),
    ({"decode": {"sharded_moe_rows": -1}}, r"decode.sharded_moe_rows must be >= 0 \(0: never\), got -1"),
    ({"decode": {"sharded_moe_rows": 8.0}}, "decode.sharded_moe_rows must be an int, got float 8.0"),
    ({"passes": ["mega_moe", "mega_moe"]}, r"passes lists \['mega_moe'\] more than once"),
    ({"passes": "mega_moe"}, r"passes must be a list, e.g. \['mega_moe'\], got str 'mega_moe'"),
    ({"passes": [1]}, "passes must be a list of pass names"),
    ({"decode": 8}, r"decode must be a dict with keys \['tp', 'q', 'dcp', 'capture_sizes', 'sharded_moe_rows'\], "
                    r"got int 8"),
    ("strict", "kimi_specialized options must be a dict"),
])
def test_bad_options_name_the_problem(options, message):
    with pytest.raises(ValueError, match=message):
        Options.from_mapping(options)
    with pytest.raises(ValueError, match=message):  # the backend object validates on construction
        KimiSpecialized(options)


def test_torch_compile_refuses_bad_options_before_the_first_call():
    """In a fresh process (the entry point, no import of ours), ``torch.compile`` itself
    raises the ValueError, not the first call (as a BackendCompilerFailed)."""
    proc = run_fresh("""
        import torch
        m = torch.nn.Linear(2, 2)
        for bad in ({"strict": "no"}, {"decode": {"q": 4.0}}, {"passes": "mega_moe"}, {"decode": 8}):
            for fullgraph in (False, True):
                try:
                    torch.compile(m, backend="kimi_specialized", options=bad, fullgraph=fullgraph)
                except ValueError as err:
                    print("refused:", err)
                else:
                    raise SystemExit(f"accepted {bad}")
        compiled = torch.compile(m, backend="kimi_specialized", options={"compiler": "eager", "strict": False})
        assert torch.allclose(compiled(torch.ones(1, 2)), m(torch.ones(1, 2)))
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr[-3000:]
    assert "refused: strict must be True or False, got str 'no'" in proc.stdout
    assert "refused: passes must be a list, e.g. ['mega_moe'], got str 'mega_moe'" in proc.stdout


def test_inductor_kernels_take_pdl_unless_turned_off(monkeypatch):
    """Inductor's generated kernels launch with PDL beside ours (its codegen applies it on
    SM90+ CUDA only); KIMI_INDUCTOR_PDL=0 turns both off."""
    from kimi_inductor.backend import _inductor_pdl

    if not hasattr(torch._inductor.config.triton, "enable_pdl"):
        pytest.skip("this torch's Inductor has no PDL code generation")
    assert _inductor_pdl() == {"triton.enable_pdl": True}
    monkeypatch.setenv("KIMI_INDUCTOR_PDL", "0")
    assert _inductor_pdl() == {}


def test_pass_uuid_covers_options_dispatch_tables_and_environment(monkeypatch):
    """Inductor's FX graph cache keys on the uuid: options, dispatch tables, environment
    switches and CuTe DSL's presence changed at run time (a benchmark's A/B variant, a user
    installing the cute extra) must not return the graph the other setting made."""
    from kimi_inductor.kernels import mla_decode, skinny_gemm

    a = KimiPasses(Options.from_mapping({}), MatchReport())
    b = KimiPasses(Options.from_mapping({"decode": {"tp": 2}}), MatchReport())
    assert a.uuid() == KimiPasses(Options(), MatchReport()).uuid() and a.uuid() != b.uuid()
    monkeypatch.setattr(mla_decode, "MERGE_INTO_UP", mla_decode.MERGE_INTO_UP + 1)
    merged = a.uuid()
    monkeypatch.setitem(skinny_gemm.FASTEST_BMM_GATE, (12, 512, 128), 64)
    assert len({a.uuid(), merged, KimiPasses(Options(), MatchReport()).uuid()}) == 2 and a.uuid() != merged
    monkeypatch.undo()
    default = a.uuid()
    assert default == KimiPasses(Options(), MatchReport()).uuid()
    monkeypatch.setenv("KIMI_INDUCTOR_MOE_IN_ROWS", "4")  # read by moe_projections while it runs
    assert a.uuid() != default
    monkeypatch.undo()
    monkeypatch.setattr(skinny_gemm, "cute_available", lambda: "a stand-in reason")  # the GEMV fusions need CuTe
    assert a.uuid() != default
    monkeypatch.undo()
    assert a.uuid() == default
    assert Options.from_mapping({"decode": {"capture_sizes": [8]}}).decode == DecodeSettings(capture_sizes=(8,))


@pytest.mark.parametrize("decode", [{}, {"tp": 2}])
def test_tp_layout_is_left_stock_and_reported(fake_world, decode):
    """The TP graph's all-reduces name only their group: G comes from the group, so
    ``decode.tp`` = 2 is this graph's deployment, not a mismatch."""
    backend, _ = compile_tiny(layout="tp", group=fake_world(2), options={"decode": decode})
    report = backend.report
    assert report.decoder and report.layout == "tp" and report.group_size == 2
    assert not any("hybrid_attention" in l.rewritten_by for l in report.layers)
    assert all("TP layout" in l.reason for l in report.layers)
    assert report.collectives_after == report.collectives_before


def test_strict_mode_raises_on_a_layer_it_cannot_rewrite(fake_world):
    """``MatchError`` comes through torch.compile as itself (not a BackendCompilerFailed),
    importable as docs/passes.md says, and is a ValueError."""
    with pytest.raises(kimi_inductor.MatchError, match="strict") as err:
        compile_tiny(layout="tp", group=fake_world(2), options={"strict": True})
    assert isinstance(err.value, MatchError) and isinstance(err.value, ValueError)
    assert not isinstance(err.value, torch._dynamo.exc.BackendCompilerFailed)


@pytest.mark.parametrize("decode, reason", [
    ({"capture_sizes": [8]}, "batch rows 16 not in decode.capture_sizes [8]"),
    ({"q": 2}, "graph verifies q=4 tokens per request, options say decode.q=2"),
    ({"tp": 4}, "graph has TP size 2, options say decode.tp=4"),
    ({"tp": 2, "dcp": 2}, "graph's MLA layers run decode context parallel 1, options say decode.dcp=2"),
])
def test_decode_settings_gate_every_pass(fake_world, decode, reason):
    seen, observe = _graphs_by_stage()
    backend, _ = compile_tiny(group=fake_world(2), options={"decode": decode}, observer=observe)
    report = backend.report
    assert report.reason == reason and [p.name for p in report.passes] == list(PASS_ORDER)
    assert all(l.reason == reason and not l.rewritten for l in report.layers)
    _untouched(seen, report)


def test_torch_logs_prints_the_report():
    proc = run_fresh("""
        import torch, torch.distributed as dist, sys
        sys.path.insert(0, "tests")
        from helpers import compile_tiny
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        compile_tiny(group=dist.group.WORLD, q=1, requests=2, padding=0)
    """, TORCH_LOGS="kimi_inductor")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kimi_specialized match report" in proc.stderr and "all-gather + reduce-scatter -> one all-reduce" in proc.stderr


def test_report_survives_an_inductor_cache_hit():
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    x = torch.randn(4, 8)
    reports = []
    for _ in range(2):  # the second compile is served by Inductor's FX graph cache
        torch._dynamo.reset()
        backend = KimiSpecialized({"compiler": "inductor"})
        with torch.no_grad():
            torch.compile(m, backend=backend)(x)
        reports.append(backend.report)
    assert reports[0].to_dict() == reports[1].to_dict()
    assert reports[1].reason.startswith("not a Kimi K3 decoder graph")


def test_meta_updater_passes_what_fake_tensor_updater_takes(monkeypatch):
    """torch 2.11 (the H200 machines) builds Inductor's FakeTensorUpdater from a graph,
    torch >= 2.12 from the GraphModule: every compile on the GPU failed with
    "'<lambda>' object has no attribute 'nodes'" when it was given the GraphModule."""
    import torch._inductor.fx_utils as fx_utils
    from torch import fx

    from kimi_inductor.passes.graph import MetaUpdater

    gm = fx.symbolic_trace(torch.nn.Linear(4, 4))

    class Graph211:  # torch 2.11's signature
        def __init__(self, graph: fx.Graph):
            assert isinstance(graph, fx.Graph)
            self.graph = graph

    class GraphModule212:  # torch >= 2.12's
        def __init__(self, gm: fx.GraphModule):
            assert isinstance(gm, fx.GraphModule)
            self.gm = gm

    monkeypatch.setattr(fx_utils, "FakeTensorUpdater", Graph211)
    assert MetaUpdater(gm).updater.graph is gm.graph
    monkeypatch.setattr(fx_utils, "FakeTensorUpdater", GraphModule212)
    assert MetaUpdater(gm).updater.gm is gm


AOT_STEP = """
    import copy, sys, torch
    from kimi_inductor.stock import KimiK3Config, Parallel
    from kimi_inductor.stock.batch import DecodeBatch
    from kimi_inductor.stock.checkpoint import build_model, random_checkpoint
    config = KimiK3Config.preset("tiny")
    model = build_model(config, random_checkpoint(config, 0), Parallel("sp", None))
    batch = DecodeBatch(3, 4, 1, config.vocab_size)
    caches = model.allocate_caches(batch.num_slots, batch.num_blocks, batch.block_size, batch.q)
    step = batch.step()
    torch.no_grad().__enter__()
    eager = model(step, copy.deepcopy(caches))
"""


def test_aot_compiled_function_saves_and_loads_in_a_fresh_process(tmp_path):
    """Dynamo's AOT compile (vLLM's default on torch >= 2.10): the artifact one process
    saves runs in another (which compiles the saved graph again) as the compiled
    function did, with the passes' report."""
    path = tmp_path / "step.aot"
    saved = run_fresh(AOT_STEP + f"""
    fn = torch.compile(type(model).forward, fullgraph=True, backend="kimi_specialized", options={{"compiler": "eager"}})
    aot = fn.aot_compile(((model, step, copy.deepcopy(caches)), {{}}))
    aot.save_compiled_function({str(path)!r})
    torch.save(aot(model, step, copy.deepcopy(caches)), {str(tmp_path / "saved.pt")!r})
    """)
    assert saved.returncode == 0, saved.stderr[-3000:]
    loaded = run_fresh(AOT_STEP + f"""
    from kimi_inductor.backend import KimiSpecialized
    with open({str(path)!r}, "rb") as f:
        fn = torch.compiler.load_compiled_function(f)
    out = fn(model, step, copy.deepcopy(caches))
    assert torch.equal(out, torch.load({str(tmp_path / "saved.pt")!r}))
    assert torch.equal(out, eager)  # the eager compiler with the passes on one rank: bitwise stock
    (backend,) = KimiSpecialized._shared.values()
    print(backend.report.layers[1].rewritten_by)
    """)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert "lower_kernels" in loaded.stdout


def tiny_one_rank(device: str = "cpu"):
    """The tiny stock model on one rank, and a step of it: ``step(requests)`` -> (inputs,
    two empty caches), T = (requests + 1 padding) x q = 2."""
    from kimi_inductor.stock import KimiK3Config, Parallel
    from kimi_inductor.stock.batch import DecodeBatch
    from kimi_inductor.stock.checkpoint import build_model, random_checkpoint

    config = KimiK3Config.preset("tiny")
    model = build_model(config, random_checkpoint(config), Parallel("tp", None), device=device)

    def step(requests):
        batch = DecodeBatch(requests, 2, 1, config.vocab_size)
        caches = [model.allocate_caches(batch.num_slots, batch.num_blocks, batch.block_size, batch.q, device=device)
                  for _ in "ab"]
        return model.validate_step(batch.step(), caches[0]).to(device), caches

    return model, step


def by_size_steps(device: str, compiler: str) -> None:
    """vLLM's modes 1 and 2 give one graph with a symbolic T. With decode.capture_sizes
    the backend compiles it as it is (the passes refuse: T is no capture size) and, on
    the first call at a capture size, again with that call's static shapes, where every
    pass applies; a second call at that size reuses it, a size outside runs the symbolic
    compile. Each output agrees with the stock model's eager step (bf16 band)."""
    model, fresh_step = tiny_one_rank(device)
    backend = KimiSpecialized({"compiler": compiler, "decode": {"capture_sizes": [8]}})
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, dynamic=True)

    def step(requests):
        inputs, caches = fresh_step(requests)
        with torch.no_grad():
            return compiled(inputs, caches[0]), model(inputs, caches[1])

    for requests, reports in ((5, 1), (3, 2), (3, 2), (7, 2)):  # T = 12 (symbolic), 8 (static), 8 again, 16
        got, want = step(requests)
        assert len(backend.reports) == reports
        error = ((got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1)).median()
        assert torch.isfinite(got).all() and error < 0.03, (requests, error)
    generic, static = backend.reports
    assert isinstance(generic.rows, str) and generic.reason.startswith(
        f"batch rows {generic.rows} not in decode.capture_sizes [8] (a symbolic batch: compiled again")
    assert static.rows == 8 and not static.reason
    assert all("mega_moe" in l.rewritten_by for l in static.layers if l.mlp == "moe")


def test_a_symbolic_batch_is_compiled_again_at_each_capture_size():
    by_size_steps("cpu", "eager")


def test_a_symbolic_batch_whose_symbol_is_no_argument_says_so(monkeypatch):
    """Where the batch symbol cannot be found among the graph's arguments (``row_argument``
    None: not seen from Dynamo, guarded here), the graph is not compiled per size: the
    report says so rather than promise it, the step runs the unrewritten compile, and
    ``strict`` raises naming the cause."""
    from kimi_inductor import backend as B

    monkeypatch.setattr(B, "row_argument", lambda example_inputs, rows: None)
    model, step = tiny_one_rank()
    inputs, caches = step(3)  # T = 8, symbolic
    for strict in (False, True):
        backend = KimiSpecialized({"compiler": "eager", "strict": strict, "decode": {"capture_sizes": [8]}})
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend, dynamic=True)
        with torch.no_grad():
            if strict:
                with pytest.raises(MatchError, match="none of the graph's arguments"):
                    compiled(inputs, caches[0])
                continue
            got, want = compiled(inputs, caches[0]), model(inputs, caches[1])
        (report,) = backend.reports
        assert report.per_size and report.reason.endswith(
            f"-- not done: the batch symbol {report.rows} is none of the graph's arguments")
        assert not any(l.rewritten_by for l in report.layers)
        assert torch.equal(got, want)  # the eager compiler without a rewrite: stock's bits


@pytest.mark.gpu
def test_a_symbolic_batch_is_compiled_again_at_each_capture_size_by_inductor_on_a_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the device machine)")
    by_size_steps("cuda", "inductor")
