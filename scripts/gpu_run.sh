#!/usr/bin/env bash
# Everything the GPU machine does, in one call: build, GPU tests, benchmarks.
#
#   bash scripts/gpu_run.sh [STAGE ...]   STAGE: info build smoke test demo cm ar kernels ssd
#                                               train decode all
#                                               ranks, ipc (only when named: the
#                                               multi-rank tests of one GPU, and
#                                               the IPC/MPS probe)
#                                               profile, stall, nvshmem, nvlink, cutlass, mixer,
#                                               mamba_probe, ssd_tiling, tune, stream
#                                               (only when named)
#
# JFO_GPU_TESTS picks test files; JFO_CM_ARGS, JFO_AR_ARGS, JFO_KT_ARGS, JFO_SSD_ARGS,
# JFO_TRAIN_ARGS and JFO_DECODE_ARGS
# add flags to the benchmarks (e.g. JFO_CM_ARGS="--chunks 2 4 --ops matmul_all_reduce");
# JFO_PREBUILT_WHEEL=path installs that wheel (built elsewhere with
# JFO_CUDA_ARCHITECTURES covering this GPU) instead of building here.
# JFO_DEVICES=N runs everything on the first N GPUs (CUDA_VISIBLE_DEVICES) and
# names the JSON files *_tpN.json, so runs at TP=2/4/8 can share one $OUT.
# JFO_SAMPLE_CLOCKS=1 samples each GPU's SM clock and power every 100 ms
# during every stage (read-only nvidia-smi queries) and prints their range:
# whether a benchmark ran power-throttled.
# JFO_DEADLINE (seconds since the epoch; default: 570 s after this script
# starts) bounds every stage: a stage still running then is stopped, a later
# one skipped, and the summary still printed, before the device tool's limit
# takes the whole call and its output. Chained calls share one deadline:
#   export JFO_DEADLINE=$(( $(date +%s) + 570 )); bash scripts/gpu_run.sh ...; ...
#
# Logs and JSON go under $OUT (the device tool brings that folder back); the
# last thing printed is the summary table. The NVLink-multicast switches stay
# off: a program using multicast can take the host's GPUs out of service.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/jfo_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
tag=""
if [ -n "${JFO_DEVICES:-}" ]; then
  export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((JFO_DEVICES - 1)))
  tag="_tp${JFO_DEVICES}"
fi
tag="${tag}${JFO_TAG:-}"  # e.g. JFO_TAG=_autotune keeps a second run's JSON apart
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(all)
want() { [[ " ${stages[*]} " == *" $1 "* || " ${stages[*]} " == *" all "* ]]; }
JFO_DEADLINE=${JFO_DEADLINE:-$(( $(date +%s) + 570 ))}
status=0
summary=()  # "stage rc seconds", printed last
# Per GPU: the range of the SM clock and power samples in file $1 (lines
# "index, clock, power").
clock_summary() {
  $PY - "$1" <<'PYEOF'
import collections, statistics, sys
samples = collections.defaultdict(list)
for line in open(sys.argv[1]):
    try:
        gpu, clock, power = (float(v) for v in line.split(","))
    except ValueError:
        continue  # "[N/A]" or a partial last line
    samples[int(gpu)].append((clock, power))
for gpu, rows in sorted(samples.items()):
    clocks, powers = [c for c, _ in rows], [p for _, p in rows]
    print(f"GPU {gpu}: {len(rows)} samples, SM clock {min(clocks):.0f} / "
          f"{statistics.median(clocks):.0f} / {max(clocks):.0f} MHz (min / median / max), "
          f"power {statistics.median(powers):.0f} / {max(powers):.0f} W (median / max)")
PYEOF
}
step() {  # step NAME CMD...: runs CMD, logs it, remembers failures
  local name=$1; shift
  local left=$(( JFO_DEADLINE - $(date +%s) ))
  if [ "$left" -lt 20 ]; then
    echo "=== $name: skipped, ${left} s left before JFO_DEADLINE"
    status=1
    return 1
  fi
  echo "=== $name: $*"
  local t0=$SECONDS sampler="" bound=()
  # Shell functions (the probes) run unbounded: timeout runs programs only.
  [ "$(type -t "$1")" = function ] || bound=(timeout -k 10 "$(( left - 10 ))")
  if [ -n "${JFO_SAMPLE_CLOCKS:-}" ]; then
    nvidia-smi --query-gpu=index,clocks.sm,power.draw --format=csv,noheader,nounits \
      -lms 100 > "/tmp/jfo_clocks_$name.csv" 2>/dev/null &
    sampler=$!
  fi
  "${bound[@]}" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] && [ ${#bound[@]} -gt 0 ] && echo "=== $name: stopped at JFO_DEADLINE"
  if [ -n "$sampler" ]; then
    kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
    clock_summary "/tmp/jfo_clocks_$name.csv" | tee -a "$OUT/$name.log"
  fi
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
  summary+=("$name $rc $((SECONDS - t0))")
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

if want info; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.sm --format=csv
  nvidia-smi topo -m
  $PY -c "import jax; print('jax', jax.__version__, jax.devices())"
fi
if want build; then
  # The tile-signalled GEMM needs the pinned CUTLASS headers, which the GPU
  # machine cannot download: carry the wheel (pip download --no-deps
  # nvidia-cutlass==4.2.0.0 -d build/wheels) and it is installed first.
  for wheel in build/wheels/nvidia_cutlass-*.whl; do
    [ -f "$wheel" ] && $PY -m pip install --no-deps -q "$wheel"
  done
  if [ -n "${JFO_PREBUILT_WHEEL:-}" ]; then
    step build $PY -m pip install --no-deps --force-reinstall -q "$JFO_PREBUILT_WHEEL" || exit 1
  else
    step build $PY -m pip install --no-build-isolation --no-deps --force-reinstall -q . \
      || exit 1
  fi
  # A build without CUDA (no nvcc) would make every GPU test skip: stop here.
  $PY -P -c "import jax_flashoverlap as j, sys; i = j.build_info(); print('build_info:', i);
sys.exit(0 if i['cuda'] else 'the build has no CUDA kernels (nvcc not found?)')" || exit 1
fi
if want smoke && [ -f scripts/ffi_smoke.py ]; then
  step smoke $PY scripts/ffi_smoke.py
fi
if want test; then
  JFO_REQUIRE_GPU=1 step test$tag $PY -P -m pytest -q -m gpu -p no:cacheprovider --maxfail=3 \
    ${JFO_GPU_TESTS:-tests}
fi
# The four ops, injected faults and NVSHMEM's all-reduce with the ranks as
# processes sharing the visible GPU(s) (launch --share-gpu;
# tests/test_node_transport.py), at 2 to 8 ranks: correctness only, never a speed. Under a private CUDA MPS
# daemon where the machine has nvidia-cuda-mps-control; JFO_FAULT_ROUNDS:
# faults per kind and op (default 2); JFO_RANKS_SELECT: a pytest -k
# expression (e.g. "faults and 4"); JFO_RANKS_SEED: the children's draws
# (default 0), so that a repeated run adds new cases. Each rank count's JSON
# lands in $OUT.
if [[ " ${stages[*]} " == *" ranks "* ]]; then
  OUT="$OUT" JFO_REQUIRE_GPU=1 step ranks$tag $PY -P -m pytest -q -m gpu -p no:cacheprovider -rA \
    -k "${JFO_RANKS_SELECT:-}" tests/test_node_transport.py
fi
# Opt-in: CUDA IPC between two processes on GPU 0 and their flag round trip,
# without MPS and under a private MPS daemon (scripts/ipc_probe.cu).
ipc_probe() {
  nvcc -O2 -arch=sm_90 -cudart static -o /tmp/jfo_ipc_probe scripts/ipc_probe.cu || return 1
  echo "--- no MPS"; CUDA_VISIBLE_DEVICES=0 /tmp/jfo_ipc_probe 50 20 || return 1
  local dir; dir=$(mktemp -d)
  mkdir -p "$dir/pipe" "$dir/log"
  export CUDA_MPS_PIPE_DIRECTORY=$dir/pipe CUDA_MPS_LOG_DIRECTORY=$dir/log
  if nvidia-cuda-mps-control -d; then
    echo "--- MPS"; CUDA_VISIBLE_DEVICES=0 /tmp/jfo_ipc_probe 2000 500; local rc=$?
    echo quit | nvidia-cuda-mps-control
  else
    echo "--- MPS: the daemon did not start"
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  return "${rc:-0}"
}
if [[ " ${stages[*]} " == *" ipc "* ]]; then
  step ipc$tag ipc_probe
fi
if want demo; then
  step demo $PY -P -m jax_flashoverlap.cli.demo --json "$OUT/demo.json"
fi
if want cm; then
  # shellcheck disable=SC2086
  step cm$tag $PY benchmarks/collective_matmul.py --json "$OUT/collective_matmul$tag.json" \
    --plot "$OUT/collective_matmul$tag.png" ${JFO_CM_ARGS:-}
fi
if want ar; then
  # shellcheck disable=SC2086
  step ar$tag $PY -P benchmarks/all_reduce.py --json "$OUT/all_reduce$tag.json" \
    --plot "$OUT/all_reduce$tag.png" ${JFO_AR_ARGS:-}
fi
if want kernels; then
  # shellcheck disable=SC2086
  step kernels$tag $PY benchmarks/kernel_times.py ops --json "$OUT/kernel_times$tag.json" \
    ${JFO_KT_ARGS:-}
fi
if want ssd; then
  # shellcheck disable=SC2086
  step ssd$tag $PY -P benchmarks/ssd.py --json "$OUT/ssd$tag.json" ${JFO_SSD_ARGS:-}
fi
if want train; then
  # shellcheck disable=SC2086
  step train$tag $PY -P benchmarks/train_step.py --json "$OUT/train_step$tag.json" \
    ${JFO_TRAIN_ARGS:-}
fi
# Opt-in: jax-flashoverlap-tune --verify (JFO_TUNE_ARGS adds flags): measures
# every impl of every op over the default grid (at most 5 minutes), then times
# "auto" against the fastest on each shape. The table lands in $OUT/xdg_cache
# (its XDG cache directory), so nothing of the machine's own cache is used.
if [[ " ${stages[*]} " == *" tune "* ]]; then
  # shellcheck disable=SC2086
  XDG_CACHE_HOME="$OUT/xdg_cache" step tune$tag $PY -P -m jax_flashoverlap.cli.tune --verify \
    ${JFO_TUNE_ARGS:-}
fi
# Opt-in: the Pallas SSD's tilings (benchmarks/ssd.py --sweep-only; JFO_SWEEP_ARGS
# replaces the grid), then, if one beats the default's forward + backward by
# 3%, the Mamba-2 1.4B step at it against the default and the Transformer's,
# in one process (benchmarks/train_step.py, one GPU).
if [[ " ${stages[*]} " == *" ssd_tiling "* ]]; then
  # shellcheck disable=SC2086
  step ssd_sweep$tag $PY -P benchmarks/ssd.py --sweep-only --reps 5 \
    --json "$OUT/ssd_sweep$tag.json" ${JFO_SWEEP_ARGS:---sweep-tiles 64x64 128x64 64x32 \
    128x32 --sweep-warps 4 8 --sweep-stages 2 3}
  variant=""
  [ -f "$OUT/ssd_sweep$tag.json" ] && variant=$($PY - "$OUT/ssd_sweep$tag.json" <<'PYEOF'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"]
        if r["phase"] == "forward+backward" and "ms" in r]
default = [r for r in rows if (r["block"], r["block_cols"], r["num_warps"], r["num_stages"])
           == (64, 64, 4, 3)]
best = min(rows, key=lambda r: r["ms"]) if rows else None
if best and default and best["ms"] < 0.97 * default[0]["ms"]:
    print(f"ssd-tiles={best['block']}x{best['block_cols']},ssd-warps={best['num_warps']},"
          f"ssd-stages={best['num_stages']}")
PYEOF
)
  if [ -n "$variant" ]; then
    step train_tiling$tag $PY -P benchmarks/train_step.py --json "$OUT/train_step_tiling$tag.json" \
      --models mamba transformer --impls xla --mesh 1x1 --steps 5 --reps 3 --warmup 2 \
      --mamba-variants default "$variant"
  else
    echo "=== ssd_tiling: no step timed: no sweep row beat the default (64x64, 4 warps, 3 stages)" \
      "by 3%, or the sweep wrote none"
  fi
fi
# Decoding (benchmarks/decode.py); JFO_DECODE_PROFILE=1 also traces each case's
# decode loop and prints its kernels per step (JFO_DECODE_STEPS: the loop's
# steps, i.e. the second --steps value, 48 by default; JFO_DECODE_TOP: the
# kernels named per category, 6 by default).
if want decode; then
  profile_flag=""
  [ -n "${JFO_DECODE_PROFILE:-}" ] && { rm -rf /tmp/jfo_decode_trace; profile_flag="--profile /tmp/jfo_decode_trace"; }
  # shellcheck disable=SC2086
  step decode$tag $PY -P benchmarks/decode.py --json "$OUT/decode$tag.json" \
    --plot "$OUT/decode$tag.png" $profile_flag ${JFO_DECODE_ARGS:-}
  if [ -n "$profile_flag" ]; then
    for trace in /tmp/jfo_decode_trace/*; do
      [ -d "$trace" ] || continue
      echo "--- decode loop trace $(basename "$trace")"
      $PY benchmarks/kernel_times.py trace "$trace" --iterations "${JFO_DECODE_STEPS:-48}" \
        --top "${JFO_DECODE_TOP:-6}" | tee -a "$OUT/decode_profile$tag.log"
    done
  fi
fi
# Opt-in: Mamba-2's decode mixer kernel by tiling against XLA's ops, 48
# layers (scripts/mamba_decode_mixer_probe.py; JFO_MIXER_BATCHES, default 1 32).
if [[ " ${stages[*]} " == *" mixer "* ]]; then
  # shellcheck disable=SC2086
  step mixer$tag $PY -P scripts/mamba_decode_mixer_probe.py ${JFO_MIXER_BATCHES:-}
fi
# Opt-in: the one-kernel Mamba-2 decode step's variants, checked, timed and
# traced (scripts/mamba_decode_probe.py; JFO_MAMBA_PROBE_ARGS adds flags).
if [[ " ${stages[*]} " == *" mamba_probe "* ]]; then
  # shellcheck disable=SC2086
  step mamba_probe$tag $PY -P scripts/mamba_decode_probe.py \
    --json "$OUT/mamba_decode_probe$tag.json" ${JFO_MAMBA_PROBE_ARGS:-}
fi
# Opt-in: the NVLink ceilings between GPUs 0 and 1 (copy engine, SM push and
# pull, the two-shot's pattern without flags; scripts/nvlink_probe.cu).
nvlink_probe() {
  nvcc -O3 -arch=sm_90 -o /tmp/jfo_nvlink_probe scripts/nvlink_probe.cu \
    && /tmp/jfo_nvlink_probe > "$OUT/nvlink_probe$tag.json" \
    && $PY - "$OUT/nvlink_probe$tag.json" <<'PYEOF'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    grid = f"{r['blocks']}x{r['threads']}" if r["blocks"] else "-"
    print(f"{r['name']:20s} {r['bytes'] >> 20:4d} MiB  {grid:9s} {r['us']:8.1f} us  {r['gb_per_s']:6.1f} GB/s")
PYEOF
}
if [[ " ${stages[*]} " == *" nvlink "* ]]; then
  step nvlink$tag nvlink_probe
fi
# Opt-in: how fast one GPU streams 2 GiB into its SMs, by plain loads and
# by TMA rings with and without a GEMV's work (scripts/hbm_stream_probe.cu;
# it prints its table on stderr).
if [[ " ${stages[*]} " == *" stream "* ]]; then
  step stream$tag bash -c "nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/jfo_hbm_stream_probe \
    scripts/hbm_stream_probe.cu && /tmp/jfo_hbm_stream_probe > '$OUT/hbm_stream_probe$tag.json'"
fi
# Opt-in: CUTLASS GEMMs against cuBLAS at the fused ops' whole problems
# (scripts/cutlass_gemm_probe.cu). CUTLASS is not on the GPU machine: build
# the probe where it is and carry build/cutlass_gemm_probe.
cutlass_probe() {
  if [ ! -x build/cutlass_gemm_probe ]; then
    echo "build/cutlass_gemm_probe is missing: build it as scripts/cutlass_gemm_probe.cu says and carry it"
    return 1
  fi
  build/cutlass_gemm_probe > "$OUT/cutlass_gemm_probe$tag.json" \
    && $PY scripts/cutlass_gemm_compare.py "$OUT/cutlass_gemm_probe$tag.json"
}
if [[ " ${stages[*]} " == *" cutlass "* ]]; then
  step cutlass$tag cutlass_probe
fi
# Opt-in: a jax.profiler trace of 3 training steps (1B model, TP=2 with
# sequence parallelism, sequence 8192: the benchmark's config) and its device
# time per kernel category. JFO_PROFILE_MODEL (transformer), JFO_PROFILE_IMPL
# (auto), JFO_PROFILE_ARGS (the model flags), JFO_PROFILE_TOP (kernels named
# per category, 3). 10 steps at lr 1e-4 (the loss falls steadily): steps 1-3
# are traced; the printed step time leaves them and step 4 (which starts on a
# device idle after stop_trace) out. JFO_PROFILE_HLO=1 also writes the step's
# optimized HLO (gzipped) under $OUT, to map the trace's fusion names to ops.
if [[ " ${stages[*]} " == *" profile "* ]]; then
  rm -rf /tmp/jfo_profile /tmp/jfo_hlo
  dump_flags=""
  [ -n "${JFO_PROFILE_HLO:-}" ] && dump_flags="--xla_dump_to=/tmp/jfo_hlo --xla_dump_hlo_as_text \
--xla_dump_hlo_module_re=.*step.*"
  # shellcheck disable=SC2086
  XLA_FLAGS="${XLA_FLAGS:-} $dump_flags" \
    step profile$tag $PY -P -m jax_flashoverlap.cli.train --model "${JFO_PROFILE_MODEL:-transformer}" \
    ${JFO_PROFILE_ARGS:---size 1b --mesh 1x2 --batch 1 --seq-len 8192} --steps 10 --lr 1e-4 \
    --impl "${JFO_PROFILE_IMPL:-auto}" --no-progress --profile /tmp/jfo_profile \
    && step profile_summary$tag $PY benchmarks/kernel_times.py trace /tmp/jfo_profile --iterations 3 \
      --top "${JFO_PROFILE_TOP:-3}"
  if [ -n "${JFO_PROFILE_HLO:-}" ]; then
    # The largest optimized module is the training step.
    hlo=$(ls -S /tmp/jfo_hlo/*after_optimizations.txt 2>/dev/null | head -1)
    [ -n "$hlo" ] && gzip -c "$hlo" > "$OUT/profile_hlo$tag.txt.gz" && echo "HLO: $hlo"
  fi
fi
# Opt-in: the unrolled Mamba-2 skeleton with impl="cuda" in fresh processes
# (JFO_STALL_RUNS, default 10), each bounded; the lazy-loading stall of
# README "Troubleshooting" showed in a process's first call.
stall_loop() {
  local i t0 rc failed=0
  for i in $(seq "${JFO_STALL_RUNS:-10}"); do
    t0=$SECONDS
    (cd tests && XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 90 \
       $PY -u cuda_scan_child.py unrolled) > /tmp/jfo_stall.log 2>&1
    rc=$?
    echo "run $i: rc=$rc in $((SECONDS - t0)) s; $(grep -o 'MATCH.*' /tmp/jfo_stall.log)"
    [ "$rc" -eq 0 ] || { failed=1; tail -5 /tmp/jfo_stall.log; }
  done
  return $failed
}
if [[ " ${stages[*]} " == *" stall "* ]]; then
  step stall$tag stall_loop
fi
# Opt-in and isolated: rebuilds the package with the NVSHMEM module (CMake
# option JFO_ENABLE_NVSHMEM), runs its 2-process tests, its benchmark and
# the decoding benchmark across the 2 processes. Run
# it after the other stages: a failed build leaves the installed package as
# it was, and a failed test here fails only this stage.
if [[ " ${stages[*]} " == *" nvshmem "* ]]; then
  if step nvshmem_build $PY -m pip install --no-build-isolation --no-deps --force-reinstall -q \
      -C cmake.define.JFO_ENABLE_NVSHMEM=ON .; then
    $PY -P -c "from jax_flashoverlap import nvshmem; print('nvshmem built:', nvshmem.is_built())"
    # Two bare processes per start-up variant first: says which way NVSHMEM
    # starts (or where it crashes) before the JAX tests depend on it.
    step nvshmem_probe $PY scripts/nvshmem_probe.py
    step nvshmem_test $PY -P -m pytest -q -p no:cacheprovider -rA \
      tests/test_nvshmem_all_reduce.py
    # The hierarchical path across 2 processes, each GPU its own node, against
    # psum there and the single-process two-shot kernel (this run's ar JSON,
    # else the committed one).
    single="$OUT/all_reduce$tag.json"
    [ -f "$single" ] || single=benchmarks/results/all_reduce_2xh200.json
    step nvshmem_bench env -u XLA_FLAGS XLA_PYTHON_CLIENT_PREALLOCATE=false \
      $PY -P -m jax_flashoverlap.cli.launch -n 2 --node-size 1 --timeout 300 \
      benchmarks/hierarchical_all_reduce.py --single-process "$single" \
      --json "$OUT/hierarchical_all_reduce.json"
    # Decoding across the same 2 processes: "auto" (the NVSHMEM all-reduce)
    # against psum (issue 18); JFO_NVSHMEM_DECODE_ARGS replaces the sweep.
    # shellcheck disable=SC2086
    step nvshmem_decode env -u XLA_FLAGS XLA_PYTHON_CLIENT_PREALLOCATE=false \
      $PY -P -m jax_flashoverlap.cli.launch -n 2 --node-size 1 --timeout 400 \
      benchmarks/decode.py --json "$OUT/decode_nvshmem.json" \
      ${JFO_NVSHMEM_DECODE_ARGS:---impls xla auto --batches 1 8 --contexts 512}
  fi
fi
echo "=== summary (stage, rc, seconds)"
printf '%-24s %4s %6s\n' ${summary[@]+${summary[@]}}  # no `column` on every machine
exit $status
