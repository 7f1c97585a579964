"""``python -m kimi_inductor {demo,explain,bench}``."""

from __future__ import annotations

import argparse
import json
import sys
import warnings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kimi_inductor")
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="the tiny stock decoder on CPU ranks, compiled by kimi_specialized, "
                                    "checked against stock")
    d.add_argument("--preset", default="tiny", choices=["tiny", "tiny-k3.1"])
    d.add_argument("--ranks", type=int, default=2, help="CPU ranks (gloo), the TP group size G")
    d.add_argument("--q", type=int, default=4, help="tokens per request (1 + speculative tokens)")
    d.add_argument("--steps", type=int, default=8)
    d.add_argument("--requests", type=int, default=3)
    d.add_argument("--padding", type=int, default=1, help="padding requests (CUDA-graph padding rows)")
    d.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    d.add_argument("--compiler", default="eager", choices=["eager", "inductor"])
    d.add_argument("--dcp", type=int, default=1, help="decode context parallel size: 1 or --ranks")
    d.add_argument("--json", dest="json_path", help="write the result as JSON here")

    e = sub.add_parser("explain", help="compile (never run) a preset's decode step and print the match report")
    e.add_argument("--preset", default="tiny", choices=["tiny", "tiny-k3.1", "kimi-k3", "kimi-k3.1"])
    e.add_argument("--layout", default="sp", choices=["sp", "tp"])
    e.add_argument("--ranks", type=int, default=4)
    e.add_argument("--q", type=int, default=1)
    e.add_argument("--requests", type=int, default=8)
    e.add_argument("--layer", type=int, help="also print this layer's region before the passes and after each")
    e.add_argument("--part", default="attention", choices=["attention", "mlp"])
    e.add_argument("--json", dest="json_path")

    b = sub.add_parser("bench", help="run the GPU benchmarks (benchmarks/), write JSON and a plot")
    b.add_argument("--out", default="bench-results", help="folder for the JSON files and the plot")
    b.add_argument("--only", nargs="+", help="a subset of the suite (kimi_inductor/bench.py SUITE), e.g. "
                                             "kda_layer_q1 moe_layer mla_layer dcp_mla")
    b.add_argument("--smoke", action="store_true", help="CPU smoke run of the KDA layer benchmark")

    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    if args.command == "demo":
        from .demo import demo, format_demo

        result = demo(args.preset, args.ranks, args.q, args.steps, args.requests, args.padding, args.dtype,
                      args.compiler, args.dcp, args.json_path)
        print(format_demo(result))
        return 0 if result["agree"] else 1

    if args.command == "bench":
        from .bench import bench

        for name, path in bench(args.out, args.only, args.smoke).items():
            print(f"{name}: {path}")
        return 0

    from .explain import explain

    report, regions = explain(args.preset, args.layout, args.ranks, args.q, args.requests,
                              layer=args.layer, part=args.part)
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
