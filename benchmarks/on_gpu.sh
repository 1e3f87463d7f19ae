#!/bin/bash
# Everything xsp checks on a lent GPU machine, in one run (see docs/gpu.md, "Checking on a GPU").
#
# Expects the wheels the machine lacks (cupti-python of the machine's CUDA major.minor,
# opentelemetry-*, msgspec, plotly, protobuf) in .whl/, and writes what it measured under $OUT:
# the log, benchmarks/results/gpu.md, the GPU tests' results and a profiled ResNet-50 and
# training loop (.xsp.parquet). Each part has its own time limit so one that hangs leaves the others.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/xsp-gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
part() { echo; echo "=== $* ($(date +%T))"; }
# PARTS picks what runs (all by default): tests probe benchmark examples suite
PARTS=${PARTS:-tests probe benchmark examples suite}
want() { [[ " $PARTS " == *" $1 "* ]]; }

part machine
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
python3 -m pip list 2>/dev/null | grep -i -E "^(nvidia-cuda-cupti|cuda-bindings|setuptools|protobuf|grpcio|transformers) "

part install
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
python3 -c "import xsp, xsp.record._hotpath, xsp.record._activity, cupti; from xsp.tracers._cupti import probe; print('xsp C path ok; CUPTI:', probe() or 'usable')"

# the real CUPTI in one process, the fake libcupti's tests in another: never both in one process
want tests && part GPU tests && timeout 180 python3 -m pytest -q -rs tests/gpu tests/unit/test_gpu_metrics.py \
  -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml"
want tests && part "C record path on the fake libcupti" && timeout 120 python3 -m pytest -q -rs \
  tests/unit/test_cupti.py tests/unit/test_cupti_records.py -p no:cacheprovider

want probe && part "benchmarks/gpu_probe.py" && timeout 180 python3 benchmarks/gpu_probe.py \
  && cp benchmarks/results/gpu_probe.md "$OUT/gpu_probe.md"

want benchmark && part "benchmarks/gpu.py" && timeout 300 python3 benchmarks/gpu.py --iterations 20 \
  && cp benchmarks/results/gpu.md benchmarks/results/gpu.json "$OUT/"

if want examples; then
part "xsp run: ResNet-50 on cuda, the model level, then every level"
timeout 120 python3 examples/resnet50_inference.py --device cuda --batch-size 8 --iterations 30 > "$OUT/plain.txt"
echo "plain exit $?"
timeout 120 xsp run --levels model -o "$OUT/resnet_model.xsp.parquet" \
  -- examples/resnet50_inference.py --device cuda --batch-size 8 --iterations 30
timeout 180 xsp run --levels model,layer,cuda_api,kernel --report -o "$OUT/resnet_cuda.xsp.parquet" \
  -- examples/resnet50_inference.py --device cuda --batch-size 8 --iterations 30 > "$OUT/traced.txt"
echo "traced exit $?"
head -1 "$OUT/plain.txt"; cat "$OUT/traced.txt"
python3 - "$OUT" <<'PY'
import sys, numpy as np, pandas as pd
for name in ("resnet_model", "resnet_cuda"):
    spans = pd.read_parquet(f"{sys.argv[1]}/{name}.xsp.parquet")
    steps = spans[spans.level == "model"].sort_values("start_ns").duration_ns.to_numpy() / 1e6
    host = spans[spans.level.isin(["layer", "cuda_api"])]
    gaps = []
    for step in sorted(host.step.dropna().unique()):
        ends = np.sort(np.concatenate([host[host.step == step].start_ns, host[host.step == step].end_ns]))
        gaps.append(float((np.diff(ends)[np.diff(ends) > 2e6]).sum() / 1e6))
    print(name, len(spans), "spans; step ms:", np.round(steps, 1).tolist())
    print("  median", round(float(np.median(steps)), 2), "ms; host gaps > 2 ms per step:", np.round(gaps, 1).tolist())
PY

part "xsp run: a training loop on cuda, every level"
timeout 180 xsp run --levels model,layer,cuda_api,kernel --report -o "$OUT/mnist_cuda.xsp.parquet" \
  -- examples/workloads/mnist_train.py --device cuda --steps 12
echo "traced exit $?"
fi
want suite && part "unit and integration tests on a machine with CUDA (the CPU paths too)"
timeout ${SUITE_S:-240} python3 -m pytest -q -n 14 -p no:cacheprovider --ignore=tests/unit/test_diff.py tests/unit tests/integration 2>&1 | tail -60
part done
