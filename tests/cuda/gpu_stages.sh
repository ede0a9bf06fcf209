#!/usr/bin/env bash
# GPU work for the open issues (device tool, nvidia-h200), in stages that each fit one call (10
# minutes). Carry [".whl"] plus, for `tests`, the tiny models
# (.tiny/qwen4exp.gguf, qwen3moe, llama, gemma3, qwen3: ~37 MB; qwen3next does not fit beside them).
# .whl: ../shared/tools/device-wheels.sh, then llguidance 1.9 (its manylinux_2_31 wheel: the script
# finds only 1.6), jinja2, markupsafe and prometheus-client for Python 3.12 (the benches need them).
#   bash tests/cuda/gpu_stages.sh tests       the GPU tests touched since (batch invariance first;
#                                              TESTS="name:seconds ..." picks others)
#   bash tests/cuda/gpu_stages.sh quick       full-width invariance and the headline rows
#   bash tests/cuda/gpu_stages.sh pdl         the headline rows with and without PDL, invariance
#   bash tests/cuda/gpu_stages.sh hgemm       long-prompt GEMM tests and prefill with and without it
#   bash tests/cuda/gpu_stages.sh table       the issue's qwen4exp table, profiles, invariance
#   bash tests/cuda/gpu_stages.sh sweep       1 and 5 sessions at 4k..250k, JSON + PNG
#   bash tests/cuda/gpu_stages.sh qwen3next   the qwen3next rows (Qwen3-Next-80B-A3B shapes)
#   bash tests/cuda/gpu_stages.sh agents      issue 11's GPU tests and figures: grammar masks on the
#                                              device sampler, decode under a schema at full width
#   bash tests/cuda/gpu_stages.sh sched       issue 12: the lane and plan tests, the 250k next turn,
#                                              mixed load with the prefill lane
#   bash tests/cuda/gpu_stages.sh pipeline    issue 14: virtual stages bitwise one stage on the GPU
#                                              (and two GPUs over NCCL where there are two)
#   bash tests/cuda/gpu_stages.sh dist        two pipeline ranks on one GPU through bench
#                                              pipeline-dist (tokens against one process)
#   bash tests/cuda/gpu_stages.sh owed        what the 2026-12-05 sessions left unrun on a GPU
#                                              (lane warm-up, two pipeline ranks on one GPU
#                                              through decode graphs, then dist); then owed2
#                                              (the link throttle at the seed's hops, verify8)
#   bash tests/cuda/gpu_stages.sh next        what 2026-12-06 05:20 left unrun: up-front decode
#                                              graphs, the QSA prompt kernels and their torch
#                                              path, F16Rows (hgemm tests)
#   bash tests/cuda/gpu_stages.sh next2       --paired rounds: virtual stages 1,2,3,6 (order
#                                              rotated) and --toggle qsa.prefill_kernels
#   bash tests/cuda/gpu_stages.sh gate        --toggle hc.prompt_gate_kernel, the prompt
#                                              chunk's gaps by Python frame
#   bash tests/cuda/gpu_stages.sh hostgaps    the prompt chunk's long gaps by host call
#   bash tests/cuda/gpu_stages.sh gcfreeze    --toggle gc.freeze, gaps by frame, mixed load
#   bash tests/cuda/gpu_stages.sh pleq        the PLE rows' GPU tests, --toggle ple.packed_rows
#   bash tests/cuda/gpu_stages.sh moetiles    --moe-tiles 64 / 128 / 256 rows side by side
#   bash tests/cuda/gpu_stages.sh moe128      the grouped kernels' tests on 128-row tiles,
#                                              qwen3next's tiles side by side
#   bash tests/cuda/gpu_stages.sh moetiles2   more MoE tilings around the default
#   bash tests/cuda/gpu_stages.sh next3       this session's unrun GPU tests, --gaps' new tables
#   bash tests/cuda/gpu_stages.sh mixedub     mixed load with the lane's chunks of 2048 and 1024
#   bash tests/cuda/gpu_stages.sh branches    a decode step's side chains: tests, on and off in
#                                              rounds, invariance
#   bash tests/cuda/gpu_stages.sh hctime      the HC mix's time per mix and other tunings
#   bash tests/cuda/gpu_stages.sh hcstep      the HC defaults' tests, decode rows, invariance
#   bash tests/cuda/gpu_stages.sh final       branch / add_shared tests, --toggle
#                                              moe.shared_parts, decode rows with the graph's
#                                              time alone
#   bash tests/cuda/gpu_stages.sh cluster     the decode mix on thread block clusters: tests,
#                                              time per mix, decode on and off, invariance
#   bash tests/cuda/gpu_stages.sh next4       the int8 readers' and the tiny qwen4exp's GPU
#                                              tests (clusters on), matvec times, decode rows
#   bash tests/cuda/gpu_stages.sh matvec      int8 matvec shapes at qwen4exp's projections
#   bash tests/cuda/gpu_stages.sh wgmma       the prompt GEMM on warpgroup MMA: bitwise against
#                                              mma.sync, timings, prefill on and off, invariance
#   bash tests/cuda/gpu_stages.sh wgmma2      the GEMM tests with wgmma on by default, the
#                                              table's prefill rows with profiles
#   bash tests/cuda/gpu_stages.sh next5       the wgmma review's test changes, the warm-up's
#                                              short chunk, qwen3next's rows
#   bash tests/cuda/gpu_stages.sh ncu         Nsight Compute counters of the heaviest prompt
#                                              and decode kernels (what bounds each)
#   bash tests/cuda/gpu_stages.sh router      the fused router and the shared expert in the MoE
#                                              down kernel: tests, --toggle route.fused
#   bash tests/cuda/gpu_stages.sh s16         router's tests and rounds, then next5's tests (one
#                                              call: each call's start costs minutes)
#   bash tests/cuda/gpu_stages.sh fused4      route.fused and moe.round_h apart (tests, 4 settings)
#   bash tests/cuda/gpu_stages.sh hcxq        the clustered mix writing its int8 form (tests,
#                                              hc.emit_xq on / off side by side, invariance)
#   bash tests/cuda/gpu_stages.sh s17         what 2026-12-06 22:50-01:27 could not run: the
#                                              graphs' packed inputs (re-apply first: the
#                                              stage's comment), the stacked HC inject,
#                                              last_cta; invariance, a served step's host
#                                              profile, the stacked inject on / off
#   bash tests/cuda/gpu_stages.sh s17min      s17's tests, host profile and invariance alone
#   bash tests/cuda/gpu_stages.sh s18         the DeltaNet scan on tensor cores (tests, per layer,
#                                              in the prompt), then s17min's tests and host profile
#   bash tests/cuda/gpu_stages.sh s18b        s18's scan and s19's three buffers, in one call
#   bash tests/cuda/gpu_stages.sh s18c        s18b in less device time (no wgmma tests)
#   bash tests/cuda/gpu_stages.sh s18d        the scan on tensor cores alone (tests, prompt)
#   bash tests/cuda/gpu_stages.sh s21         W decoded by byte permutes: tests, the MoE prompt
#                                              GEMMs on each decode and 256-row tiles side by
#                                              side; then the scan on tensor cores
#   bash tests/cuda/gpu_stages.sh s21min      s21's decode tests and three tilings alone
#   bash tests/cuda/gpu_stages.sh s21t        the split readers' tests, the two decodes side by side
#   bash tests/cuda/gpu_stages.sh s19         the wgmma MoE tiles on three buffers (tests,
#                                              prompt), the stacked HC inject on / off
#   bash tests/cuda/gpu_stages.sh s20         invariance, Nsight counters of the prompt GEMMs
#                                              and delta_scan_tc
#   bash tests/cuda/gpu_stages.sh s22         the clustered HC tests, then s20's counters
#   bash tests/cuda/gpu_stages.sh s24         route.lean: tests, decode off / on side by side
#   bash tests/cuda/gpu_stages.sh s25         s24 and qsa.cluster: tests, decode side by side
#   bash tests/cuda/gpu_stages.sh s27         hc.stage_hoist: the HC tests, invariance, decode off / on
#   bash tests/cuda/gpu_stages.sh s28         the HC tests, invariance and the decode rows (defaults)
#   bash tests/cuda/gpu_stages.sh ncu5        Nsight Compute counters of five sessions' t8 kernels
#   bash tests/cuda/gpu_stages.sh s34         fenced tickets' router tests, ncu1, the defaults
#   bash tests/cuda/gpu_stages.sh ncu1        Nsight Compute counters of one session's t1 kernels
#   bash tests/cuda/gpu_stages.sh s29         route.tickets.acq_rel: tests, decode off / on, invariance
#   bash tests/cuda/gpu_stages.sh s30         s28's tests and s29 in one call (no decode rows)
#   bash tests/cuda/gpu_stages.sh s31         route.split: tests, decode off / on (groups of 2, of 1),
#                                              invariance
#   bash tests/cuda/gpu_stages.sh moewg2      64 x 256 wgmma MoE tiles against 128 x 128
#   bash tests/cuda/gpu_stages.sh s39         the tests 21:45 left unrun, qsa.score_group side
#                                              by side, the defaults, one session's host profile
#   bash tests/cuda/gpu_stages.sh s40         ncu3, then ncu1
#   bash tests/cuda/gpu_stages.sh rows        Q4_K's W by half row-steps: tests, a chunk side by
#                                              side
#   bash tests/cuda/gpu_stages.sh s41         the MoE GEMMs' tests with every reader (the untried
#                                              ones too), the prefill rows with the defaults
#   bash tests/cuda/gpu_stages.sh s42         s41 with route.batch's tests and rounds
#   bash tests/cuda/gpu_stages.sh s43         the lane beside decoders with the MoE prompt GEMMs
#                                              padded to 1 CTA an SM (room for decode blocks)
#   bash tests/cuda/gpu_stages.sh s44         the prefill rows, a chunk's operations by family
#   bash tests/cuda/gpu_stages.sh rows2       the row readers at qwen4exp's shapes, a chunk side
#                                              by side (a short call)
#   bash tests/cuda/gpu_stages.sh chunks      a 16384-token prompt in chunks of 512..8192 tokens
#   bash tests/cuda/gpu_stages.sh ncu2        Nsight Compute counters of the wgmma prompt GEMMs,
#                                              the clustered HC mix and the fused router
#   bash tests/cuda/gpu_stages.sh ncu3        the MoE prompt GEMMs' and hgemm_wg's counters with
#                                              instruction and scheduler statistics
#   bash tests/cuda/gpu_stages.sh moewg       the wgmma MoE prompt kernels on 192- and 256-row
#                                              tiles, the DeltaNet scan on 16 columns: tests,
#                                              the prompt's tilings and scan widths side by side
# Logs and files land in $OUT. A fresh machine compiles each kernel module at its first use
# (minutes of device time for a full-width model): carry .kcache.tar.xz, the cubins built here
# without a GPU (same NVRTC, 13.0), and every stage starts with them in its cache:
#   mgserve kernels build --cache-dir /tmp/kc && tar -cJf .kcache.tar.xz -C /tmp/kc kernels
set -o pipefail
OUT=${OUT:-/tmp/mgserve-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/xdg-cache
if [ -f .kcache.tar.xz ]; then  # the prebuilt cubins into the kernel cache (python: no xz needed)
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
    .kcache.tar.xz "$XDG_CACHE_HOME/mgserve" \
    && echo "prebuilt kernels: $(ls "$XDG_CACHE_HOME/mgserve/kernels" | wc -l) cubins"
fi
[ -d .tiny ] && export MGSERVE_TEST_TINY=$PWD/.tiny
Q4X="--shape qwen4exp-flash-next --layers 48 --experts 256 --ple-rows 4000000"
ncu_kernels() {  # "name:kernel regex:launches" ...: Nsight Compute on one prompt chunk and
  # one eager decode step of the full-width model, the first launches of the matching kernels
  local NCU W SECTIONS spec name rx n
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  echo "ncu: ${NCU:-none}"; [ -n "$NCU" ] || return 0
  W="${NCU_W:-$Q4X --ctx 8192 --slots 1 --int8 --prefill 4096@0 --decode 0 --decode-steps 1 --multi-decode= --no-graphs} $NCU_EXTRA"
  SECTIONS="--section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats ${SECTIONS_EXTRA:-}"
  for spec in "$@"; do
    IFS=: read -r name rx n <<< "$spec"
    timeout 200 "$NCU" --clock-control none --target-processes all -k "regex:$rx" -c "$n" \
      $SECTIONS python3 -m mgserve bench model $W > "$OUT/ncu_$name.txt" 2>&1
    echo "== ncu $name rc=$?"
    grep -E "^  [a-z_0-9]+|Duration|Memory Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Stall|Issue Slots Busy|Executed Ipc A" \
      "$OUT/ncu_$name.txt" | head -70
  done
}
bench() {  # name timeout args...
  local name=$1 t=$2; shift 2
  timeout "$t" python3 -m mgserve bench "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$?"; tail -n 30 "$OUT/$name.log"
}
case "${1:-tests}" in
  tests)
    for f in ${TESTS:-batch_invariance:120 device_models:150 hc:60 qsa:60 qgemm:90 glue:40 \
        device_runner:60 rowpath:20 device_grammar:60}; do
      n=${f%%:*}
      timeout "${f##*:}" python3 -m pytest -q --tb=short -p no:cacheprovider -rfEs \
        "tests/cuda/test_$n.py" > "$OUT/t_$n.log" 2>&1
      echo "== $n rc=$?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/t_$n.log" | head -8
    done ;;
  pipeline)  # virtual stages (streams, pinned staging, events) and the engine with them
    TESTS="device_stages:300 device_stages_dist:200" bash "$0" tests ;;
  table)
    bench invariance 150 invariance $Q4X --int8 --record
    bench model 420 model $Q4X --ctx 262144 --slots 5 --int8 --prefill 4096@0,4096@32768 \
      --decode 0,32768,131072,250000 --multi-decode 5@32768,5@131072 \
      --sampled-prefill 1@250000,5@131072 --decode-steps 16 --profile --record ;;
  quick)  # invariance and the headline rows only
    bench invariance 150 invariance $Q4X --int8 --record
    bench model 300 model $Q4X --ctx 262144 --slots 5 --int8 --prefill 4096@0 --decode 0,131072 \
      --multi-decode 5@32768 --decode-steps 16 --profile --record ;;
  pdl)  # programmatic dependent launch on and off, side by side, then invariance with it on
    M="model $Q4X --ctx 262144 --slots 5 --int8 --prefill 4096@0 --decode 0,131072 --multi-decode 5@32768 --decode-steps 16"
    bench model_nopdl 200 $M --no-pdl --record
    bench model_pdl 200 $M --profile --record
    bench invariance 150 invariance $Q4X --int8 --record ;;
  hgemm)  # the long-prompt f16 GEMM: bitwise across M, timings, then prefill with and without it
    timeout 200 python3 -m pytest -q -s -rfE -p no:cacheprovider tests/cuda/test_qgemm.py \
      -k "hgemm_bitwise or hgemm_matches or hgemm_direct or dense_gemm_timing" > "$OUT/t_hgemm.log" 2>&1
    echo "== hgemm tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|ms|TFLOP" "$OUT/t_hgemm.log" | head -40
    M="model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 --decode 0 --multi-decode= --decode-steps 4"
    bench prefill_hgemm 120 $M --record
    bench prefill_qgemm 120 $M --hgemm 128,256,32,4,2,4,1,8,1000000 --record ;;
  router)  # 2026-12-06 19:25: route.cu's matvec_route and the shared expert added by the MoE
    # down kernel (carry .whl and the tiny qwen4exp / qwen3): bitwise tests, whole decode steps
    # fused against unfused, the launch count, then decode with and without them side by side
    timeout 220 python3 -m pytest -q -s --tb=line -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_fused_router.py tests/cuda/test_fused_decode.py tests/cuda/test_route.py \
      tests/cuda/test_glue.py tests/cuda/test_moe.py \
      -k "not timing" > "$OUT/t_router.log" 2>&1
    echo "== router tests rc=$?"
    grep -E "^(FAILED|ERROR|E )|passed|failed|fused .* torch" "$OUT/t_router.log" | head -30
    bench router_paired 200 model $Q4X --ctx 262144 --slots 5 --int8 --prefill= --decode 0 \
      --multi-decode 5@32768 --decode-steps 16 --paired 5 --toggle route.fused --record ;;
  s16)  # router, then next5's tests, within one call's 600 s
    bash "$0" router; cp BENCHMARKS.md "$OUT/"
    timeout 150 python3 -m pytest -q -s --tb=line -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_hgemm_wgmma.py tests/cuda/test_qgemm_wgmma.py tests/cuda/test_warmup.py \
      -k "not timing" > "$OUT/t_next5.log" 2>&1
    echo "== next5 tests rc=$?"
    grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_next5.log" | head -20 ;;
  fused4)  # the router fusion (route.fused) and the gate/up's own int8 rounding (moe.round_h)
    # apart: their tests, then decode rows under the four settings, two rounds
    timeout 150 python3 -m pytest -q --tb=line -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_fused_router.py tests/cuda/test_fused_decode.py > "$OUT/t_fused4.log" 2>&1
    echo "== fused4 tests rc=$?"
    grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_fused4.log" | head -20
    M="model $Q4X --ctx 262144 --slots 5 --int8 --prefill= --decode 0 --multi-decode 5@32768 --decode-steps 16"
    for r in 1 2; do for f in true false; do for q in true false; do
      timeout 100 python3 -m mgserve bench $M --set route.fused=$f --set moe.round_h=$q --record \
        > "$OUT/f4_${f}_${q}_$r.log" 2>&1
      echo "== route.fused=$f moe.round_h=$q round $r rc=$?"
      grep -E "^\| decode" "$OUT/f4_${f}_${q}_$r.log"
    done; done; done ;;
  hcxq)  # 2026-12-06 20:30: hc_upl on 32-column CTAs rounds its output to int8 (hc.emit_xq)
    timeout 150 python3 -m pytest -q --tb=line -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_hc_cluster.py tests/cuda/test_fused_decode.py \
      -k "xq or invariant or graph or bitwise or launches" > "$OUT/t_hcxq.log" 2>&1
    # (test_decode_steps_bitwise_emit_xq: whole decode steps with it on against off)
    echo "== hcxq tests rc=$?"
    grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_hcxq.log" | head -20
    M="model $Q4X --ctx 262144 --slots 5 --int8 --prefill= --decode 0 --multi-decode 5@32768 --decode-steps 16"
    for r in 1 2; do for v in true false; do
      timeout 100 python3 -m mgserve bench $M --set hc.emit_xq=$v --record > "$OUT/xq_${v}_$r.log" 2>&1
      echo "== hc.emit_xq=$v round $r rc=$?"; grep -E "^\| decode" "$OUT/xq_${v}_$r.log" | head -2
    done; done
    bench invariance 150 invariance $Q4X --int8 --set hc.emit_xq=true --record ;;
  moewg)  # 2026-12-06 23:20: qgemm_wgmma.cu on 3 and 4 warpgroups (an expert's ~160 rows, one
    # tile); the DeltaNet prompt scan on 16 state columns a CTA (deltanet.scan_cols)
    timeout 200 python3 -m pytest -q -s --tb=line -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_qgemm_wgmma.py tests/cuda/test_deltanet_prefill_kernel.py \
      > "$OUT/t_moewg.log" 2>&1
    echo "== moewg tests rc=$?"
    grep -E "^(FAILED|ERROR|E )|passed|failed|grouped moe" "$OUT/t_moewg.log" | head -20
    bench moewg 200 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 --decode= \
      --multi-decode= --paired 3 --moe-tiles wg:128,128,2/wg:192,128,1/wg:256,128,1 --record
    for r in 1 2; do for c in 16 32; do
      timeout 90 python3 -m mgserve bench model $Q4X --ctx 65536 --slots 1 --int8 \
        --prefill 4096@0 --decode= --multi-decode= --set deltanet.scan_cols=$c --record \
        > "$OUT/scan_${c}_$r.log" 2>&1
      echo "== scan_cols=$c round $r rc=$?"; grep -E "^\| prefill" "$OUT/scan_${c}_$r.log"
    done; done ;;
  exact)
    bench exact 300 model $Q4X --ctx 262144 --slots 5 --prefill 4096@0 --decode 0,131072 \
      --multi-decode "" --decode-steps 16 --record ;;
  sweep)
    bench sweep 300 model $Q4X --ctx 262144 --slots 5 --int8 --prefill "" \
      --decode 4096,32768,65536,131072,204800,250000 \
      --multi-decode 5@4096,5@32768,5@65536,5@131072,5@204800,5@250000 --decode-steps 8 \
      --json "$OUT/sweep.json" --record
    python3 -m mgserve bench plot "$OUT/sweep.json" --out "$OUT/depth_sweep.png" ;;
  qwen3next)
    bench qwen3next 540 model --shape qwen3next-80b-a3b --layers 48 --ctx 262144 --slots 5 \
      --int8 --prefill 4096@0,4096@32768 --decode 0,32768,131072,250000 \
      --multi-decode 5@32768 --decode-steps 16 --profile --record ;;
  agents)  # issue 11: device grammar and admission tests, then the structured-output figures
    for f in device_grammar:80 device_admission:80; do
      n=${f%%:*}
      timeout "${f##*:}" python3 -m pytest -q --tb=short -p no:cacheprovider -rfEs \
        "tests/cuda/test_$n.py" > "$OUT/t_$n.log" 2>&1
      echo "== $n rc=$?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/t_$n.log" | head -8
    done
    timeout 100 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/bench/test_structured.py > "$OUT/t_structured.log" 2>&1
    echo "== bench/test_structured rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/t_structured.log"
    bench grammar 50 grammar --engines llguidance --record
    bench structured 270 structured $Q4X --ctx 8192 --slots 4 --int8 --sessions 1,4 --steps 64 \
      --device cuda --record ;;
  sched)  # issue 12: carry .tiny/qwen4exp.gguf, qwen3.gguf, qwen3next.gguf
    timeout 100 python3 -m pytest -q -s --tb=short -p no:cacheprovider -rfEs -m gpu \
      tests/cuda/test_device_lanes.py tests/cuda/test_plan.py > "$OUT/t_sched.log" 2>&1
    echo "== sched tests rc=$?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|chunk|planned" "$OUT/t_sched.log"
    bench turn 200 turn $Q4X --int8 --ctx 262144 --slots 2 --prompt 250000 --generated 16 \
      --user 200 --edit 1000 --record
    bench mixed 250 mixed $Q4X --int8 --ctx 262144 --slots 3 --depth 131072 --prompt 65536 \
      --ubatch 4096 --itl-target-ms 1.5x --time-limit 60 --prefill-lane --record ;;
  owed)  # what the 2026-12-05 sessions could not run on a GPU (carry .whl and the tiny
    # qwen4exp, qwen3, gemma3): the warm-up's lane batches, the engine with the lane on by default,
    # two pipeline ranks on one GPU over gloo through decode graphs (tests), then the same
    # through bench pipeline-dist at full width (``dist``); ``owed2`` has the rest
    timeout 250 python3 -m pytest -q --tb=short -p no:cacheprovider -rfEs -m gpu \
      tests/cuda/test_device_stages_dist.py tests/cuda/test_warmup.py \
      tests/cuda/test_device_lanes.py tests/core/test_activations_setting.py > "$OUT/t_owed.log" 2>&1
    echo "== owed tests rc=$?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/t_owed.log"
    DIST_T=250 bash "$0" dist ;;
  owed2)  # the link throttle on 6 virtual stages at the seed's hops (PCIe 3.0 at 0.8 of the raw
    # rate, x8/x8/x4/x2/x4/x4 through host memory: 1 / (1/a + 1/b) per hop), k = 8 verify
    bench links 200 model $Q4X --ctx 65536 --slots 5 --int8 --prefill 4096@0 --decode 32768 \
      --multi-decode 5@32768 --decode-steps 16 --virtual-stages 1,6 --link-gbps 3.15,2.12,1.07,1.07,1.6 \
      --record
    bash "$0" verify8 ;;
  verify8)  # k = 8 verify at depth (split from ``owed`` so each call fits 10 minutes)
    bench verify8 240 verify $Q4X --ctx 262144 --slots 1 --int8 --depths 131072,250000 \
      --drafts 8 --steps 8 --forced "" --record ;;
  next)  # what the 2026-12-06 05:20 session left unrun (carry .whl and the tiny qwen4exp,
    # qwen3): the up-front decode graphs on the decode kernels, the QSA prompt path with its torch
    # ops toggled back, the PLE rows packed (qwen4exp models), hc_gate_mix bitwise the torch ops
    # (then turn HCCuda.prompt_gate_kernel on), F16Rows under the hgemm tests; ``next2``: the
    # virtual stages' overhead with the rounds' order rotated, the QSA kernels on and off, the
    # prompt chunk's gaps with the PLE rows packed
    timeout 330 python3 -m pytest -q --tb=short -p no:cacheprovider -rfEs -m gpu \
      tests/cuda/test_device_lanes.py tests/cuda/test_qsa.py tests/cuda/test_qsa_visibility.py \
      tests/cuda/test_device_models.py tests/cuda/test_batch_invariance.py tests/cuda/test_hc.py \
      -k "upfront or lanes or qsa or visibility or qwen4exp or qwen3 or prompt_gate or prompt_chunks" \
      > "$OUT/t_next.log" 2>&1
    echo "== next tests rc=$?"; grep -E "^(FAILED|ERROR|SKIPPED|E )|passed|failed" "$OUT/t_next.log" | head -30
    timeout 200 python3 -m pytest -q -s --tb=short -p no:cacheprovider -rfE tests/cuda/test_qgemm.py \
      -k "hgemm_bitwise or hgemm_matches or hgemm_direct" > "$OUT/t_hgemm.log" 2>&1
    echo "== hgemm tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/t_hgemm.log" ;;
  next2)  # side by side in rounds: the pipeline machinery, the QSA prompt kernels
    bench paired 300 model $Q4X --ctx 65536 --slots 5 --int8 --prefill 4096@0,16384@0 \
      --decode 0,32768 --multi-decode 5@32768 --decode-steps 32 --virtual-stages 1,2,3,6 \
      --paired 5 --record
    bench qsa_toggle 240 model $Q4X --ctx 163840 --slots 1 --int8 --prefill 4096@0,4096@131072 \
      --decode= --multi-decode= --toggle qsa.prefill_kernels --paired 5 --record
    bench gaps 150 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 --prefill-repeat 3 \
      --decode 0 --decode-steps 8 --multi-decode= --gaps --record ;;
  gate)  # hc_gate_mix (the prompt mix's gated mean in one kernel) on and off in rounds, then the
    # prompt chunk's idle gaps put down to Python frames (what the host does while the GPU waits)
    bench gate_toggle 200 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0,16384@0 \
      --decode= --multi-decode= --toggle hc.prompt_gate_kernel --paired 5 --record
    bench gaps_frame 200 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 --prefill-repeat 3 \
      --decode= --multi-decode= --gaps --gaps-by frame --record ;;
  hostgaps)  # the prompt chunk's long gaps broken down by the host calls running through them
    bench gaps_frame 200 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 --prefill-repeat 3 \
      --decode= --multi-decode= --gaps --gaps-by frame ;;
  gcfreeze)  # the bench's heap frozen after warm-up as the server's is (api/app.py): on and off
    # in rounds, the prompt chunk's gaps by host call with it on, then mixed load with the lane
    bench gc_toggle 200 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0,16384@0 \
      --decode 0 --multi-decode= --decode-steps 32 --toggle gc.freeze --paired 5 --record
    bench gaps_frame 150 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 \
      --decode= --multi-decode= --gaps --gaps-by frame --record
    bench mixed 240 mixed $Q4X --int8 --ctx 163840 --slots 3 --depth 131072 --prompt 32768 \
      --ubatch 4096 --itl-target-ms= --time-limit 40 --prefill-lane --lane-sms 108 --decode-steps 32 \
      --record ;;
  pleq)  # a Q4_K_M file's PLE table is Q5_0: its prompt rows packed (decoded on the GPU) or
    # dequantized on the host, in rounds; then the prompt chunk's gaps
    timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_ple.py 2>&1 | tail -2
    bench ple_toggle 200 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0,16384@0 \
      --decode= --multi-decode= --toggle ple.packed_rows --paired 5 --record
    bench gaps 150 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 --prefill-repeat 3 \
      --decode 0 --decode-steps 32 --multi-decode= --gaps --record ;;
  moetiles)  # the MoE prompt kernels' tilings side by side: each W tile decoded per CTA
    # amortised over more rows (bm 128, 256) against the default (bm 64)
    timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_ple.py 2>&1 | tail -1
    bench moe_tiles 330 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 --decode= \
      --multi-decode= --paired 5 --moe-tiles 64,128,32,2,4,2/128,128,32,2,4,2/256,128,16,4,2,1 \
      --record ;;
  moe128)  # the MoE prompt kernels on 128-row tiles: their tests, the models' invariance and
    # logits (carry .whl, .tiny/qwen4exp.gguf, .tiny/qwen3.gguf), then qwen3next's tiles side by side
    timeout 240 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -m gpu tests/core/test_ple.py \
      tests/cuda/test_qgemm.py tests/cuda/test_batch_invariance.py tests/cuda/test_device_models.py \
      -k "ple or grouped or qgemm or qwen4exp" > "$OUT/t_moe128.log" 2>&1
    echo "== moe128 tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_moe128.log" | head -20
    bench q3n_tiles 200 model --shape qwen3next-80b-a3b --layers 48 --ctx 65536 --slots 1 --int8 \
      --prefill 4096@0 --decode= --multi-decode= --paired 5 \
      --moe-tiles 128,128,32,2,4,2/64,128,32,2,4,2 --record ;;
  moetiles2)  # more MoE tilings around the default (128 x 128, 2 x 4 warps, 2 CTAs an SM): warps
    # 4 x 2, 64 columns, one CTA an SM (159 registers instead of the cap's 128), 192 and 160 rows
    # (~160 rows an expert in one tile); first their bits against the default's
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/cuda/test_qgemm.py \
      -k tilings_are_bitwise > "$OUT/t_tilings.log" 2>&1
    echo "== tilings test rc=$?"; grep -E "^(FAILED|E )|passed|failed" "$OUT/t_tilings.log" | head
    bench moe_tiles2 420 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 --decode= \
      --multi-decode= --paired 5 --record --moe-tiles \
      128,128,32,2,4,2/128,128,32,4,2,2/128,64,32,4,2,2/128,128,32,2,4,1/192,96,16,3,2,1/160,160,16,5,2,1 ;;
  mixedub)  # issue 12: the lane's chunk size against the decoders' p99 (a 4096-token chunk's
    # DeltaNet scan holds its SMs ~1.5 ms a layer): first the scan's pieces bitwise, then the
    # lane as it is, its scan in pieces of 1024 (the same bits), chunks of 2048 and of 1024
    timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/cuda/test_deltanet_prefill_kernel.py -k pieces > "$OUT/t_pieces.log" 2>&1
    echo "== pieces test rc=$?"; tail -2 "$OUT/t_pieces.log"
    for run in "4096" "4096 --set=deltanet.prefill_piece=1024" "2048" "1024"; do
      set -- $run
      bench "mixed_ub$1${2:+_piece1024}" 130 mixed $Q4X --int8 --ctx 163840 --slots 3 \
        --depth 131072 --prompt 32768 --ubatch "$@" --itl-target-ms= --time-limit 30 \
        --prefill-lane --decode-steps 32 --record
    done ;;
  next3)  # what 2026-12-06 07:56 wrote after its last GPU call: the DeltaNet scan's pieces and
    # the MoE tilings bitwise, then --gaps with its new tables (rates against floors by op family,
    # decode steps as served)
    timeout 200 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_deltanet_prefill_kernel.py tests/cuda/test_qgemm.py \
      -k "pieces or tilings_are_bitwise" > "$OUT/t_next3.log" 2>&1
    echo "== next3 tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_next3.log" | head -20
    bench gaps3 200 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 --prefill-repeat 3 \
      --decode 0 --decode-steps 32 --multi-decode= --gaps --record ;;
  branches)  # a decode step's independent chains side by side (ops/branch.py): their tests
    # (fork and join, the same bits eager and from graphs), then decode on and off in rounds,
    # and batch invariance with them on (carry .tiny/qwen4exp.gguf)
    timeout 200 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_branch.py > "$OUT/t_branch.log" 2>&1
    echo "== branch tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_branch.log" | head -20
    bench branch_toggle 300 model $Q4X --ctx 262144 --slots 5 --int8 --prefill= \
      --decode 0,131072 --multi-decode 5@32768 --decode-steps 16 --paired 5 \
      --toggle branch.decode --record
    bench invariance 150 invariance $Q4X --int8 --record ;;
  hctime)  # the hyper-connection mix's GPU time per mix (graph-replayed, weights beyond L2) at
    # 1..16 tokens, and under other tunings (MGSERVE_HC_SWEEP)
    timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/cuda/test_hc.py \
      -k "once_per_cta or batch_invariant or combine_mix_is or graph_capture" > "$OUT/t_hc.log" 2>&1
    echo "== hc tests rc=$?"; grep -E "^(FAILED|E )|passed|failed" "$OUT/t_hc.log" | head
    MGSERVE_HC_SWEEP=1 timeout 400 python3 -m pytest -q -s -p no:cacheprovider -m gpu \
      tests/cuda/test_hc.py -k "timing and types1" > "$OUT/t_hctime.log" 2>&1
    echo "== hctime rc=$?"; grep -E "hc_mix|HCTuning|passed|failed" "$OUT/t_hctime.log" | head -60 ;;
  hcstep)  # the HC kernels' new defaults (norm scales once per CTA, 8 warps of 2 columns in
    # hc_up) in whole decode steps, their tests, invariance
    timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/cuda/test_hc.py \
      -k "once_per_cta or batch_invariant or combine_mix_is or graph_capture or real_shape" \
      > "$OUT/t_hc.log" 2>&1
    echo "== hc tests rc=$?"; grep -E "^(FAILED|E )|passed|failed" "$OUT/t_hc.log" | head
    bench hcstep 240 model $Q4X --ctx 262144 --slots 5 --int8 --prefill 4096@0 \
      --decode 0,131072 --multi-decode 5@32768 --decode-steps 16 --record
    bench invariance 150 invariance $Q4X --int8 --record ;;
  final)  # 2026-12-06 11:50: the branch tests after the review, add_shared in parts, decode
    # rows with their graph's time alone (and so the time outside it)
    timeout 120 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_branch.py tests/cuda/test_glue.py \
      -k "graph_decode or fork or hc_inject or add_shared or own" > "$OUT/t_final.log" 2>&1
    echo "== final tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_final.log" | head
    timeout 120 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -m gpu -x \
      tests/cuda/test_device_drafts.py tests/cuda/test_device_lanes.py \
      tests/cuda/test_device_runner.py > "$OUT/t_forks.log" 2>&1
    echo "== forked paths rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_forks.log" | head
    bench shared_parts 200 model $Q4X --ctx 262144 --slots 5 --int8 --prefill= --decode 0 \
      --multi-decode 5@32768 --decode-steps 16 --paired 5 --toggle moe.shared_parts --record
    bench hostshare 200 model $Q4X --ctx 262144 --slots 5 --int8 --prefill= --decode 0,131072 \
      --multi-decode 5@32768,5@131072 --decode-steps 16 --record ;;
  cluster)  # 2026-12-06 13:50: the decode mix on thread block clusters (hc_downc + hc_upl,
    # HCCuda.cluster): its tests and test_hc's (hc_up's LOW template), the mix's time per mix on
    # and off side by side, decode on and off in rounds, invariance with it on
    timeout 240 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_hc_cluster.py ${CLUSTER_TESTS-tests/cuda/test_hc.py} -k "not timing" \
      > "$OUT/t_cluster.log" 2>&1
    echo "== cluster tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_cluster.log" | head -20
    if [ -z "$CLUSTER_NO_HCTIME" ]; then
      MGSERVE_HC_SWEEP=$HC_SWEEP timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu \
        tests/cuda/test_hc.py -k "timing and types1" > "$OUT/t_hctime.log" 2>&1
      echo "== hctime rc=$?"; grep -E "hc_mix|HCTuning|passed|failed" "$OUT/t_hctime.log" | head -30
    fi
    bench cluster_toggle 280 model $Q4X --ctx 262144 --slots 5 --int8 --prefill= \
      --decode 0,131072 --multi-decode 5@32768 --decode-steps 16 --paired 5 --toggle hc.cluster \
      --record
    if [ -n "$CLUSTER_INVARIANCE" ]; then
      bench invariance_cluster 150 invariance $Q4X --int8 --set hc.cluster=true --record
    fi ;;
  next4)  # what 2026-12-06 13:43 left unrun on a GPU with hc.cluster on by default (carry .whl,
    # .tiny/qwen4exp.gguf, .tiny/qwen3.gguf): the whole-model tests on the tiny qwen4exp (logits
    # against transformers, the fused decode launches, batch invariance), then the table's rows
    # and the int8 readers' decode moved out of the token loop (gguf_blocks_q8.cuh: the same
    # bits by construction, host-checked in CI; their GPU tests and the 8-token matvec times)
    timeout 200 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_linear_matvec_q8.py tests/cuda/test_linear_matvec_q8mma.py \
      tests/cuda/test_moe.py > "$OUT/t_q8.log" 2>&1
    echo "== q8 tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_q8.log" | head -20
    timeout 300 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_device_models.py tests/cuda/test_fused_decode.py \
      tests/cuda/test_batch_invariance.py tests/cuda/test_branch.py -k "qwen4exp or branch or fork" \
      > "$OUT/t_next4.log" 2>&1
    echo "== next4 tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_next4.log" | head -20
    bench matvec_q8 120 matvec --shapes qwen4exp-proj --types Q4_K,Q6_K,Q5_0 --tokens 1,4,8 \
      --activations int8-pre --q8-mma off --record
    bench quick 280 model $Q4X --ctx 262144 --slots 5 --int8 --prefill 4096@0 \
      --decode 0,32768,250000 --multi-decode 5@32768,5@131072 --decode-steps 16 --record ;;
  wgmma)  # issue 10: hgemm_wgmma.cu (HGemm.wgmma, sm_90a) against hgemm.cu: its tests (bitwise
    # equal first), the GEMM's time per tuning at qwen4exp's shapes (a print), then prefill on and
    # off in rounds and invariance with it on (carry .whl)
    timeout 300 python3 -m pytest -q -s --tb=line -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_hgemm_wgmma.py tests/cuda/test_qgemm_wgmma.py > "$OUT/t_wgmma.log" 2>&1
    echo "== wgmma tests rc=$?"
    grep -E "^(FAILED|ERROR|E )|passed|failed|M=4096|  wgmma|grouped moe" "$OUT/t_wgmma.log" \
      | head -60
    bench wgmma_toggle 150 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0,4096@32768 \
      --decode= --multi-decode= --paired 3 --toggle linear.hgemm.wgmma --record
    bench qwgmma_toggle 150 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0,4096@32768 \
      --decode= --multi-decode= --paired 3 --toggle linear.qgemm.wgmma \
      --set linear.hgemm.wgmma=true --record
    bench invariance_wgmma 120 invariance $Q4X --int8 --set linear.hgemm.wgmma=true \
      --set linear.qgemm.wgmma=true --record ;;
  wgmma2)  # wgmma on by default (hgemm and qgemm): the GEMM tests that now run it beside the
    # mma.sync kernels (tilings, invariance, MoE), then the table's prefill rows with profiles
    timeout 180 python3 -m pytest -q --tb=line -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_qgemm.py tests/cuda/test_moe_prefill.py -k "not timing" \
      > "$OUT/t_wgmma2.log" 2>&1
    echo "== wgmma2 tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_wgmma2.log" | head
    bench prefill_table 200 model $Q4X --ctx 262144 --slots 5 --int8 --prefill 4096@0,4096@32768 \
      --sampled-prefill 1@250000,5@131072 --decode 0 --multi-decode= --decode-steps 16 \
      --profile --record ;;
  next5)  # what 2026-12-06 16:35 left unrun on a GPU after its review (carry .whl and the tiny
    # qwen4exp / qwen3): the wgmma tests with the added tunings (hgemm stages 3 and 8, grouped
    # tunings compared bitwise), the warm-up's short last chunk, the GEMM tests beside them;
    # then qwen3next's rows (not run since the wgmma GEMMs; exact mode: the `exact` stage)
    timeout 300 python3 -m pytest -q -s --tb=line -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_hgemm_wgmma.py tests/cuda/test_qgemm_wgmma.py tests/cuda/test_warmup.py \
      tests/cuda/test_qgemm.py -k "not test_dense_gemm_timing" > "$OUT/t_next5.log" 2>&1
    echo "== next5 tests rc=$?"
    grep -E "^(FAILED|ERROR|E )|passed|failed|grouped moe|M=4096|  wgmma" "$OUT/t_next5.log" | head -40
    bench qwen3next_wg 200 model --shape qwen3next-80b-a3b --layers 48 --ctx 262144 --slots 5 \
      --int8 --prefill 4096@0,4096@32768 --decode 0,131072 --multi-decode 5@32768 \
      --decode-steps 16 --record ;;
  matvec)  # issue 10: the int8 matvec's shapes (rows per thread group for 1 / 2..8 tokens,
    # threads per group) at the qwen4exp layer's own projections, 1 and 8 tokens: the decode
    # projections run at ~1.2 TB/s (--gaps, 2026-12-06), the 8-token ones at ~half that
    bench matvec_proj 500 matvec --shapes qwen4exp-proj --types Q4_K,Q6_K,Q5_0,Q8_0 \
      --tokens 1,8 --activations int8-pre --q8-mma off \
      --q8-rows "2,2,128 1,2,128 4,2,128 2,4,128 2,1,128 2,2,32" \
      --record ;;
  ncu)  # hardware counters (Nsight Compute; Firecracker machines read them, gVisor ones do
    # not: the first lines say which) of the heaviest kernels, each at its first launch (layer 0
    # is DeltaNet; the first combine is layer 1's): the prompt chunk's DeltaNet scan, MoE GEMMs
    # and HC combine; the decode step's HC
    # projections, Q4_K matvec and MoE gate/up; the dense prompt GEMM. Speed of light, warp
    # stalls, memory and compute workload, occupancy: what bounds each (METHOD.md: clocks left)
    ncu_kernels "prompt:^(delta_scan_f32|qgemm_gate_up|qgemm_down|hc_combine)$:4" \
      "decode:^(hc_down_Q4_K_t1|hc_up_Q5_0_t1|matvec_q8_Q4_K_t1|moe_q8_gate_up_Q4_K)$:4" \
      "hgemm:^hgemm$:2" ;;
  ncu2)  # 2026-12-06 23:00: the same counters for the kernels that now take the time: the wgmma
    # prompt GEMMs (MoE gate/up and down, dense), the clustered HC mix and the fused router
    ncu_kernels "prompt:^(qgemm_gate_up_wg|qgemm_down_wg|hgemm_wg)$:6" \
      "decode:^(hc_downc_Q4_K_t1|hc_upl_Q5_0_t1|matvec_route_F32_t1|moe_q8_down_Q5_0)$:4" ;;
  s17)  # 2026-12-06 23:30: what that session could not run (no GPU came): the decode graphs'
    # packed inputs (reverted on main: first `git checkout 4147446 -- mgserve/cuda/graphs.py`),
    # the stacked HC inject (off: its test sets it), last_cta; invariance, the served step's host
    # profile, the stacked inject on / off
    timeout 200 python3 -m pytest -q --tb=line -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_hc.py tests/cuda/test_device_runner.py tests/cuda/test_branch.py \
      tests/cuda/test_device_lanes.py tests/cuda/test_fused_router.py \
      tests/cuda/test_qgemm_wgmma.py \
      -k "stacks or prompt or graph or runner or decode or round or router or grouped_moe" \
      > "$OUT/t_s17.log" 2>&1
    echo "== s17 tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_s17.log" | head
    bench invariance 150 invariance $Q4X --int8 --record
    bench host 120 model $Q4X --ctx 65536 --slots 5 --int8 --prefill= --decode 0 \
      --multi-decode 5@32768 --decode-steps 32 --host-profile --record
    bench stack 150 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 --decode= \
      --multi-decode= --paired 3 --toggle hc.stack_inject --record ;;
  s17min)  # s17's tests, the host profile and invariance alone (s17's comment: re-apply first)
    timeout 170 python3 -m pytest -q --tb=line -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_hc.py tests/cuda/test_device_runner.py tests/cuda/test_branch.py \
      tests/cuda/test_fused_router.py -k "stacks or graph or runner or round or router" \
      > "$OUT/t_s17.log" 2>&1
    echo "== s17 tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_s17.log" | head
    bench host 100 model $Q4X --ctx 65536 --slots 5 --int8 --prefill= --decode 0 \
      --multi-decode 5@32768 --decode-steps 32 --host-profile --record
    bench invariance 120 invariance $Q4X --int8 --record ;;
  s18)  # 2026-12-07: delta_scan_tc (deltanet.scan_tc), then s17min's tests and host profile
    timeout 150 python3 -m pytest -q -s --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_deltanet_prefill_kernel.py -k "scan_tc or pieces or speed or qwen4exp" \
      > "$OUT/t_s18.log" 2>&1
    echo "== s18 tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed|deltanet prefill" "$OUT/t_s18.log" | head -30
    bench scantc 170 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 --decode= \
      --multi-decode= --paired 3 --toggle deltanet.scan_tc --record
    timeout 150 python3 -m pytest -q --tb=line -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_hc.py tests/cuda/test_device_runner.py tests/cuda/test_branch.py \
      tests/cuda/test_fused_router.py -k "stacks or graph or runner or round or router" \
      > "$OUT/t_s17.log" 2>&1
    echo "== s17 tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_s17.log" | head
    bench host 100 model $Q4X --ctx 65536 --slots 5 --int8 --prefill= --decode 0 \
      --multi-decode 5@32768 --decode-steps 32 --host-profile --record ;;
  s18b|s18c|s18d)  # 2026-12-07: the scan on tensor cores (tests, prompt), the wgmma MoE tiles
    # on three buffers (prompt, then tests). Less device time: s18c 2 rounds and no wgmma tests,
    # s18d the scan alone
    R=3; [ "$1" = s18b ] || R=2
    K="scan_tc or pieces"; [ "$1" = s18d ] || K="$K or speed"; [ "$1" = s18b ] && K="$K or qwen4exp"
    timeout 120 python3 -m pytest -q -s --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_deltanet_prefill_kernel.py -k "$K" > "$OUT/t_s18.log" 2>&1
    echo "== s18 tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed|deltanet prefill" "$OUT/t_s18.log" | head -30
    bench scantc 150 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 --decode= \
      --multi-decode= --paired $R --toggle deltanet.scan_tc --record
    if [ "$1" != s18d ]; then
      bench stages 200 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 --decode= \
        --multi-decode= --paired $R --moe-tiles wg:128,128,2/wg:128,128,2,3/wg:256,128,1,3 --record
    fi
    if [ "$1" = s18b ]; then
      timeout 100 python3 -m pytest -q --tb=line -p no:cacheprovider -rfE -m gpu \
        tests/cuda/test_qgemm_wgmma.py > "$OUT/t_s19.log" 2>&1
      echo "== s19 wgmma tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_s19.log" | head
    fi ;;
  s19)  # 2026-12-07: the wgmma MoE tiles on three buffers (tests, prompt), the stacked HC inject
    # on / off
    timeout 150 python3 -m pytest -q --tb=line -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_qgemm_wgmma.py > "$OUT/t_s19.log" 2>&1
    echo "== s19 wgmma tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_s19.log" | head
    bench stages 200 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 --decode= \
      --multi-decode= --paired 3 --moe-tiles wg:128,128,2/wg:128,128,2,3/wg:256,128,1,3 --record
    bench stack 150 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 --decode= \
      --multi-decode= --paired 3 --toggle hc.stack_inject --record ;;
  s20)  # 2026-12-07: invariance (the graphs' packed inputs), ncu2's prompt GEMMs beside the scan
    # on tensor cores (the default on sm_90 since 2026-12-07)
    bench invariance 150 invariance $Q4X --int8 --record
    ncu_kernels \
      "prompt:^(qgemm_gate_up_wg|qgemm_down_wg|hgemm_wg|delta_scan_tc)$:8" ;;
  s21|s21min|s21t)  # 2026-12-07 (run at 05:30-05:36): W's values by byte permutes (gguf_split.cuh
    # SPLIT_DECODE 2, the default) and load_w's addressing: their tests (gguf-py bitwise, the
    # float64 reference, the shifts-and-masks decode bitwise), the MoE prompt GEMMs on each decode
    # and other tilings side by side; s21 then the scan on tensor cores (tests, on and off). Less
    # device time: s21min fewer tests and tilings, s21t the least
    K="split_readers or (dense_matches and Q4_K)"; TILES=wg:128,128,2/wg:128,128,2,2,1; T=90
    if [ "$1" != s21t ]; then
      K="split_readers or hgemm_direct or (dense_matches and (Q4_K or BF16)) or (grouped_moe and Q6_K)"
      TILES=$TILES/wg:256,128,1; T=120
    fi
    [ "$1" = s21 ] && K="$K or (dense_matches and Q5_0)" TILES=$TILES/wg:128,128,2,3/wg:256,128,1,3 T=150
    timeout $T python3 -m pytest -q --tb=line -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_qgemm.py tests/cuda/test_qgemm_wgmma.py -k "$K" > "$OUT/t_s21.log" 2>&1
    echo "== s21 decode tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_s21.log" | head
    bench decode $((T + 80)) model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 --decode= \
      --multi-decode= --paired 2 --moe-tiles $TILES --record
    if [ "$1" = s21 ]; then
      cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
      timeout 70 python3 -m pytest -q -s --tb=short -p no:cacheprovider -rfE -m gpu \
        tests/cuda/test_deltanet_prefill_kernel.py -k "scan_tc" > "$OUT/t_s18.log" 2>&1
      echo "== s18 tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_s18.log" | head
      bench scantc 120 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 --decode= \
        --multi-decode= --paired 2 --toggle deltanet.scan_tc --record
    fi ;;
  s22)  # 2026-12-07 07:10: the clustered HC tests the 05:30 call did not reach (the decode mix's
    # readers changed with gguf_split.cuh), then s20's Nsight counters without its invariance
    timeout 200 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_hc_cluster.py > "$OUT/t_s22.log" 2>&1
    echo "== s22 hc_cluster tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_s22.log" | head
    ncu_kernels "prompt:^(qgemm_gate_up_wg|qgemm_down_wg|hgemm_wg|delta_scan_tc)$:8" ;;
  s24)  # 2026-12-07 08:50: route.lean (the fused router on a row a warp with every run's loads
    # in flight, its top k by warp reductions; the same results): its tests, then decode with
    # it off and on from graphs side by side (the served profile put the router at 0.49 ms of
    # a one-session step and 1.34 ms of five sessions')
    timeout 200 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_fused_router.py tests/cuda/test_route.py > "$OUT/t_s24.log" 2>&1
    echo "== s24 router tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_s24.log" | head
    bench lean 250 model $Q4X --ctx 65536 --slots 5 --int8 --prefill= --decode 0,32768 \
      --multi-decode 5@32768 --decode-steps 16 --paired 3 --toggle route.lean --record ;;
  s25)  # 2026-12-07 08:00: s24, and a decode step's QSA selections on thread block clusters
    # (qsa_select_c, qsa.cluster: a row's tiles over 8 CTAs, the same output; the served
    # profile put qsa_select at 0.40 ms of a step at 250000): tests, then decode side by side
    timeout 230 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_fused_router.py tests/cuda/test_route.py tests/cuda/test_qsa_select.py \
      tests/cuda/test_qsa.py tests/cuda/test_qsa_needle.py > "$OUT/t_s25.log" 2>&1
    echo "== s25 tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_s25.log" | head
    grep -E "QSA selection" "$OUT/t_s25.log" | head -12
    bench qsacl 170 model $Q4X --ctx 262144 --slots 1 --int8 --prefill= --decode 32768,250000 \
      --multi-decode= --decode-steps 16 --paired 3 --toggle qsa.cluster --record
    cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
    bench lean 170 model $Q4X --ctx 65536 --slots 5 --int8 --prefill= --decode 0 \
      --multi-decode 5@32768 --decode-steps 16 --paired 3 --toggle route.lean --record ;;
  s27)  # 2026-12-07 11:10: hc.stage_hoist (the HC down kernels stage 4 tokens from loads issued
    # together; the sums of squares' FMAs named, since NVRTC contracted them by the code around):
    # the HC tests, invariance with it on, decode off / on (route.gate_hoist, the fused router's
    # gates CTA loading every token first, was even at 10:32 and is gone, as are the former stage
    # s26's linear.q8.hoist, -6.7%, and route.hoist, even, at 10:20)
    timeout 300 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_hc.py tests/cuda/test_hc_cluster.py > "$OUT/t_s27.log" 2>&1
    echo "== s27 tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_s27.log" | head
    bench invariance 120 invariance $Q4X --int8 --set hc.stage_hoist=true --record
    cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
    bench stage_hoist 240 model $Q4X --ctx 262144 --slots 5 --int8 --prefill= --decode 250000 \
      --multi-decode 5@32768 --decode-steps 32 --paired 5 --toggle hc.stage_hoist --record ;;
  s28)  # hc.stage_hoist on by default (hc_upl's copy of low too): the HC tests, invariance,
    # five sessions with it off / on, the decode rows
    timeout 300 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_hc.py tests/cuda/test_hc_cluster.py > "$OUT/t_s28.log" 2>&1
    echo "== s28 tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_s28.log" | head
    bench invariance 120 invariance $Q4X --int8 --record
    cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
    bench stage_hoist 150 model $Q4X --ctx 65536 --slots 5 --int8 --prefill= --decode= \
      --multi-decode 5@32768 --decode-steps 32 --paired 5 --toggle hc.stage_hoist --record
    cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
    bench decode 240 model $Q4X --ctx 262144 --slots 5 --int8 --prefill= \
      --decode 0,32768,131072,250000 --multi-decode 5@32768,5@131072 --decode-steps 16 --record ;;
  ncu5)  # 2026-12-07 11:20: five sessions' eager decode step: why its t8 kernels and its router
    # cost 2-3x their one-token twins (route.gate_hoist, even, ruled out the gates CTA)
    NCU_W="$Q4X --ctx 8192 --slots 5 --int8 --prefill= --decode= --multi-decode 5@4096 \
      --decode-steps 1 --no-graphs" ncu_kernels \
      "five:^(matvec_route_F32_t8|hc_downc_Q4_K_t8|hc_upl_Q5_0_t8|matvec_q8_Q4_K_t8)$:12" ;;
  s34)  # 2026-12-07 17:30: the fenced tickets (one fence after the barrier) under the router's
    # tests, then ncu1, then the defaults unprofiled (one session's time outside the graph)
    timeout 230 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -m gpu \
      -k "plain or split1 or refuses or tunings or mix or invariant" tests/cuda/test_fused_router.py \
      tests/cuda/test_linear_matvec.py tests/cuda/test_hc.py > "$OUT/t_s34.log" 2>&1
    echo "== s34 tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_s34.log" | head
    bash "$0" ncu1
    bench defaults 120 model $Q4X --ctx 65536 --slots 5 --int8 --prefill= --decode 0 \
      --multi-decode 5@32768 --decode-steps 32 --record
    cp BENCHMARKS.md "$OUT/BENCHMARKS.md" ;;
  s36)  # 2026-12-07 20:50: s34's tests (the fenced tickets, router grid, float tuning, HC
    # mixes); the three prompt fusions' tests (f16_rows.py: the producers' f16 copies, the casts
    # were 532 launches, 21 ms of a 4096-token chunk; the combine + norm pass; the up GEMM +
    # gated mean) and hc.stack_inject's; then the fusions toggled together and the copies alone
    timeout 220 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_f16_offers.py tests/cuda/test_hc.py \
      tests/cuda/test_fused_router.py tests/cuda/test_linear_matvec.py \
      -k "(f16 or conversion or copies or combine or up_gate or up_and or stacks_inject or plain or split1 or refuses or tunings or mix or invariant) and not qwen3next" \
      > "$OUT/t_s36.log" 2>&1
    echo "== s36 tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_s36.log" | head -20
    # all three prompt fusions together, then each against the other two on
    bench fusions_toggle 200 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0,4096@32768 \
      --decode= --multi-decode= --paired 3 \
      --toggle linear.x16.offers+hc.prompt_combine_norm+hc.prompt_up_gate --record
    cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
    bench f16_toggle 100 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 \
      --decode= --multi-decode= --paired 3 --toggle linear.x16.offers \
      --set hc.prompt_combine_norm=true --set hc.prompt_up_gate=true --record
    cp BENCHMARKS.md "$OUT/BENCHMARKS.md" ;;
  s36a)  # 2026-12-07 21:55: s36 in a short call: the fusions' and last session's tests, then the
    # three prompt fusions toggled together on one chunk size
    timeout 200 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_f16_offers.py tests/cuda/test_hc.py tests/cuda/test_fused_router.py \
      -k "(f16 or conversion or copies or combine or up_gate or stacks_inject or plain or split1 or refuses or mix) and not qwen3next" \
      > "$OUT/t_s36a.log" 2>&1
    echo "== s36a tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_s36a.log" | head -20
    bench fusions_toggle 170 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 \
      --decode= --multi-decode= --paired 3 \
      --toggle linear.x16.offers+hc.prompt_combine_norm+hc.prompt_up_gate --record
    cp BENCHMARKS.md "$OUT/BENCHMARKS.md" ;;
  s37)  # 2026-12-07 20:50: each prompt fusion against the other two on, hc.stack_inject, and
    # qsa.score_group (its test first) on a chunk
    timeout 90 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_qsa.py -k "test_qsa_prefill" > "$OUT/t_s37.log" 2>&1
    echo "== s37 tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_s37.log" | head
    bench up_gate_toggle 150 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 \
      --decode= --multi-decode= --paired 3 --toggle hc.prompt_up_gate \
      --set linear.x16.offers=true --set hc.prompt_combine_norm=true --record
    bench combine_toggle 110 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 \
      --decode= --multi-decode= --paired 3 --toggle hc.prompt_combine_norm \
      --set linear.x16.offers=true --set hc.prompt_up_gate=true --record
    bench stack_toggle 150 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 \
      --decode= --multi-decode= --paired 3 --toggle hc.stack_inject --record
    bench group_toggle 150 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0,4096@32768 \
      --decode= --multi-decode= --paired 3 --toggle qsa.score_group=64/256 --record
    cp BENCHMARKS.md "$OUT/BENCHMARKS.md" ;;
  s38)  # 2026-12-07 20:50: the plan's workspace against the allocator's peak (F16Rows keeps two
    # entries now), the defaults unprofiled (one session's time outside the graph: 1.24 ms at
    # 17:12 against 0.23-0.54 before), then ncu2 (the prompt GEMMs)
    timeout 150 python3 -m pytest -q --tb=short -p no:cacheprovider -rfEs -s -m gpu \
      tests/cuda/test_plan.py -k "gpu_plan and qwen4exp" > "$OUT/t_s38.log" 2>&1
    echo "== s38 tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed|workspace peak" \
      "$OUT/t_s38.log" | head
    bench defaults 150 model $Q4X --ctx 65536 --slots 5 --int8 --prefill 4096@0 --decode 0 \
      --multi-decode 5@32768 --decode-steps 32 --record
    cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
    bash "$0" ncu3 ;;
  s39)  # 2026-12-07 22:55: the GPU tests 21:45 did not run (the float matvec's tunings, the
    # fused up GEMM's Q8_0 case, qsa.score_group 256, the plan's workspace: its load check now
    # asserted last), qsa.score_group 64 / 256 side by side at depth, the defaults unprofiled
    # (one session's time outside the graph) and one session's host profile
    timeout 200 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -s -m gpu \
      tests/cuda/test_linear_matvec.py tests/cuda/test_qsa.py tests/cuda/test_plan.py \
      "tests/cuda/test_f16_offers.py::test_prompt_up_gate_keeps_its_bits" \
      -k "(tunings or qsa_prefill or up_gate or gpu_plan) and not qwen3next" > "$OUT/t_s39.log" 2>&1
    echo "== s39 tests rc=$?"
    grep -E "^(FAILED|ERROR|E )|passed|failed|workspace peak|loaded" "$OUT/t_s39.log" | head -20
    bench group_toggle 120 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@32768 \
      --decode= --multi-decode= --paired 3 --toggle qsa.score_group=64/256 --record
    cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
    bench defaults 120 model $Q4X --ctx 65536 --slots 5 --int8 --prefill= --decode 0 \
      --multi-decode 5@32768 --decode-steps 32 --record
    cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
    bench host1 100 model $Q4X --ctx 65536 --slots 1 --int8 --prefill= --decode 0 \
      --multi-decode= --decode-steps 32 --host-profile --record ;;
  s40)  # 2026-12-07 23:20: Nsight on what bounds the two largest parts left: a prompt chunk's
    # MoE GEMMs and hgemm_wg (ncu3), one session's t1 decode kernels (ncu1: the router at 9.6 us
    # a launch for 2.6 MB)
    bash "$0" ncu3
    bash "$0" ncu1 ;;
  s41)  # 2026-12-08 00:10: what 2026-12-07 22:52 left for a GPU: the MoE GEMMs' tests over every
    # tiling with the half row-step readers, and the readers written but not yet run
    # (test_untried_row_readers: Q6_K, Q5_K, Q5_1, and Q5_K / Q5_1 on wgmma at all; add them to
    # ROW_FORMATS / WGMMA_FORMATS where it passes), then the plan with the automatic
    # --batch-size fitted to the GPU's free memory and the table's prefill rows with the defaults
    timeout 300 python3 -m pytest -q -s --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_qgemm_wgmma.py \
      -k "(dense_matches and (Q4_K or Q5_0 or Q8_0)) or grouped_moe or untried or row_readers" \
      > "$OUT/t_s41.log" 2>&1
    echo "== s41 tests rc=$?"
    grep -E "^(FAILED|ERROR|E )|passed|failed|grouped, rows|grouped moe" "$OUT/t_s41.log" | head -30
    python3 -m mgserve info .tiny/qwen4exp.gguf --plan -c 65536 -np 5 2>&1 | grep -E "batch|free"
    bench prefill 200 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0,4096@32768 \
      --decode= --multi-decode= --prefill-repeat 3 --record ;;
  s42)  # 2026-12-08 (no GPU was lent that session): s41's tests (every reader, the untried ones
    # too: promote what passes), route.batch's tests, the automatic --batch-size, then
    # route.batch (a 2560-wide router row's loads in one batch: matvec.cuh's RUN_BATCH) on and
    # off side by side (the prefill rows: s44)
    timeout 300 python3 -m pytest -q -s --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_qgemm_wgmma.py tests/cuda/test_fused_router.py \
      -k "(dense_matches and (Q4_K or Q5_0 or Q8_0)) or grouped_moe or untried or row_readers \
          or (router and (batch or lean))" > "$OUT/t_s42.log" 2>&1
    echo "== s42 tests rc=$?"
    grep -E "^(FAILED|ERROR|E )|passed|failed|grouped, rows|grouped moe" "$OUT/t_s42.log" | head -30
    python3 -m mgserve info .tiny/qwen4exp.gguf --plan -c 65536 -np 5 2>&1 | grep -E "batch|free"
    bench batch 150 model $Q4X --ctx 65536 --slots 5 --int8 --prefill= --decode 0 \
      --multi-decode 5@32768 --paired 5 --set route.unroll=10 --toggle route.batch --record ;;
  s44)  # the prefill rows with the defaults (the row readers, 2026-12-07), then a prompt
    # chunk's GPU operations by the op family that launched them (--gaps: which family's torch
    # kernels are the 532 vectorized_elementwise launches, 21 ms of a 4096-token chunk at 17:12)
    bench prefill 150 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0,4096@32768 \
      --decode= --multi-decode= --prefill-repeat 3 --record
    bench gaps 200 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 --decode 0 \
      --multi-decode= --decode-steps 1 --gaps --record ;;
  s43)  # issue 12, room for the decoders beside the lane (2026-12-08): a decode kernel waits
    # for an SM the lane's blocks leave room on, and the MoE prompt GEMMs' 2 CTAs an SM take all
    # 65,536 registers (128 x 256 x 2; their __launch_bounds__ minimum does not change that:
    # 128 registers at min 1 too). linear.qgemm.room=51200 pads each CTA's shared memory to
    # 116.5 KB, so one fits an SM and leaves half the registers and ~110 KB. The lane on every SM
    # with it and the DeltaNet scan in pieces of 1024, against the same without it
    for room in 0 51200; do
      bench "mixed_room$room" 150 mixed $Q4X --int8 --ctx 163840 --slots 3 \
        --depth 131072 --prompt 32768 --ubatch 4096 --set=linear.qgemm.room=$room \
        --set=deltanet.prefill_piece=1024 --itl-target-ms= --time-limit 30 --prefill-lane \
        --decode-steps 32 --record
    done ;;
  rows)  # 2026-12-07 23:55 (on by default since 23:49's rows2): W tiles by half row-steps (QWgmmaTuning.rows, qgemm_rows.cuh:
    # Q4_K's step loop 298 SASS instructions a thread against 424, Q5_0's 320 against 398 with
    # 12 loads against 29; Nsight at 23:10: the decode is most of the MoE kernels' instructions,
    # issue slots 48% busy): bitwise the runs' reader (dense Q4_K / Q5_0 / Q8_0, the grouped
    # cases, qwen4exp's shapes with timings), then a prompt chunk side by side
    timeout 280 python3 -m pytest -q -s --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_qgemm_wgmma.py \
      -k "(dense_matches and (Q4_K or Q5_0 or Q8_0)) or grouped_moe or untried" \
      > "$OUT/t_rows.log" 2>&1
    echo "== rows tests rc=$?"
    grep -E "^(FAILED|ERROR|E )|passed|failed|grouped moe" "$OUT/t_rows.log" | head -30
    bench rows 200 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 --decode= \
      --multi-decode= --paired 3 --moe-tiles wg:128,128,2,2,2,0/wg:128,128,2 --record ;;
  rows2)  # 2026-12-07 23:45: rows in a short call: the readers at qwen4exp's shapes (bitwise,
    # timed), then a prompt chunk side by side (ran 23:49: +8.3%; the default since, so the
    # chunk now compares the runs' reader, ROWS 0, with it)
    timeout 150 python3 -m pytest -q -s --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_qgemm_wgmma.py -k "row_readers_at" > "$OUT/t_rows2.log" 2>&1
    echo "== rows2 tests rc=$?"
    grep -E "^(FAILED|ERROR|E )|passed|failed|grouped, rows" "$OUT/t_rows2.log" | head -20
    bench rows 130 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 --decode= \
      --multi-decode= --paired 3 --moe-tiles wg:128,128,2,2,2,0/wg:128,128,2 --record ;;
  chunks)  # 2026-12-07 23:10: the prompt chunk's size by measurement (the server's --batch-size
    # is 512 by default, the benches' --ubatch 4096): one 16384-token prompt cut five ways
    bench chunks 300 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 16384@0 --decode= \
      --multi-decode= --paired 3 --toggle ubatch=4096/512/1024/2048/8192 --record ;;
  s35)  # 2026-12-07 20:05: s34's tests, the defaults unprofiled, then ncu2 (the prompt GEMMs)
    timeout 230 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -m gpu \
      -k "plain or split1 or refuses or tunings or mix or invariant" tests/cuda/test_fused_router.py \
      tests/cuda/test_linear_matvec.py tests/cuda/test_hc.py > "$OUT/t_s35.log" 2>&1
    echo "== s35 tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_s35.log" | head
    bench defaults 150 model $Q4X --ctx 65536 --slots 5 --int8 --prefill 4096@0 --decode 0 \
      --multi-decode 5@32768 --decode-steps 32 --record
    cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
    bash "$0" ncu3 ;;
  ncu3)  # 2026-12-07 19:50: a 4096-token chunk's GEMMs: the MoE's grouped products (31% of the
    # chunk, ~181 TFLOP/s on gate/up counting only real rows) and the dense hgemm_wg: whether the
    # W decode's issue slots, the tensor cores or the barriers bound them
    SECTIONS_EXTRA="--section InstructionStats --section SchedulerStats" ncu_kernels \
      "moe:^(qgemm_gate_up_wg|qgemm_down_wg)$:4" "hg:^hgemm_wg$:4" ;;
  ncu1)  # 2026-12-07 17:30: one session's eager decode step: what bounds its t1 kernels (the
    # router 9.8 us a launch for 2.6 MB, hc_downc 6.8 us for 1.9 MB, hc_upl 7.3 us for 2.3 MB)
    NCU_W="$Q4X --ctx 8192 --slots 1 --int8 --prefill= --decode 0 --multi-decode= \
      --decode-steps 1 --no-graphs" ncu_kernels \
      "one:^(matvec_route_F32_t1|hc_downc_Q4_K_t1|hc_upl_Q5_0_t1|matvec_q8_Q4_K_t1|moe_q8_gate_up_Q4_K)$:14" ;;
  s29)  # 2026-12-07 12:20: route.tickets.acq_rel (tickets.cuh TICKET_ACQREL: the last-CTA
    # kernels take their ticket by one acq_rel atomic a CTA, CUTLASS's semaphore pattern, where
    # three __threadfence()s, MEMBAR.SC.GPU each, sat on the fused router's path; one session's
    # router is 10.5 us a launch for 2.6 MB): its tests, decode off / on, invariance with it on
    timeout 200 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_fused_router.py > "$OUT/t_s29.log" 2>&1
    echo "== s29 tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_s29.log" | head
    bench acq_rel 200 model $Q4X --ctx 65536 --slots 5 --int8 --prefill= --decode 0 \
      --multi-decode 5@32768 --decode-steps 32 --paired 5 --toggle route.tickets.acq_rel --record
    cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
    bench invariance 120 invariance $Q4X --int8 --set route.tickets.acq_rel=true --record ;;
  s30)  # 2026-12-07 13:20: s28's HC tests (hc.stage_hoist narrowed) beside s29 in one call
    timeout 300 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_hc.py tests/cuda/test_hc_cluster.py tests/cuda/test_fused_router.py > "$OUT/t_s30.log" 2>&1
    echo "== s30 tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_s30.log" | head
    bench acq_rel 180 model $Q4X --ctx 65536 --slots 5 --int8 --prefill= --decode 0 \
      --multi-decode 5@32768 --decode-steps 32 --paired 5 --toggle route.tickets.acq_rel --record
    cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
    bench invariance 100 invariance $Q4X --int8 --set route.tickets.acq_rel=true --record ;;
  s31)  # 2026-12-07 14:30: route.split (the fused router's 2..8 tokens in groups of 2 on grid
    # y: ncu 26.9 us at 8 tokens, 1.3% issue busy, one warp a scheduler waiting on L1TEX), then
    # in groups of 1; its tests first. (14:17's run of this stage timed its first bench out
    # while the model was made; its linear.q8.split, even, is removed.)
    timeout 120 python3 -m pytest -q --tb=short -p no:cacheprovider -rfE -m gpu \
      -k "split or acq_rel or refuses or kernel_shapes" tests/cuda/test_fused_router.py \
      tests/cuda/test_linear_matvec_q8.py > "$OUT/t_s31.log" 2>&1
    echo "== s31 tests rc=$?"; grep -E "^(FAILED|ERROR|E )|passed|failed" "$OUT/t_s31.log" | head
    bench rsplit 200 model $Q4X --ctx 262144 --slots 5 --int8 --prefill= --decode= \
      --multi-decode 5@32768,5@131072 --decode-steps 32 --paired 5 --toggle route.split \
      --set route.split_tokens=2 --record
    cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
    bench rsplit1 120 model $Q4X --ctx 65536 --slots 5 --int8 --prefill= --decode= \
      --multi-decode 5@32768 --decode-steps 32 --paired 5 --toggle route.split \
      --set route.split_tokens=1 --record
    cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
    bench invariance 90 invariance $Q4X --int8 --set route.split_tokens=2 --record ;;
  moewg2)  # 64 x 256 MoE tiles: X (re-read by every column tile) half as often, W decoded 1.5x
    timeout 150 python3 -m pytest -q -s --tb=line -p no:cacheprovider -rfE -m gpu \
      tests/cuda/test_qgemm_wgmma.py -k "grouped_moe or dense_matches" > "$OUT/t_moewg2.log" 2>&1
    echo "== moewg2 tests rc=$?"
    grep -E "^(FAILED|ERROR|E )|passed|failed|grouped moe" "$OUT/t_moewg2.log" | head -20
    bench moewg2 200 model $Q4X --ctx 65536 --slots 1 --int8 --prefill 4096@0 --decode= \
      --multi-decode= --paired 3 --moe-tiles wg:128,128,2/wg:64,256,2 --record ;;
  dist)  # two pipeline ranks sharing one GPU (gloo, hand-offs through the host, decode graphs):
    # the serving code's tokens against one process at full width, 8 layers (no speed claim:
    # the ranks share the card)
    bench pipedist "${DIST_T:-500}" pipeline-dist --device cuda --dist-backend gloo --shape qwen4exp-flash-next \
      --layers 8 --experts 32 --ple-rows 1000000 --runs 1x1,2x1 --prompt 4096 --ubatch 1024 \
      --sessions 5 --decode-depth 1024 --decode-steps 8 --record ;;
  *) echo "unknown stage $1"; exit 2 ;;
esac
cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
