# Source on the GPU machine, from the repository root, in the call after the staging call
# (docs/performance.md, "CuTe DSL on the GPU image"): CuTe DSL and TVM-FFI from /tmp/site,
# the package importable from the tree. Carry .device/cute1; exits 3 if the machine that
# took the staging call was given back meanwhile (it is after 30 s idle: have this call's
# command ready before making the first).
#
#   call 1, carry [".device/cute2", ".device/tvm"]:
#     mkdir -p /tmp/site && python3 -m pip install -q --no-index --no-deps --target /tmp/site \
#       .device/cute2/*.whl .device/tvm/*.whl && tar -xJf .device/cute2/cu13rest.tar.xz -C /tmp/site
#   call 2, carry [".device/cute1"]:
#     . benchmarks/gpu_env.sh && python benchmarks/kda_layer.py ...
test -d /tmp/site/nvidia_cutlass_dsl || { echo "the staged site is gone (machine given back): repeat call 1"; exit 3; }
[ -e /tmp/site/.ir_unpacked ] || { xz -dc .device/cute1/ir.so.xz > "/tmp/site/$(cat .device/cute1/ir.path)" \
    && touch /tmp/site/.ir_unpacked; } || exit 3
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD:$PYTHONPATH
# kimi_inductor.kernels / .passes as the editable install maps them
ln -sfn ../kernels kimi_inductor/kernels
ln -sfn ../passes kimi_inductor/passes
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import cutlass, tvm_ffi, torch, triton; print('CuTe DSL', cutlass.__version__, 'torch', torch.__version__, 'triton', triton.__version__)"
# a script's progress lines: "== <what> (<seconds since this file was sourced> s)"
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
