#!/usr/bin/env bash
# Issue 7's GPU check in one call: GPU tests, training throughput (bf16, MFU), ort-cuda fp32 /
# fp16 parity against the PyTorch reference on CUDA, and translation throughput; a JSON report
# and a log under $OUT, merged as each step finishes (a run cut short still returns them).
#
# Here, before the GPU calls (after ../shared/tools/ort-gpu-chunks, which empties .carry/):
#   bench/gpu_check.sh --prepare     # .carry/{multi30k,pkg-fp32,pkg-fp16} (exported here,
#                                    # torch 2.13) and .carry/inputs/gpu-inputs.tar.gz
# On the GPU machine (repository root; onnxruntime-gpu first on PYTHONPATH):
#   CARRY=/tmp/c bash bench/gpu_check.sh     # CARRY: where multi30k/ pkg-fp32/ pkg-fp16/ are
# The calls: (1) carry [".carry/inputs"]: mkdir -p /tmp/c && tar -xzf
# .carry/inputs/gpu-inputs.tar.gz -C /tmp/c; (2..N) the wheel chunks as ../shared/tools/GPU.md
# says, the last ending in: export PYTHONPATH=/tmp/site:$PWD && CARRY=/tmp/c bash
# bench/gpu_check.sh (give that call ~100 s more than BUDGET_S, for the wheel install).
# Dry run here (GPU engines on cpu / ort-cpu, small limits, gradio/psutil/ctranslate2/tensorrt
# made unimportable as on the GPU machine):
#   DRY_RUN=1 bash bench/gpu_check.sh        # OUT defaults to /tmp/gpu_check_dry
#
# Environment: OUT (required on the GPU), PY (python3; dry run .venv/bin/python), CARRY (.carry),
# BUDGET_S (wall-clock budget of the whole script, 235), STEPS (default
# "env pytest parity translate train"; pytest runs in the background during parity, which
# times nothing that is a target; PARALLEL_PYTEST=0 runs it alone), PARITY_BEAMS ("4 1"),
# BATCH1_LIMIT (200: batch 1 is timed on the first 200 sentences), TRAIN_STEPS (30),
# ORT_MODE_OVERRIDE (plain|preload|torch: skip the ortcheck verdict for the translation step).
# Files in $OUT: gpu_report.json, gpu_check.log, parity-fp16.json, parity-fp32.json,
# translate.json, train_throughput.json.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
REPO=$PWD

prepare() {
  local py=${PY:-.venv/bin/python} ckpt=models/multi30k-en-de v
  mkdir -p .carry/multi30k .carry/inputs
  for f in ../shared/data/multi30k/*.{en,de}.gz; do
    [ -f ".carry/multi30k/$(basename "$f")" ] || cp "$f" .carry/multi30k/ || return 1
  done
  for v in fp32 fp16; do
    if "$py" - "$ckpt" ".carry/pkg-$v" "$v" <<'EOF'
import json, sys
from pathlib import Path
from runtime.checksums import sha256_file
ckpt, pkg, variant = sys.argv[1:]
m = Path(pkg) / "manifest.json"
ok = m.is_file() and json.loads(m.read_text()).get("variant") == variant and \
    json.loads(m.read_text()).get("source_checkpoint", {}).get("sha256") == \
    sha256_file(Path(ckpt) / "model.safetensors")
sys.exit(0 if ok else 1)
EOF
    then echo "prepare: .carry/pkg-$v is current"
    else
      echo "prepare: exporting .carry/pkg-$v"
      "$py" -m runtime.dispatch export "$ckpt" --out ".carry/pkg-$v" --force \
        $([ "$v" = fp16 ] && echo --fp16) || return 1
    fi
  done
  rm -f .carry/inputs/gpu-inputs.tar.gz
  tar -czf .carry/inputs/gpu-inputs.tar.gz -C .carry multi30k pkg-fp32 pkg-fp16 || return 1
  local tree tarb
  tree=$(git ls-files -co --exclude-standard -z | xargs -0 -r stat -c %s 2>/dev/null |
         awk '{s+=$1} END {print s+0}')
  tarb=$(stat -c %s .carry/inputs/gpu-inputs.tar.gz)
  echo "prepare: working tree $((tree / 1048576)) MiB + .carry/inputs $((tarb / 1048576)) MiB" \
       "= $(((tree + tarb) / 1048576)) MiB of the 64 MiB a call carries"
  echo "prepare: carry [\".carry/inputs\"] in one call and run:" \
       "mkdir -p /tmp/c && tar -xzf .carry/inputs/gpu-inputs.tar.gz -C /tmp/c && ls /tmp/c"
}

if [ "${1:-}" = "--prepare" ]; then prepare; exit $?; fi

DRY=${DRY_RUN:-0}
if [ "$DRY" = 1 ]; then
  PY=${PY:-.venv/bin/python}; OUT=${OUT:-/tmp/gpu_check_dry}; BUDGET=${BUDGET_S:-1200}
  DEVICE=cpu; BACKEND=ort-cpu; SCALE=6
  PARITY_LIMIT=${PARITY_LIMIT:-24}; BENCH_LIMIT=${BENCH_LIMIT:-24}
  BATCH1_LIMIT=${BATCH1_LIMIT:-4}
  TRAIN_ARGS=(--device cpu --presets base multi30k --mfu --max-tokens 400 --steps 2 --warmup 1)
  STAND_IN=(--cpu-stand-in)
else
  PY=${PY:-python3}; BUDGET=${BUDGET_S:-235}
  DEVICE=cuda; BACKEND=ort-cuda; SCALE=1
  PARITY_LIMIT=${PARITY_LIMIT:-}; BENCH_LIMIT=${BENCH_LIMIT:-1000}
  BATCH1_LIMIT=${BATCH1_LIMIT:-200}
  TRAIN_ARGS=(--device cuda --bf16 --presets base multi30k --mfu --max-tokens 25000
              --steps "${TRAIN_STEPS:-30}" --warmup 5)
  STAND_IN=()
fi
: "${OUT:?set OUT to the folder for results}"
CARRY=${CARRY:-.carry}
CARRY=$(cd "$CARRY" 2>/dev/null && pwd || echo "$CARRY")
DATA=$CARRY/multi30k; PKG_FP32=$CARRY/pkg-fp32; PKG_FP16=$CARRY/pkg-fp16
STEPS=${STEPS:-env pytest parity translate train}
PARITY_BEAMS=${PARITY_BEAMS:-4 1}
PARALLEL_PYTEST=${PARALLEL_PYTEST:-1}
CKPT=$REPO/models/multi30k-en-de

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
REPORT=$OUT/gpu_report.json; LOG=$OUT/gpu_check.log
export GPU_REPORT_LOCK=$WORK/report.lock
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$REPO"
export AIAYN_DATA=$DATA XDG_CACHE_HOME=$WORK/xdg AIAYN_BUNDLED_PACKAGE=$PKG_FP32
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
if [ "$DRY" = 1 ]; then  # the GPU machine has none of these: prove nothing needs them
  mkdir -p "$WORK/sim"
  cat > "$WORK/sim/sitecustomize.py" <<'EOF'
import importlib.machinery, sys
ABSENT = {"gradio", "gradio_client", "psutil", "ctranslate2", "tensorrt"}
class _PathFinder(importlib.machinery.PathFinder):  # as if they were not installed
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            return None
        return super().find_spec(name, path, target)
sys.meta_path[:] = [_PathFinder if f is importlib.machinery.PathFinder else f
                    for f in sys.meta_path]
EOF
  export PYTHONPATH="$WORK/sim:$PYTHONPATH"
fi
HAVE_TIMEOUT=1; command -v timeout >/dev/null || HAVE_TIMEOUT=0

log() { echo "[gpu_check +${SECONDS}s] $*" | tee -a "$LOG"; }
report() { "$PY" bench/gpu_report.py "$@" >> "$LOG" 2>&1 || log "report $1 FAILED (see log)"; }

# run_step NAME CAP STDOUT OKCODES CMD...: CMD with a timeout of min(CAP, what the budget
# leaves); stdout to the file STDOUT ("-": the log), stderr to the log; status into the report.
run_step() {
  local name=$1 cap=$(( $2 * SCALE )) stdout=$3 ok=$4 left t start rc
  shift 4
  left=$(( BUDGET - SECONDS - 6 ))
  t=$(( cap < left ? cap : left ))
  if (( t < 5 )); then
    log "$name: SKIPPED, the budget is spent"
    report step "$REPORT" "$name" -1 0 "$cap"
    return 1
  fi
  log "$name: start (limit ${t}s)"
  start=$SECONDS
  {
    echo "----- $name: $*"
    if [ "$stdout" = - ]; then
      if [ $HAVE_TIMEOUT = 1 ]; then timeout -k 5 "$t" "$@"; else "$@"; fi
    else
      if [ $HAVE_TIMEOUT = 1 ]; then timeout -k 5 "$t" "$@" > "$stdout"; else "$@" > "$stdout"; fi
    fi
  } > "$WORK/$name.log" 2>&1
  rc=$?
  cat "$WORK/$name.log" >> "$LOG"
  log "$name: rc $rc after $((SECONDS - start))s"
  report step "$REPORT" "$name" "$rc" "$((SECONDS - start))" "$t" --ok-codes "$ok"
  return $rc
}

step_env() {
  { echo "----- nvidia-smi"; nvidia-smi 2>&1 || echo "(no nvidia-smi)"; } >> "$LOG"
  run_step env 40 - 0 "$PY" bench/gpu_report.py env "$REPORT" --package "$PKG_FP32"
  # Does ort-cuda start in a torch-free process (as bench/translate.py's ort workers run)? If
  # only after onnxruntime.preload_dlls() or `import torch`, the translation step gets that
  # prelude through a sitecustomize (and the summary warns: the runtime needs a fix).
  run_step ortcheck 60 "$WORK/ortmode" 0 "$PY" bench/gpu_report.py ortcheck "$REPORT" \
    --package "$PKG_FP32"
  ORT_MODE=${ORT_MODE_OVERRIDE:-$(tail -n 1 "$WORK/ortmode" 2>/dev/null)}
  log "ort-cuda start mode: ${ORT_MODE:-unknown}"
  report set "$REPORT" ort_mode_used "\"${ORT_MODE:-unknown}\""
  case $ORT_MODE in
    preload) mkdir -p "$WORK/ortfix"
             printf 'import onnxruntime\nonnxruntime.preload_dlls()\n' \
               > "$WORK/ortfix/sitecustomize.py" ;;
    torch) mkdir -p "$WORK/ortfix"; echo "import torch" > "$WORK/ortfix/sitecustomize.py" ;;
  esac
  if [ -f "$WORK/ortfix/sitecustomize.py" ] && [ -f "$WORK/sim/sitecustomize.py" ]; then
    cat "$WORK/sim/sitecustomize.py" >> "$WORK/ortfix/sitecustomize.py"  # dry run: keep both
  fi
}

step_pytest() {
  run_step pytest 130 - 0 "$PY" -m pytest -m gpu -q -p no:cacheprovider \
    --junitxml="$WORK/pytest.xml" tests/
  [ -f "$WORK/pytest.xml" ] && report pytest "$REPORT" "$WORK/pytest.xml"
  log "pytest: $(grep -Eo '[0-9]+ (passed|failed|skipped|deselected|error)[a-z]*' \
      "$WORK/pytest.log" | tr '\n' ' ')"
}

step_parity() {  # $1: fp16 or fp32
  local v=$1 pkg
  pkg=$CARRY/pkg-$1
  # shellcheck disable=SC2086 # PARITY_BEAMS is a list
  run_step "parity-$v" 75 "$OUT/parity-$v.json" 0,1 "$PY" -m runtime.dispatch parity \
    --model "$pkg" --checkpoint "$CKPT" --backend "$BACKEND" --reference-device "$DEVICE" \
    --data "$DATA" --split test_2016_flickr --beam $PARITY_BEAMS --json \
    ${PARITY_LIMIT:+--limit "$PARITY_LIMIT"}
  [ -s "$OUT/parity-$v.json" ] && report parity "$REPORT" "$v" "$OUT/parity-$v.json"
  grep -h "^parity $v" "$LOG" | tail -n 2 | sed "s/^/[gpu_check +${SECONDS}s]   /"
}

step_train() {
  run_step train 60 - 0 "$PY" bench/train_throughput.py "${TRAIN_ARGS[@]}" \
    --json "$OUT/train_throughput.json"
  [ -s "$OUT/train_throughput.json" ] && report train "$REPORT" "$OUT/train_throughput.json"
}

step_translate() {
  local pp=$PYTHONPATH
  [ -f "$WORK/ortfix/sitecustomize.py" ] && pp="$WORK/ortfix:$PYTHONPATH"
  PYTHONPATH=$pp run_step translate 120 - 0 "$PY" bench/translate.py \
    --engines ort-cuda-fp16 torch-cuda ort-cuda-fp32 --lp-type gnmt \
    --package-fp32 "$PKG_FP32" --package-fp16 "$PKG_FP16" --data "$DATA" \
    --batch-sizes 1 64 --limit "$BENCH_LIMIT" --batch1-limit "$BATCH1_LIMIT" --check-n 0 \
    --timeout $(( 80 * SCALE )) --work "$WORK/bench" --out "$OUT/translate.json" "${STAND_IN[@]}"
  [ -s "$OUT/translate.json" ] && report translate "$REPORT" "$OUT/translate.json"
}

PYTEST_PID=; ORT_MODE=
wait_pytest() { if [ -n "$PYTEST_PID" ]; then wait "$PYTEST_PID"; PYTEST_PID=; fi; }

: > "$LOG"
log "start: dry_run=$DRY python=$PY carry=$CARRY out=$OUT budget=${BUDGET}s steps='$STEPS'"
report set "$REPORT" dry_run "$([ "$DRY" = 1 ] && echo true || echo false)"
report set "$REPORT" config "{\"budget_s\": $BUDGET, \"steps\": \"$STEPS\",
  \"parity_beams\": \"$PARITY_BEAMS\", \"parity_limit\": \"${PARITY_LIMIT:-all}\",
  \"bench_limit\": $BENCH_LIMIT, \"batch1_limit\": $BATCH1_LIMIT,
  \"train_args\": \"${TRAIN_ARGS[*]}\", \"carry\": \"$CARRY\", \"timeout_cmd\": $HAVE_TIMEOUT}"
for f in "$DATA/test_2016_flickr.en.gz" "$PKG_FP32/manifest.json" "$PKG_FP16/manifest.json"; do
  [ -f "$f" ] || log "WARNING: $f is missing"
done

for step in $STEPS; do
  case $step in
    env) step_env ;;
    pytest)
      if [ "$PARALLEL_PYTEST" = 1 ] && [[ " $STEPS " == *" parity "* ]]; then
        step_pytest & PYTEST_PID=$!
      else
        step_pytest
      fi ;;
    parity) step_parity fp16; step_parity fp32 ;;
    train) wait_pytest; step_train ;;
    translate) wait_pytest; step_translate ;;
    *) log "unknown step $step" ;;
  esac
done
wait_pytest
"$PY" bench/gpu_report.py summary "$REPORT" 2>&1 | tee -a "$LOG"
log "done in ${SECONDS}s; results in $OUT: $(ls "$OUT" | tr '\n' ' ')"
rm -rf "$WORK"
