# Session 28's untimed A/B: the KDA kernel releases o_proj before its own wait
# (kda_decode.RELEASE_FIRST) against after its loads (main), the KDA layer at 1 / 2 / 8 rows
# in alternating processes (main, first, main, first), each with --profile's timeline.
# After the CuTe staging call (benchmarks/gpu_env.sh), carry [".device/cute1"]:
#     bash benchmarks/kda_release_ab.sh
. benchmarks/gpu_env.sh || exit 3
export TORCHINDUCTOR_FORCE_DISABLE_CACHES=1
for run in main1 first1 main2 first2; do
    step "$run"
    KIMI_INDUCTOR_KDA_RELEASE_FIRST=$([ "${run%?}" = first ] && echo 1 || echo 0) timeout 110 \
        python benchmarks/kda_layer.py --rows 1 2 8 --q 1 --profile --json "$OUT/kda_release_$run.json" 2>&1 \
        | grep -v Warn | grep rows
done
step "kda tests with the release first"
KIMI_INDUCTOR_KDA_RELEASE_FIRST=1 timeout 100 python -m pytest -q -x -p no:cacheprovider tests/kernels/test_kda_decode.py \
    2>&1 | tail -1
step done
