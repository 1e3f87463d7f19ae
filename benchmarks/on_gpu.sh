#!/bin/bash
# Everything xsp checks on a lent GPU machine, in one run (see docs/gpu.md, "Checking on a GPU").
#
# First, here (the GPU machine reaches no registry): benchmarks/gpu_wheels.sh puts every wheel it
# lacks, for its Python, in .whl/ (list: benchmarks/gpu_wheels.txt); carry .whl. There:
#
#   OUT=... benchmarks/on_gpu.sh                 # every part
#   PARTS="first tests" benchmarks/on_gpu.sh     # some
#
# The parts run in order of what matters most, so that a run cut short still answers it: "first"
# (the C extensions built, else it stops at once; the C record path active; ResNet-50 inference at
# batch 1 and 32 under every level against torch.profiler, with kernel counts, dropped records,
# the clock and the untraced speed after xsp), "more" (a training step and BERT, timed the same
# way), then "tests" (the GPU suites, and the C record path on the fake libcupti) alongside
# "checks" (benchmarks/gpu_checks.py: every kernel inside its launch's window over a 60 s run, the
# operator level with both CUDA levels, CUPTI shared with torch.profiler, and CUDA graph replays on
# their capture-time layers; none is timed, so they
# share the machine), then
# "metrics" (the gpu_metrics level, on the newer CUPTI of .whl/pm, alone: its counters see the
# whole device), "probe", "examples" (xsp run on ResNet-50 and a training loop), "nsight" (xsp run
# --nvtx under nsys, where it is installed, exported and imported back) and "suite" (the unit and
# integration tests). Each has its own time limit, so one that hangs leaves the others. Without a
# CUDA GPU (a rehearsal: GPU_PYTHON=3.11 benchmarks/gpu_wheels.sh, then this) the CUDA parts say
# so and skip. Results under $OUT (the device tool brings back 8 files): log.txt, gpu.md/json
# (first), gpu_more.md/json, gpu_checks.md/json, gpu-tests.xml.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/xsp-gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
part() { echo; echo "=== $* ($(date +%T))"; }
PARTS=${PARTS:-first more tests checks metrics probe examples nsight suite}
want() { [[ " $PARTS " == *" $1 "* ]]; }
stop() { echo "STOP: $*"; exit 1; }

part machine
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi here"
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')"
python3 -m pip list 2>/dev/null | grep -i -E "^(nvidia-cuda-cupti|cupti-python|cuda-bindings|setuptools|protobuf|grpcio|transformers) "
if python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then CUDA=1; else CUDA=0; fi
cuda_or_skip() {  # PART: true when it can run; else says why it skips
    [ "$CUDA" = 1 ] && return 0
    echo "skipped: $1 needs a CUDA GPU, and PyTorch sees none here"
    return 1
}

part install
[ -d .whl/always ] || stop "no wheels in .whl/: run benchmarks/gpu_wheels.sh on the development machine and carry .whl"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/always/*.whl || stop "the wheels of .whl/always did not install"
# the cupti-python of the CUPTI PyTorch loads (nvidia-cuda-cupti's release), else the newest carried
cupti_wheel=$(python3 - <<'PY'
import glob, re
from importlib import metadata
installed = ""
for name in ("nvidia-cuda-cupti", "nvidia-cuda-cupti-cu12"):
    try:
        installed = metadata.version(name)
        break
    except metadata.PackageNotFoundError:
        pass
def release(path):
    return tuple(int(part) for part in re.search(r"cupti_python-([\d.]+)-", path).group(1).split("."))
wheels = sorted(glob.glob(".whl/cupti/cupti_python-*.whl"), key=release)
same = [wheel for wheel in wheels if release(wheel)[:2] == tuple(int(p) for p in installed.split(".")[:2] if p.isdigit())]
print((same or wheels or [""])[-1])
PY
)
[ -n "$cupti_wheel" ] || stop "no cupti-python wheel in .whl/cupti"
echo "cupti-python: $cupti_wheel"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$cupti_wheel" || stop "cupti-python did not install"
if ! python3 -c "import transformers" 2>/dev/null; then
    echo "transformers is missing here: installing .whl/if-missing"
    compgen -G ".whl/if-missing/*.whl" >/dev/null || stop "transformers is missing here and no wheels of it were carried: \
on the development machine, WHEEL_GROUPS=\"always cupti pm if-missing\" benchmarks/gpu_wheels.sh (and carry less)"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/if-missing/*.whl || stop "transformers did not install (the examples and benchmarks need it)"
fi
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || stop "xsp did not install"
extensions="import xsp.record._hotpath, xsp.record._activity, xsp.io._kineto, xsp.table._paths"
if ! python3 -c "$extensions" && [ -f .whl/prebuilt.tar ]; then
    echo "the C extensions did not build here: using those built for this Python on the development machine"
    tar -xf .whl/prebuilt.tar
fi
python3 -c "$extensions" \
    || stop "a C extension of xsp did not build (see the compiler's errors above): the figures would be the Python path's"
export XSP_REQUIRE_HOTPATH=1
xsp doctor

if want first; then
    part "first: the C record path and ResNet-50 at batch 1 and 32 against torch.profiler (benchmarks/gpu.py)"
    if cuda_or_skip "benchmarks/gpu.py"; then
        if timeout 420 python3 benchmarks/gpu.py --workloads 1,32 --iterations 20 --rounds 3; then
            cp benchmarks/results/gpu.md benchmarks/results/gpu.json "$OUT/"
            python3 - <<'PY'
import json
summary = json.load(open("benchmarks/results/gpu.json"))
print("record path:", summary["cupti"])
for key, entry in summary["batches"].items():
    print(f"batch {key}: kernel levels {entry['kernel_overhead_pct']:+.1f}% (goal {'+15' if key == '1' else '+3'}%), "
          f"torch.profiler {entry['profiler_overhead_pct']:+.1f}%; kernels {entry['kernels_xsp']} vs "
          f"{entry['kernels_profiler']}; dropped {entry['dropped_records']}; after xsp {entry['left_behind_pct']:+.1f}%; "
          f"clock: {entry['clock']}, drift {entry['clock_drift_ns']} ns")
PY
        else
            echo "benchmarks/gpu.py failed: no figures (see above)"
        fi
    fi
fi

if want more; then
    part "more: a ResNet-50 training step and BERT-base (benchmarks/gpu.py)"
    cuda_or_skip "benchmarks/gpu.py" && timeout 420 python3 benchmarks/gpu.py --workloads train_32,bert_8 \
        --iterations 20 --rounds 3 --name gpu_more && cp benchmarks/results/gpu_more.md benchmarks/results/gpu_more.json "$OUT/"
fi

gpu_tests() {
    # the real CUPTI in one process, the fake libcupti's tests in another: never both in one process
    echo "--- GPU tests (tests/gpu, -m gpu)"
    timeout 240 python3 -m pytest -q -rs tests/gpu tests/unit/test_gpu_metrics.py -p no:cacheprovider \
        --junitxml="$OUT/gpu-tests.xml"
    echo "--- C record path on the fake libcupti"
    timeout 150 python3 -m pytest -q -rs tests/unit/test_cuda.py tests/unit/test_cuda_records.py tests/unit/test_nvtx.py \
        -p no:cacheprovider
}
tests_pid=""
if want tests; then
    if want checks; then  # neither is timed: the tests run beside the checks, their output after them
        part "tests, in the background beside the checks"
        gpu_tests > /tmp/xsp-gpu-tests.log 2>&1 &
        tests_pid=$!
    else
        part "tests"
        gpu_tests
    fi
fi

if want checks; then
    part "checks: kernels inside their launch windows over 60 s; the operator level with both CUDA levels; CUPTI shared"
    if cuda_or_skip "benchmarks/gpu_checks.py"; then
        timeout 150 python3 benchmarks/gpu_checks.py --part clock --seconds 60
        timeout 90 python3 benchmarks/gpu_checks.py --part operator
        timeout 120 python3 benchmarks/gpu_checks.py --part shared
        timeout 150 python3 benchmarks/gpu_checks.py --part graphs
    fi
fi
if [ -n "$tests_pid" ]; then
    wait "$tests_pid"
    part "tests' output"
    cat /tmp/xsp-gpu-tests.log
fi

if want metrics; then
    part "metrics: the gpu_metrics level (PM sampling) on CUPTI 13.4, in a process of its own"
    pm_cupti=$(ls .whl/pm/nvidia_cuda_cupti-*.whl 2>/dev/null | head -1)
    pm_bindings=$(ls .whl/cupti/cupti_python-13.4*.whl 2>/dev/null | head -1)
    if [ -z "$pm_cupti" ] || [ -z "$pm_bindings" ]; then
        echo "skipped: no .whl/pm CUPTI or cupti-python 13.4 wheel carried"
    elif cuda_or_skip "benchmarks/gpu_checks.py --part metrics"; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-pm \
            "$pm_cupti" "$pm_bindings"
        PYTHONPATH=/tmp/site-pm:/tmp/site LD_LIBRARY_PATH=/tmp/site-pm/nvidia/cu13/lib:${LD_LIBRARY_PATH:-} \
            LD_PRELOAD=/tmp/site-pm/nvidia/cu13/lib/libcupti.so.13 timeout 90 python3 benchmarks/gpu_checks.py \
            --part metrics --seconds 60
    fi
fi
[ -f benchmarks/results/gpu_checks.json ] && cp benchmarks/results/gpu_checks.md benchmarks/results/gpu_checks.json "$OUT/"

if want probe; then
    part "benchmarks/gpu_probe.py"
    cuda_or_skip "benchmarks/gpu_probe.py" && timeout 180 python3 benchmarks/gpu_probe.py \
        && cp benchmarks/results/gpu_probe.md "$OUT/gpu_probe.md"
fi

if want examples && cuda_or_skip "the examples on cuda"; then
    part "xsp run: ResNet-50 on cuda, the model level, then every level"
    timeout 120 python3 examples/resnet50_inference.py --device cuda --batch-size 8 --iterations 30 > "$OUT/plain.txt"
    echo "plain exit $?"
    timeout 120 xsp run --levels model -o "$OUT/resnet_model.xsp.parquet" \
      -- examples/resnet50_inference.py --device cuda --batch-size 8 --iterations 30
    timeout 180 xsp run --levels model,layer,cuda_api,kernel --report -o "$OUT/resnet_cuda.xsp.parquet" \
      -- examples/resnet50_inference.py --device cuda --batch-size 8 --iterations 30 > "$OUT/traced.txt"
    echo "traced exit $?"
    head -1 "$OUT/plain.txt"; cat "$OUT/traced.txt"
    part "xsp run: a training loop on cuda, every level"
    timeout 180 xsp run --levels model,layer,operator,cuda_api,kernel --report -o "$OUT/mnist_cuda.xsp.parquet" \
      -- examples/workloads/mnist_train.py --device cuda --steps 12
    echo "traced exit $?"
fi

if want nsight && cuda_or_skip "the NVTX round trip through Nsight Systems"; then
    part "nsight: xsp run --nvtx under nsys, exported to SQLite and imported (issue 47's loop)"
    if command -v nsys >/dev/null 2>&1; then
        timeout 240 nsys profile --trace nvtx,cuda --force-overwrite true -o "$OUT/nvtx" xsp run --nvtx \
            --levels model,layer -o "$OUT/nvtx_own.xsp.parquet" -- examples/resnet50_inference.py --device cuda \
            --batch-size 8 --iterations 10
        timeout 120 nsys export --type sqlite --force-overwrite true -o "$OUT/nvtx.sqlite" "$OUT/nvtx.nsys-rep"
        timeout 120 python3 - "$OUT/nvtx_own.xsp.parquet" "$OUT/nvtx.sqlite" <<'PY'
import sys, xsp
own, back = xsp.load(sys.argv[1]).spans, xsp.load(sys.argv[2]).spans
for label, spans in (("own", own), ("from nsight", back)):
    layers = spans[spans["level"] == "layer"]
    print(label, len(spans), "spans;", len(layers), "layer spans;", spans["kind"].value_counts().to_dict())
names = set(own[own["level"] == "layer"]["name"]) - set(back[back["level"] == "layer"]["name"])
print("layer names missing from the import:", sorted(names)[:10] or "none")
PY
    else
        echo "SKIP: no nsys on this machine"
    fi
fi

if want suite; then
    part "unit and integration tests on a machine with CUDA (the CPU paths too)"
    parallel=""
    python3 -c "import xdist" 2>/dev/null && parallel="-n 14"
    # shellcheck disable=SC2086
    timeout "${SUITE_S:-240}" python3 -m pytest -q $parallel -p no:cacheprovider --ignore=tests/unit/test_diff.py \
        tests/unit tests/integration 2>&1 | tail -60
fi
part done
