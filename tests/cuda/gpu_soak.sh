#!/usr/bin/env bash
# Issue 15's GPU soak on the device tool, in calls that each fit its 10 minutes. The work runs in
# a process session of its own (setsid), so it outlives the call that started it while the machine
# stays warm (call again within ~30 s). Carry [".whl"].
#   bash tests/cuda/gpu_soak.sh synth       write the full-width qwen4exp GGUF (background)
#   bash tests/cuda/gpu_soak.sh start       when it is written: serve it and soak (background)
#   bash tests/cuda/gpu_soak.sh wait SECS   wait up to SECS for the soak's report; logs into $OUT
# SOAK_S (default 600) sets the soak's length, SERVE its server arguments after the model.
set -o pipefail
OUT=${OUT:-/tmp/mgserve-out}; mkdir -p "$OUT"
D=/tmp/soak; mkdir -p "$D"
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
  .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/xdg-cache
SERVE=${SERVE:---device cuda -c 65536 -np 4 -ctk q8_0 -ctv q8_0 --max-queue 8}
report() {
  for f in synth.log soak.log report.json metrics.txt; do [ -f "$D/$f" ] && cp "$D/$f" "$OUT/"; done
  [ -f "$D/serve.log" ] && tail -c 200000 "$D/serve.log" > "$OUT/serve.log"
  tail -n 5 "$D/synth.log" 2>/dev/null; tail -n 40 "$D/soak.log" 2>/dev/null
  nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
}
case "${1:-}" in
  synth)
    rm -rf "$D/repo"; cp -r . "$D/repo"  # the background work must not run from a tree a later
    cd "$D/repo" || exit 1               # call replaces
    setsid nohup bash -c "PYTHONPATH=/tmp/site:$D/repo python3 -m mgserve synth \
      --shape qwen4exp-flash-next --layers 48 --experts 256 --ple-rows 4000000 \
      --out $D/q4x.gguf > $D/synth.log 2>&1; echo \$? > $D/synth.rc" < /dev/null > /dev/null 2>&1 &
    sleep 20; report ;;
  start)
    for _ in $(seq 300); do [ -f "$D/synth.rc" ] && break; sleep 1; done
    [ "$(cat "$D/synth.rc" 2>/dev/null)" = 0 ] || { echo "synth not done"; report; exit 1; }
    cd "$D/repo" || exit 1
    # shellcheck disable=SC2086
    setsid nohup bash -c "PYTHONPATH=/tmp/site:$D/repo python3 loadtest/soak.py \
      --duration ${SOAK_S:-600} --warmup 60 --users 6 --long-words 6000 --max-tokens 64 --gpu \
      --ready-timeout 900 --log $D/serve.log --json $D/report.json --metrics-out $D/metrics.txt \
      -- -m $D/q4x.gguf $SERVE \
      > $D/soak.log 2>&1" < /dev/null > /dev/null 2>&1 &
    sleep 30; report ;;
  wait)
    end=$((SECONDS + ${2:-500}))
    while [ ! -f "$D/report.json" ] && [ $SECONDS -lt $end ]; do sleep 5; done
    report ;;
  *) echo "usage: $0 synth | start | wait SECS"; exit 2 ;;
esac
