"""Sweep of the SM90 MXFP4 expert kernels (kernels/expert_mxfp4.py) on one GPU, random
MXFP4 codes and scales in the kernel's layout, each point in a CUDA graph:

* the op (``expert_ffn.mma_grouped``) over n8 tiles of pairs per pass x 16-row blocks
  per warp x warps per CTA, each checked bitwise against one tile and one block, and its
  default choice under each launch bound of ``--min-blocks`` (CTAs an SM the registers
  must allow: ``default_mb{n}``);
* its parts at the default choice, each alone: the pair grouping, the up projection,
  the down projection (with the floor of their own weight bytes) and the combine.

At EP 8 shapes (112 local experts) and EP 1 (896), 1 / 8 / 32 / 64 rows, top-16.

    python benchmarks/expert_mxfp4_sweep.py --json X [--experts 112 896] [--rows 1 8 32 64] [--min-blocks 4]
        [--default-only]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, floor_us, graph_time_us  # noqa: E402
from moe_experts import routing  # noqa: E402

from kimi_inductor.kernels import expert_ffn as X  # noqa: E402
from kimi_inductor.kernels import expert_mxfp4 as MX  # noqa: E402
from kimi_inductor.kernels.common import pdl  # noqa: E402

L, I, TOP_K = 3584, 3072, 16  # Kimi K3's latent, expert width, top-k
UP_BYTES, DOWN_BYTES = 2 * I * L // 2 * 17 // 16, L * I // 2 * 17 // 16  # codes + E8M0 scales


def experts(E: int) -> tuple:
    """(c13, t13, c2, t2): random MXFP4 experts in the kernel's layout (random bytes in
    either layout are random codes; scales 2^-7 .. 2^0)."""
    def codes(n, k):
        return torch.randint(0, 256, (E, n // 16, k // MX.CHUNK, MX.WARP, 16), dtype=torch.uint8, device="cuda")

    def scales(n, k):
        return torch.randint(120, 128, (E, n // 16, k // MX.BLOCK_K, MX.WARP, 4), dtype=torch.uint8, device="cuda")
    return codes(2 * I, L), scales(2 * I, L), codes(L, I), scales(L, I)


def parts_us(lat, w, ids, c13, t13, c2, t2) -> dict[str, float]:
    """The default call's launches, each alone in a graph (``mma_grouped``'s steps)."""
    E, P = c13.shape[0], ids.numel()
    order, starts, counts, position, slots = X.group_pairs(ids, E)
    tiles, on = MX.tiles_for(P, slots.numel(), TOP_K), bool(pdl(lat.device)["PDL"])
    h = lat.new_empty(P, I)
    y = torch.empty(P, L, dtype=torch.float32, device=lat.device)
    grouped = (slots, order, starts, counts, w.contiguous().view(-1))
    out = {"group_us": graph_time_us(lambda i: X.group_pairs(ids, E), calls=10, replays=7)}
    for name, x, c, t, dst in (("up", lat, c13, t13, h), ("down", h, c2, t2, y)):
        x32, c32 = x.view(torch.int32), c.view(torch.int32)
        run = MX.projection(name == "up", x32, c32, P, TOP_K, tiles, 4, 4.0, 25.0, on,
                            MX.blocks_per_warp(tiles, c.shape[1]))
        args = (x32, c32, t.view(torch.int32).squeeze(-1), *grouped, dst)
        out[f"{name}_us"] = graph_time_us(lambda i: run(*args), calls=10, replays=7)
    out["combine_us"] = graph_time_us(lambda i: X._combine_kernel[(ids.shape[0], (L + 511) // 512)](
        y, position, torch.empty(ids.shape[0], L, device=lat.device), L, TOP_K=TOP_K, BLOCK=512,
        **pdl(lat.device)), calls=10, replays=7)
    return out


def sweep(E: int, rows_list: list[int], gen: torch.Generator, res: Results, min_blocks: list[int],
          grid: bool = True) -> None:
    c13, t13, c2, t2 = experts(E)
    for rows in rows_list:
        ids, w = routing(rows, E, TOP_K, gen, "cuda")
        lat = torch.randn(rows, L, generator=gen).to(torch.bfloat16).cuda()
        hit = int(torch.unique(ids).numel())
        row = dict(experts=E, rows=rows, experts_hit=hit,
                   floor_us=floor_us(hit * (UP_BYTES + DOWN_BYTES) + rows * L * 6),
                   up_floor_us=floor_us(hit * UP_BYTES), down_floor_us=floor_us(hit * DOWN_BYTES),
                   default_tiles=MX.tiles_for(rows * TOP_K, min(E, rows * TOP_K), TOP_K))

        def op(**kw):
            return X.mma_grouped(lat, w, ids, c13, c2, 4.0, 25.0, t13, t2, **kw)
        base = op(tiles=1, rb=1)
        variants = ((1, 2, 4) if rows > 1 else (1,)) if grid else ()
        for tiles in variants:
            for rb in (1, 2):
                for warps in (2, 4, 8):
                    key = f"t{tiles}_rb{rb}_w{warps}"
                    row[key + "_equal"] = bool(torch.equal(op(tiles=tiles, rb=rb, warps=warps), base))
                    row[key + "_us"] = graph_time_us(lambda i: op(tiles=tiles, rb=rb, warps=warps), calls=10,
                                                     replays=7)
        row["default_us"] = graph_time_us(lambda i: op(), calls=10, replays=7)
        for mb in min_blocks:  # the default choice under each launch bound
            row[f"default_mb{mb}_equal"] = bool(torch.equal(op(min_blocks=mb), base))
            row[f"default_mb{mb}_us"] = graph_time_us(lambda i: op(min_blocks=mb), calls=10, replays=7)
        if min_blocks:  # the default again after them: the A/B's drift
            row["default_again_us"] = graph_time_us(lambda i: op(), calls=10, replays=7)
        if grid:
            row.update(parts_us(lat, w, ids, c13, t13, c2, t2))
        res.add(**row)


def launch_bound(text: str) -> int:
    """A ``--min-blocks`` value: CTAs an SM, at least 1 (0 is the compiler's choice, the
    default that every row times anyway)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: a launch bound is at least one CTA an SM (the default, no bound, "
                                         "is timed as default_us)")
    return value


def main(argv=None) -> Results:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, nargs="+", default=[112, 896])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--min-blocks", type=launch_bound, nargs="*", default=[],
                   help="also time the default choice with these launch bounds (CTAs an SM)")
    p.add_argument("--default-only", action="store_true",
                   help="time only the default choice (and its --min-blocks bounds): no variant grid, no parts")
    p.add_argument("--json")
    args = p.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    res = Results("expert_mxfp4_sweep")
    for E in args.experts:
        sweep(E, args.rows, gen, res, args.min_blocks, grid=not args.default_only)
        torch.cuda.empty_cache()
    if args.json:
        res.dump(args.json)
    return res


if __name__ == "__main__":
    main()
