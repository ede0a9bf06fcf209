#!/usr/bin/env bash
# One device-tool call's worth of GPU checks after a merge (the lead's working script): pytest
# groups as NAME:SECONDS:ARGS... in $GROUPS (';'-separated), then any `mgserve bench` lines in
# $BENCHES (';'-separated, each "NAME:SECONDS:ARGS"). Logs in $OUT. Carry [".whl", ".tiny/..."].
set -o pipefail
OUT=${OUT:-/tmp/mgserve-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
  > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/xdg-cache
[ -d .tiny ] && export MGSERVE_TEST_TINY=$PWD/.tiny
IFS=';' read -ra gs <<< "${GROUPS_:-}"
for g in "${gs[@]}"; do
  IFS=':' read -r name secs args <<< "$g"
  # shellcheck disable=SC2086
  timeout "$secs" python3 -m pytest -q --tb=short -p no:cacheprovider -rfEs $args \
    > "$OUT/t_$name.log" 2>&1
  echo "== $name rc=$?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|us |ms " "$OUT/t_$name.log" | head -20
done
IFS=';' read -ra bs <<< "${BENCHES:-}"
for b in "${bs[@]}"; do
  IFS=':' read -r name secs args <<< "$b"
  # shellcheck disable=SC2086
  timeout "$secs" python3 -m mgserve bench $args > "$OUT/$name.log" 2>&1
  echo "== $name rc=$?"; grep -vE "^\s*$|Warning|warn" "$OUT/$name.log" | tail -45
done
cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
