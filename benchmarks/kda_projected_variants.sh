# Session 27's untimed A/B (no device came): kda_decode_projected (form 3, ccb824a) with the gated
# GEMV's unroll 4 / 8 / 16 and the KDA kernel's release at its start, then the layer with the fastest.
# After the CuTe staging call (benchmarks/gpu_env.sh), carry [".device/cute1"]: bash benchmarks/kda_projected_variants.sh
. benchmarks/gpu_env.sh || exit 3
export TORCHINDUCTOR_FORCE_DISABLE_CACHES=1
t0=$(date +%s); step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
step "variants"; timeout 240 python benchmarks/kda_projected.py --rows 1 2 --variants --json $OUT/kda_projected_variants.json 2>&1 | grep -v Warn | tail -3
best=$(python - <<PY
import json
r = json.load(open("$OUT/kda_projected_variants.json"))["rows"][0]
v = {k[:-len("_projected_o_proj_us")]: t for k, t in r.items() if k.startswith("u") and k.endswith("_projected_o_proj_us")}
b = min(v, key=v.get); print(("1,4,1," + b[1:].split("_")[0]) + " " + ("1" if "early" in b else "0"))
PY
)
set -- $best; echo "best: gate $1 early $2"
step "kda_layer --projected"
timeout 150 python - <<PY 2>&1 | grep -v Warn | grep -i "rows\|error" | tail -6
import runpy, sys
from kimi_inductor.kernels import kda_decode, kda_projected
kda_projected.GATE_CONFIG = tuple(int(v) for v in "$1".split(","))
kda_decode.LATE_RELEASE_AT_START = bool(int("$2"))
sys.argv = ["kda_layer.py", "--rows", "1", "2", "--q", "1", "--projected", "--json", "$OUT/kda_layer_projected.json"]
runpy.run_path("benchmarks/kda_layer.py", run_name="__main__")
PY
step "projected tests"; timeout 90 python -m pytest -q -x -p no:cacheprovider tests/kernels/test_kda_projected.py 2>&1 | tail -4
step "mxfp4 test"; timeout 60 python -m pytest -q -x -p no:cacheprovider tests/kernels/test_expert_mxfp4.py -k hot_expert 2>&1 | tail -2
step done
