#!/usr/bin/env bash
# The exact sequence run on the GPU machine (the `run` device tool, nvidia-h200), from the repo root.
# Before it, here: `bash /work/shared/tools/device-wheels.sh` (fetches gguf and orjson into .whl/),
# then call the tool with carry [".whl"] and command `bash tests/cuda/run_on_device.sh`.
# Logs land in $OUT: gpu.txt, pytest.log, bench.log.
set -o pipefail
OUT=${OUT:-/tmp/mgserve-out}
mkdir -p "$OUT"
# pytest-asyncio is left out: these tests drive asyncio themselves, and the image's pytest decides
# which plugin versions load
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gguf-*.whl \
  .whl/orjson-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/xdg-cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import cuda.core, cuda.bindings, torch; print('cuda.core', cuda.core.__version__, \
'bindings', cuda.bindings.__version__, 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
timeout 300 python3 -m pytest -q -rA -s -p no:cacheprovider tests/cuda 2>&1 | tee "$OUT/pytest.log"
rc=$?
timeout 200 python3 -m mgserve bench matvec "$@" 2>&1 | tee "$OUT/bench.log"
cp BENCHMARKS.md "$OUT/BENCHMARKS.md"  # with --record: the new entry is at its end
exit $rc
