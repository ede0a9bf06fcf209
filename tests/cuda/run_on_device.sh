#!/usr/bin/env bash
# The exact sequence run on the GPU machine (the `run` device tool, nvidia-h200), from the repo root.
# Before it, put the wheels the GPU machine lacks (gguf, orjson, pytest, pytest-asyncio, openai and
# its dependencies, for CPython 3.12) into .whl/, e.g. `pip download --only-binary :all: --python-version
# 3.12 -d .whl gguf orjson pytest pytest-asyncio openai` on a machine with a package index, and, for the
# real-Gemma tests, the built-in GGUF split into .gemma/part* (50 MB pieces: one call carries at most
# 64 MiB, so the pieces travel in consecutive calls while the machine is warm, and stay there);
# for the device-model tests, the tiny GGUF files exported here with the pinned transformers
# (`python3 -m tests.cuda.export_tiny .tiny`, ~50 MB: the machine's own transformers differs).
# Then: the tool with carry [".whl"] (plus ".gemma/partN" or ".tiny") and one of
#   bash tests/cuda/run_on_device.sh tests [PYTEST ARGS]   GPU tests + the API tests on the GPU
#     (TEST_PATHS="tests/cuda/test_x.py ..." narrows the default tests/cuda)
#   bash tests/cuda/run_on_device.sh bench ARGS            mgserve bench ARGS (e.g. model ...)
#   bash tests/cuda/run_on_device.sh both "PYTEST ARGS" BENCH ARGS
# Logs land in $OUT: gpu.txt, pytest.log, bench.log, BENCHMARKS.md.
set -o pipefail
OUT=${OUT:-/tmp/mgserve-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/xdg-cache
if ls .gemma/part* >/dev/null 2>&1; then
  cat .gemma/part* > /tmp/gemma.gguf
  if [ "$(sha256sum /tmp/gemma.gguf | cut -d' ' -f1)" = \
       a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 ]; then
    export MGSERVE_TEST_GEMMA=/tmp/gemma.gguf
  else
    echo "gemma pieces incomplete ($(ls .gemma))" | tee -a "$OUT/gpu.txt"
  fi
fi
if ls .tiny/*.gguf >/dev/null 2>&1; then
  export MGSERVE_TEST_TINY=$PWD/.tiny
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee -a "$OUT/gpu.txt"
python3 -c "import cuda.core, cuda.bindings, torch; print('cuda.core', cuda.core.__version__, \
'bindings', cuda.bindings.__version__, 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
mode=${1:-tests}; shift || true
rc=0
run_tests() {
  local extra=()
  [ -n "${MGSERVE_TEST_GEMMA:-}" ] && extra=(tests/api/test_real_gemma.py)
  timeout "${PYTEST_TIMEOUT:-420}" python3 -m pytest -q -rfEs -p no:cacheprovider --maxfail=40 --durations=15 \
    ${TEST_PATHS:-tests/cuda} "${extra[@]}" "$@" 2>&1 | tee "$OUT/pytest.log"
  rc=$?
}
case "$mode" in
  tests) run_tests "$@" ;;
  bench) timeout "${BENCH_TIMEOUT:-500}" python3 -m mgserve bench "$@" 2>&1 | tee "$OUT/bench.log"; rc=$? ;;
  both)
    pyargs=$1; shift
    # shellcheck disable=SC2086
    run_tests $pyargs
    timeout "${BENCH_TIMEOUT:-300}" python3 -m mgserve bench "$@" 2>&1 | tee "$OUT/bench.log" ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac
cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
exit $rc
