#!/usr/bin/env bash
# Issue 8 on the GPU (device tool, nvidia-h200, carry [".whl"]): the device models on the
# converter's layouts, then a full-width synthetic qwen4exp file in llama.cpp's converter layout
# (1-D hyper-connection norms, qwen35 pre-tokenizer, Qwen3.5's chat template) written, served with
# --device cuda and asked a chat question. Logs land in $OUT.
set -o pipefail
OUT=${OUT:-/tmp/mgserve-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/xdg-cache
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
timeout 200 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu tests/cuda/test_device_models.py \
  tests/cuda/test_synth_device.py 2>&1 | tee "$OUT/pytest.log" | tail -15
F=/tmp/q4x.gguf
/usr/bin/time -f "synth: %e s" python3 -m mgserve synth --shape qwen4exp-flash-next --out $F \
  --experts ${EXPERTS:-64} --ple-rows 4000000 2>&1 | tail -3 | tee "$OUT/serve.log"
python3 -m mgserve info $F -c 32768 -np 2 2>&1 | head -12 | tee -a "$OUT/serve.log"
python3 -m mgserve serve -m $F --device cuda -c 32768 -np 2 --port 8181 > "$OUT/server.log" 2>&1 &
pid=$!
t0=$(date +%s)
until curl -fs localhost:8181/health >/dev/null 2>&1; do
  sleep 2; kill -0 $pid 2>/dev/null || { tail -20 "$OUT/server.log"; exit 1; }
  [ $(( $(date +%s) - t0 )) -gt 300 ] && { echo "not ready in 300 s"; tail -20 "$OUT/server.log"; exit 1; }
done
echo "server ready after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/serve.log"
curl -s localhost:8181/apply-template -d '{"messages":[{"role":"user","content":"Hi"}]}' | tee -a "$OUT/serve.log"; echo
curl -s localhost:8181/v1/chat/completions -H 'Content-Type: application/json' \
  -d '{"messages":[{"role":"user","content":"Name three colours."}],"max_tokens":16,"temperature":0}' \
  | tee -a "$OUT/serve.log"; echo
curl -s localhost:8181/completion -d '{"prompt":"The capital of France is","n_predict":32,"temperature":0}' \
  | python3 -c "import json,sys; d=json.load(sys.stdin); print('completion', d['tokens_predicted'], d['timings'])" \
  | tee -a "$OUT/serve.log"
kill $pid; wait $pid 2>/dev/null
tail -5 "$OUT/server.log"
