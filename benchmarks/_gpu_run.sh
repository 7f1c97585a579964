set -x
test -d /tmp/site/nvidia_cutlass_dsl || exit 3
xz -dc .device/cute1/ir.so.xz > "/tmp/site/$(cat .device/cute1/ir.path)"
ln -sfn ../passes kimi_inductor/passes; ln -sfn ../kernels kimi_inductor/kernels
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
python -m pytest -q -x tests/kernels/test_moe_projections.py tests/kernels/test_moe_router.py -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/tests.log
python benchmarks/moe_sharding.py --rows ${ROWS:-1 2 4 8} --ranks 8 ${SWEEP:---sweep} --profile --json $OUT/moe_sharding.json > $OUT/bench.log 2>&1; tail -40 $OUT/bench.log
