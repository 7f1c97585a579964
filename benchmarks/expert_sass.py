"""SASS instructions per weight value in the K loop of the MXFP4 expert kernels, compiled
for sm_90a on the CPU (no GPU needed) as they launch on the H200: default tile (BN 64,
BK 256, 4 warps, one stage), 16-divisible pointers, L and I, the register cap.

    python benchmarks/expert_sass.py [--maxnreg 128]

The loop is the innermost backward branch whose body holds the HGMMA; per value = its
instructions / (weight rows of the tile x BK / 128 threads)."""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kimi_inductor.kernels import expert_ffn as X

TILES = {"BM": 16, "BN": 64, "BK": 256, "DOT_F32": False, "ROUND": True, "MXFP4": True, "PDL": True}
UP = {"x_ptr": "*bf16", "stride_x": "i32", "w13_ptr": "*u8", "s13_ptr": "*u8", "order_ptr": "*i32",
      "starts_ptr": "*i32", "counts_ptr": "*i32", "h_ptr": "*bf16", "L": "i32", "I": "i32", "beta": "fp32",
      "linear_beta": "fp32", "TOP_K": "constexpr", **{k: "constexpr" for k in TILES}}
DOWN = {"h_ptr": "*bf16", "w2_ptr": "*u8", "s2_ptr": "*u8", "weights_ptr": "*fp32", "order_ptr": "*i32",
        "starts_ptr": "*i32", "counts_ptr": "*i32", "y_ptr": "*fp32", "L": "i32", "I": "i32",
        **{k: "constexpr" for k in TILES}}
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def k_loop(kernel, sig: dict, constexprs: dict, maxnreg: int | None) -> list[str]:
    attrs = {(i,): [["tt.divisibility", 16]] for i, (k, v) in enumerate(sig.items())
             if v.startswith("*") or k in ("L", "I", "stride_x")}
    compiled = triton.compile(ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
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
            if any("HGMMA" in x for x in body):
                loops.append(body)
    return min(loops, key=len)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--maxnreg", type=int, default=128, help="the register cap (0: none)")
    args = p.parse_args()
    for name, kernel, sig, constexprs, rows in (("up", X._up_kernel, UP, {"TOP_K": 16, **TILES}, 2 * TILES["BN"]),
                                                ("down", X._down_kernel, DOWN, TILES, TILES["BN"])):
        body = k_loop(kernel, sig, constexprs, args.maxnreg or None)
        values = rows * TILES["BK"] / 128  # per thread per K step
        ops = collections.Counter(INSTRUCTION.search(x).group(1) for x in body)
        print(f"{name}: {len(body)} instructions per K step, {len(body) / values:.2f} per value;",
              ", ".join(f"{k} {v / values:.2f}" for k, v in ops.most_common(8)))


if __name__ == "__main__":
    main()
