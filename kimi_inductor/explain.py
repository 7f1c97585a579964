"""Compile (never run) one decode step of a preset and report what kimi_specialized does.

The model lives on the meta device and the process group is a fake one of G ranks,
so any preset explains on a laptop, the full 93-layer ``kimi-k3`` included: Dynamo
captures the step, AOTAutograd functionalizes it, our passes rewrite it, and the
result is not executed. Inductor's own post-grad passes are skipped (they do not
run on the meta device), so the graph is the AOT graph our passes would see before
Inductor's no-op removal; the match and the report are the same.

``explain_vllm`` does the same for the graph vLLM 0.33.0's own K3 model produces
(captured on CPU by ``vllm_cpu``; ``python -m kimi_inductor explain --vllm``).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor.compile_fx import compile_fx

from .config import Options
from .harness import data_parallel_groups
from .passes.manager import KimiPasses
from .passes.report import MatchReport
from .passes.snapshot import region_text
from .stock import KimiK3Config, KimiLinearForCausalLM, Parallel
from .stock.batch import DecodeBatch


def _observer(options: Options, layer: int | None, part: str, regions: dict[str, str],
              say: Callable[[str], None], started: dict[str, float]) -> Callable:
    """The passes' observer: progress lines, and ``layer``'s region before the passes and
    after each (into ``regions``)."""

    def observe(stage: str, gm) -> None:
        when, name = stage.split(maxsplit=1)
        if when == "before":
            if name == (options.passes or ("",))[0]:
                say(f"captured in {time.perf_counter() - started['time']:.1f} s; running our passes")
            started[name] = time.perf_counter()
            say(f"pass {name} ...")
        else:
            say(f"pass {name} done ({time.perf_counter() - started[name]:.1f} s)")
        if layer is not None and (when == "after" or not regions):
            regions["before" if when == "before" else name] = region_text(gm, layer, part)

    return observe


def explain_vllm(ranks: int = 2, layers: int | None = None, requests: int = 2, padding: int = 1, rank: int = 0,
                 layer: int | None = None, part: str = "attention", options: dict[str, Any] | None = None,
                 progress: Callable[[str], None] | None = None) -> tuple[MatchReport, dict[str, str]]:
    """``explain`` for vLLM 0.33.0's own Kimi K3 backbone: built on CPU by
    ``vllm_cpu`` (the tiny config, our replica's random weights through vLLM's loader)
    at TP ``ranks`` in vLLM's SP layout on a fake process group, one decode step
    captured with fullgraph Dynamo, and our passes run on the post-grad graph vLLM
    hands a post-grad pass. vLLM is patched for the rest of the process
    (``vllm_cpu.install``): call it from a process of its own."""
    from . import vllm_cpu

    say = progress or (lambda message: None)
    say(f"explain --vllm: vLLM 0.33.0's KimiLinearModel at TP {ranks} (SP layout, a fake process group), "
        f"{requests} requests + {padding} padding rows")
    vllm_config, model = vllm_cpu.build(tp=ranks, rank=rank, layers=layers)
    batch = vllm_cpu.decode_batch(model, vllm_config, requests, padding)
    regions: dict[str, str] = {}
    started = {"time": time.perf_counter()}
    report = MatchReport()
    parsed = Options.from_mapping(options)
    passes = KimiPasses(parsed, report, _observer(parsed, layer, part, regions, say, started))
    say("capturing the step (Dynamo, then AOTAutograd; vLLM's Triton kernels run interpreted) ...")
    vllm_cpu.capture(model, vllm_config, vllm_cpu.next_step(vllm_config, batch), on_graph=lambda gm: passes(gm.graph))
    say(f"done in {time.perf_counter() - started['time']:.1f} s")
    return report, regions


def explain(preset: str = "tiny", layout: str = "sp", ranks: int = 4, q: int = 1, requests: int = 8,
            rank: int = 0, layer: int | None = None, part: str = "attention",
            options: dict[str, Any] | None = None, progress: Callable[[str], None] | None = None,
            dp: int = 1) -> tuple[MatchReport, dict[str, str]]:
    """(report, regions): ``layer``'s ``part`` as the passes found it (``"before"``) and
    after each pass that ran (keyed by the pass name); empty without ``layer``.
    ``progress`` gets a line per stage (model, capture, each pass). ``dp``: TP groups
    of ``ranks`` sharing the experts (rank ``rank`` of ranks x dp)."""
    say = progress or (lambda message: None)
    if dist.is_initialized():
        raise RuntimeError("explain uses its own fake process group; call it outside a distributed job")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=ranks * dp)
    try:
        config = KimiK3Config.preset(preset)
        say(f"explain: the {preset} decoder ({config.num_hidden_layers} layers, {layout.upper()} layout) on the meta "
            f"device, a fake process group of {ranks}{f' x DP {dp}' if dp > 1 else ''}, {requests} requests x q = {q}")
        group = dist.group.WORLD if ranks > 1 else None
        if dp > 1:
            group = data_parallel_groups(dp)[0]
        par = Parallel(layout, group, ep_group=dist.group.WORLD if dp > 1 else None)
        model = KimiLinearForCausalLM(config, par, device="meta")
        batch = DecodeBatch(requests, q, 0, config.vocab_size, max_context=64)
        caches = model.allocate_caches(batch.num_slots, batch.num_blocks, batch.block_size, q, device="meta")
        regions: dict[str, str] = {}

        started = {"time": time.perf_counter()}
        report = MatchReport()
        passes = KimiPasses(Options.from_mapping(options), report,
                            _observer(Options.from_mapping(options), layer, part, regions, say, started))

        def run_passes(gm, example_inputs, **kwargs):
            passes(gm.graph)
            return make_boxed_func(lambda *args: None)

        def compile_only(gm, example_inputs, **kwargs):
            # On the meta device Inductor's joint-graph constant folding replaces a TP graph's
            # output (the final AttnRes) with an empty tensor and drops the last layer's MLP;
            # on a real device it does not (the passes then saw one layer too few)
            with torch._inductor.config.patch(joint_graph_constant_folding=False):
                compile_fx(gm, example_inputs, inner_compile=run_passes)
            outs = [a.meta["example_value"] for a in gm.graph.output_node().args[0]]
            return lambda *args: tuple(torch.empty_like(o) for o in outs)

        torch._dynamo.reset()
        say("capturing the step (Dynamo, then AOTAutograd; the longest part for the full presets) ...")
        started["time"] = time.perf_counter()
        with torch.no_grad():
            step = model.validate_step(batch.step(), caches).to("meta")
            torch.compile(model, backend=compile_only, fullgraph=True, dynamic=False)(step, caches)
        say(f"done in {time.perf_counter() - started['time']:.1f} s")
        return report, regions
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
