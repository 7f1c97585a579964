"""SASS instructions per weight value in the K loop of the MXFP4 expert kernels, compiled
for sm_90a on the CPU (no GPU needed) as they launch on the H200: default tile (BN 64,
BK 256, 4 warps, one stage, L2 prefetch one step ahead), 16-divisible pointers, L and
I, the register cap.

    python benchmarks/expert_sass.py [--maxnreg 128] [--bn 64] [--bk 256]

The loop is the innermost backward branch whose body holds the HGMMA (HMMA for tiles
below 64 weight rows); per value = its instructions / (weight rows of the tile x BK / 128
threads). A 32-row down tile (``--bn 32``) upcasts every value twice (11-12 per value)."""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from kimi_inductor.kernels import expert_ffn as X

TILES = {"BM": 16, "BN": 64, "BK": 256, "DOT_F32": False, "ROUND": True, "MXFP4": True, "PREFETCH": 1,
         "SCAN": 128, "PDL": True}
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def k_loop(source, maxnreg: int | None) -> list[str]:
    """The SASS lines of the kernel's K loop."""
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 1, "maxnreg": maxnreg})
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout.splitlines()
    labels = {m.group(1): i for i, t in enumerate(text) if (m := re.match(r"\s*\.(L_x_\d+):", t))}
    loops = []
    for i, t in enumerate(text):
        m = re.search(r"BRA.*`\(\.(L_x_\d+)\)", t)
        if m and labels.get(m.group(1), i) < i:
            body = [x for x in text[labels[m.group(1)]:i + 1] if INSTRUCTION.search(x)]
            if any("HGMMA" in x or "HMMA" in x for x in body):  # WGMMA, or mma.sync below 64 rows
                loops.append(body)
    return min(loops, key=len)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--maxnreg", type=int, default=128, help="the register cap (0: none)")
    p.add_argument("--bn", type=int, default=TILES["BN"], help="weight rows per tile (the up kernel's: 2 BN)")
    p.add_argument("--bk", type=int, default=TILES["BK"], help="K per step")
    args = p.parse_args()
    tiles = {**TILES, "BN": args.bn, "BK": args.bk}
    for name, source in X.sm90_sources(tiles).items():
        body = k_loop(source, args.maxnreg or None)
        rows = tiles["BN"] * (2 if name == "up" else 1)  # the up kernel's tile: gate and up rows
        values = rows * tiles["BK"] / 128  # per thread per K step
        ops = collections.Counter(INSTRUCTION.search(x).group(1) for x in body)
        print(f"{name}: {len(body)} instructions per K step, {len(body) / values:.2f} per value;",
              ", ".join(f"{k} {v / values:.2f}" for k, v in ops.most_common(8)))


if __name__ == "__main__":
    main()
