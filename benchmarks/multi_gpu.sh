# The outstanding two-GPU measurements of issues 18 and 19, in one device call of under ten
# minutes on a 2 x H200 (or 2 x H100) machine, most needed first; each writes its JSON to $OUT.
# After the CuTe staging call (benchmarks/gpu_env.sh's header), carry [".device/cute1"]:
#     bash benchmarks/multi_gpu.sh
#  1. issue 19 item 3: the compiled tiny stack with every pass (sharded_moe included) over NCCL
#     against stock;
#  2. issue 19 item 1: the whole step at K3 per-rank shapes as a group of 2 (hybrid step vs
#     stock SP compiled by Inductor);
#  3. issue 19 item 2: the collectives the projection needs, in CUDA graphs;
#  4. issue 18: the MoE layer with MXFP4 experts at EP 2.
. benchmarks/gpu_env.sh || exit 3
step "gpu decode, 2 GPUs"
timeout 150 python -m pytest -q -p no:cacheprovider "tests/test_gpu_decode.py::test_compiled_decode_on_gpus_agrees_with_stock[2]" \
    2>&1 | tail -2 | tee "$OUT/test_gpu_decode_2.txt"
step "decode_step --gpus 2"
timeout 240 python benchmarks/decode_step.py --gpus 2 --rows 1 2 8 --q 1 --json "$OUT/decode_step_g2.json" 2>&1 \
    | grep -v Warn | tail -8
step "collectives --gpus 2"
timeout 60 python benchmarks/collectives.py --gpus 2 --rows 1 2 8 32 64 --json "$OUT/collectives_g2.json" 2>&1 \
    | grep -v Warn | tail -6
step "moe_layer_ep --gpus 2 --mxfp4"
timeout 120 python benchmarks/moe_layer_ep.py --gpus 2 --rows 1 8 32 64 --mxfp4 --json "$OUT/moe_layer_ep2_mxfp4.json" \
    2>&1 | grep -v Warn | tail -6
step "done"
