#!/usr/bin/env bash
# The one-kernel decode step of several builds, side by side: each build's
# package in its own folder, transformer_decode_probe.py in alternating
# processes, so that every build meets the same machine state.
#
# Here (a machine with nvcc), once per build:
#   bash scripts/decode_ab.sh build NAME [PATCH]
#     HEAD with PATCH applied (`git apply`; none: HEAD as it is), built for
#     sm_90 into build/pkg_NAME, the probes beside the package, and what was
#     built in build/pkg_NAME/AB_BUILD.txt. About 2-3.5 minutes a build. PYTHON
#     (default .venv/bin/python, else python3) builds it: the device's Python
#     version (3.12).
# On the device, carrying build/pkg_NAME for every NAME:
#   bash scripts/decode_ab.sh run NAME ...
#     JFO_AB_TESTS, where set, is a pytest -k expression: those GPU tests of
#     tests/test_transformer_decode_cuda.py run first against each build, and
#     a build that fails them is not probed (all 26 take over 200 s a build).
#     Then JFO_AB_ROUNDS rounds (default 2), a probe process per NAME in the
#     order given, each with JFO_AB_PROBE_ARGS (default "--no-stages"), or
#     with JFO_AB_PROBE_ARGS_NAME where set (a patch's own --options).
#     Writes $OUT/NAME_ROUND.json per process, then (scripts/decode_ab_summary.py)
#     $OUT/decode_ab.json, every row with its build and order, and a table
#     of each round's step per build against the first NAME's.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
root=$(cd "$(dirname "$0")/.." && pwd)
usage() { awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0" >&2; exit 2; }

build() {  # build NAME [PATCH]
  local name=$1 patch=${2:-} pkg="$root/build/pkg_$1"
  [[ "$name" =~ ^[A-Za-z0-9_]+$ ]] || { echo "NAME: letters, digits and _ only" >&2; exit 2; }
  if [ -n "$patch" ]; then
    [ -f "$patch" ] || { echo "no patch file $patch" >&2; exit 2; }
    patch=$(realpath "$patch")
  fi
  # Globals: the EXIT trap removes them after the function has returned.
  tree=$(mktemp -d) wheels=$(mktemp -d)
  trap 'git -C "$root" worktree remove --force "$tree" 2>/dev/null; rm -rf "$tree" "$wheels"' EXIT
  git -C "$root" worktree add -q --detach "$tree" HEAD || exit 1
  if [ -n "$patch" ]; then git -C "$tree" apply "$patch" || exit 1; fi
  local python=${PYTHON:-}
  [ -n "$python" ] || { [ -x "$root/.venv/bin/python" ] && python=$root/.venv/bin/python; } \
    || python=python3
  (cd "$tree" && "$python" -m pip wheel --no-deps -q -w "$wheels" \
     -C cmake.define.JFO_CUDA_ARCHITECTURES=90 .) || exit 1
  rm -rf "$pkg" && mkdir -p "$pkg" && (cd "$pkg" && "$python" -m zipfile -e "$wheels"/*.whl .)
  cp "$root/scripts/transformer_decode_probe.py" "$pkg/"
  local head; head=$(git -C "$root" rev-parse --short=7 HEAD)
  if [ -n "$patch" ]; then
    echo "$head with $(basename "$patch") (sha256 $(sha256sum "$patch" | cut -c1-12)); sm_90" \
      > "$pkg/AB_BUILD.txt"
  else
    echo "$head; sm_90" > "$pkg/AB_BUILD.txt"
  fi
  echo "build/pkg_$name: $(cat "$pkg/AB_BUILD.txt")"
}

run() {  # run NAME ...
  local out=${OUT:-/tmp/jfo_out} rounds=${JFO_AB_ROUNDS:-2} names=() name r
  mkdir -p "$out"
  for name in "$@"; do
    [ -f "$root/build/pkg_$name/AB_BUILD.txt" ] || {
      echo "build/pkg_$name is missing: bash scripts/decode_ab.sh build $name, and carry it" >&2
      exit 2; }
  done
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  for name in "$@"; do
    if [ -n "${JFO_AB_TESTS:-}" ]; then
      echo "=== $name: GPU tests -k '$JFO_AB_TESTS'"
      if ! (cd "$root" && JFO_REQUIRE_GPU=1 PYTHONPATH="$root/build/pkg_$name" python3 -P -m \
            pytest -q -p no:cacheprovider -m gpu tests/test_transformer_decode_cuda.py \
            -k "$JFO_AB_TESTS" 2>&1 | tail -5; exit "${PIPESTATUS[0]}"); then
        echo "=== $name failed its tests: not probed"
        continue
      fi
    fi
    names+=("$name")
  done
  for r in $(seq 1 "$rounds"); do
    for name in "${names[@]}"; do
      local own="JFO_AB_PROBE_ARGS_$name"
      local probe_args=${!own:-${JFO_AB_PROBE_ARGS:---no-stages}}
      echo "=== $name, round $r: $probe_args"
      # shellcheck disable=SC2086  # the probe's flags, split as given
      (cd /tmp && JFO_COMMIT=$(cut -d' ' -f1 "$root/build/pkg_$name/AB_BUILD.txt" | tr -d ';') \
        PYTHONPATH="$root/build/pkg_$name" python3 -P "$root/build/pkg_$name/transformer_decode_probe.py" \
        $probe_args --json "$out/${name}_$r.json" 2>&1 \
        | grep -E "relative error|^slots of|off by|Error" | grep -v "^[WI]0")
    done
  done
  python3 "$root/scripts/decode_ab_summary.py" "$out" "$rounds" "$root/build" "${names[@]}"
}

case "${1:-}" in
  build) shift; [ $# -ge 1 ] && [ $# -le 2 ] || usage; build "$@" ;;
  run) shift; [ $# -ge 1 ] || usage; run "$@" ;;
  *) usage ;;
esac
