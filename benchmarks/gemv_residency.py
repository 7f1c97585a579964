"""Registers of the CuTe GEMV per preload depth, and how many of its CTAs an SM90 GPU holds
at once, compiled for sm_90a on the CPU (no GPU needed) as it launches (PDL, the shape's
dispatched config, one output row block per CTA).

    python benchmarks/gemv_residency.py [--shape attn_o_proj] [--rows 1] [--preload 0 2 3 4 6]

A warp's preloaded weights are live in registers from before its PDL wait to the end
of its K loop; CTAs that do not fit beside the others start only as earlier ones exit,
so their weights stream after the wait. Resident CTAs: per SM min(8 by threads, 65536
registers / (threads x registers rounded up to 8)), x 132 SMs (the kernel before the
GEMV, e.g. KDA's 48 programs, takes some of that)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

os.environ.setdefault("CUTE_DSL_KEEP", "ptx")  # before cutlass is imported: keep the PTX for ptxas
_DUMP = tempfile.TemporaryDirectory(prefix="gemv_ptx_")  # removed at exit
os.environ.setdefault("CUTE_DSL_DUMP_DIR", _DUMP.name)

import torch
import triton

from kimi_inductor.kernels.common import SMS
from kimi_inductor.kernels.skinny_gemm import cute_gemv as G

from gemm import SHAPES


def registers(M: int, N: int, K: int, cfg: G.Config, preload: int) -> int:
    """Registers per thread of the sm_90a build (ptxas -v on the DSL's PTX)."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    exe = G.compile_gemv(M, N, K, True, torch.bfloat16, cfg, arch="sm_90a", pdl=True, preload=preload)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = re.sub(r"^\.version \d+\.\d+", ".version 8.7", exe.artifacts.PTX, count=1, flags=re.M)  # Triton's ptxas
        src = os.path.join(tmp, "gemv.ptx")
        with open(src, "w") as fh:
            fh.write(ptx)
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "gemv.cubin")],
                              capture_output=True, text=True, check=True).stderr
    return int(re.search(r"Used (\d+) registers", info).group(1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="attn_o_proj", choices=list(SHAPES))
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--preload", type=int, nargs="+", default=[0, 2, 3, 4, 6])
    args = p.parse_args()
    N, K, _ = SHAPES[args.shape]
    cfg = G.config(args.rows, N, K)
    threads = cfg.warps * G.WARP
    ctas = G.tiles(N, cfg) * cfg.split
    steps = K // (G.STEP * cfg.split)
    print(f"{args.shape} N={N} K={K} M={args.rows} {cfg}: {ctas} CTAs of {threads} threads, {steps} warp steps")
    fits = [0]
    for preload in args.preload:
        regs = registers(args.rows, N, K, cfg, preload)
        per_sm = min(2048 // threads, 65536 // (threads * -(-regs // 8) * 8))
        print(f"preload={min(preload, steps)} registers={regs} ctas_per_sm={per_sm} resident={per_sm * SMS} "
              f"of {ctas} ({min(1.0, per_sm * SMS / ctas):.0%})", flush=True)
        if per_sm * SMS >= ctas:
            fits.append(min(preload, steps))
    print(f"deepest preload with every CTA resident: {max(fits)}")


if __name__ == "__main__":
    main()
