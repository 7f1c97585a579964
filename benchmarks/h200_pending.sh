# The outstanding one-GPU measurements that want an H200 (changes timed only on H100s; the
# targets are H200 numbers), in one device call of under ten minutes, most needed first;
# each writes its JSON to $OUT. After the CuTe staging call (benchmarks/gpu_env.sh's
# header), carry [".device/cute1"]:
#     bash benchmarks/h200_pending.sh
#  1. issue 19 item 4: the KDA and MLA layers' kernel timelines with PDL (--profile's
#     kimi_timeline: where each kernel starts and ends, so where o_proj's weight stream
#     really overlaps the KDA kernel, and what MLA's second row adds), with the KDA layer
#     at every row count (<= 1.2x its floor at one row; session 23's chunks and later kernel
#     changes) and the MLA layer at 32 / 64 rows (last on an H200 in v8; 1 / 2 rows were
#     timed with main's MLA code in session 23), and the KDA kernels' disjoint durations
#     without PDL;
#  2. issue 18: the MXFP4 experts' two-tile loop at four CTAs an SM against the compiler's
#     choice, EP 8 (session 25: 1.3 % at 32 rows, nothing at 64 on an H100);
#  3. the KDA kernel's 32-row chunks against whole blocks from 8 requests (session 23, H100).
. benchmarks/gpu_env.sh || exit 3
step "kda_layer"
timeout 150 python benchmarks/kda_layer.py --rows 1 2 8 32 64 --q 1 --profile --json "$OUT/kda_layer.json" 2>&1 \
    | grep -v Warn | grep rows
step "mla_layer"
timeout 150 python benchmarks/mla_layer.py --rows 1 2 32 64 --q 1 --profile --json "$OUT/mla_layer.json" 2>&1 \
    | grep -v Warn | grep rows
step "kda_layer without PDL"
KIMI_INDUCTOR_PDL=0 timeout 60 python benchmarks/kda_layer.py --rows 1 2 --q 1 --profile \
    --json "$OUT/kda_layer_nopdl.json" 2>&1 | grep -v Warn | grep rows
step "expert_mxfp4_sweep --min-blocks 4"
timeout 80 python benchmarks/expert_mxfp4_sweep.py --experts 112 --rows 32 64 --min-blocks 4 --default-only \
    --json "$OUT/mxfp4_min_blocks.json" 2>&1 | grep -v Warn | grep rows
step "kda_kernel chunks"
timeout 80 python benchmarks/kda_kernel.py --requests 8 16 24 32 48 64 --q 1 --v-split 1 --v-chunk 0 32 \
    --json "$OUT/kda_kernel_chunks.json" 2>&1 | grep -v Warn | grep requests
step "done"
