#!/usr/bin/env bash
# How the bundled models/multi30k-en-de was made: a small sweep of paper-recipe runs trained
# side by side on one GPU for a fixed wall time each, checkpoint averaging, selection on the
# validation split, and the test scores of the chosen model. Results go to $OUT (or ./sweep-out).
#
#   DATA=path/to/multi30k TIME=270 bash models/train_multi30k.sh
#
# Each run: label smoothing 0.1, Adam(0.9, 0.98, 1e-9), eq. 3, token batches, dropout (§5).
set -uo pipefail
DATA=${DATA:-../shared/data/multi30k}
TIME=${TIME:-270}          # seconds of training per run
OUT=${OUT:-sweep-out}
WORK=${WORK:-/tmp/aiayn-sweep}
PY=${PY:-python3}
AIAYN="$PY -m runtime.dispatch"
mkdir -p "$OUT" "$WORK"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/log.txt"; }

# name | options (model overrides via --set; recipe via flags)
RUNS=(
  "l3d256|--preset multi30k"
  "l4d256|--preset multi30k --set encoder_layers=4 --set decoder_layers=4"
  "l3d256w2k|--preset multi30k --warmup-steps 2000 --lr-scale 2"
  "l4d256h8|--preset multi30k --set encoder_layers=4 --set decoder_layers=4 --set h=8 --max-tokens 8192 --lr-scale 1.5"
  "l4d256v6k|--preset multi30k --set encoder_layers=4 --set decoder_layers=4 --vocab-size 6000"
  "l3d256d4|--preset multi30k --dropout 0.4 --set encoder_layers=3 --set decoder_layers=3 --set d_ff=2048"
)

RUNS=("${RUNS[@]:0:${NRUNS:-${#RUNS[@]}}}")
log "sweep: ${#RUNS[@]} runs x ${TIME}s on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo cpu)"
pids=()
for spec in "${RUNS[@]}"; do
  name=${spec%%|*}; opts=${spec#*|}
  rm -rf "$WORK/$name"
  # shellcheck disable=SC2086
  $AIAYN train --data "$DATA" --out "$WORK/$name" --epochs 200 --max-time "$TIME" \
      --keep-last 10 --valid-bleu-every 10 --no-progress $opts > "$WORK/$name.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
log "training done"
for spec in "${RUNS[@]}"; do name=${spec%%|*}; tail -n 3 "$WORK/$name.log" | sed "s/^/  $name: /" | tee -a "$OUT/log.txt"; done

# Average the last 5 checkpoints of each run, score on val (beam 4, alpha 0.6), in parallel.
pids=()
for spec in "${RUNS[@]}"; do
  name=${spec%%|*}
  n=$(ls -d "$WORK/$name"/checkpoints/step_* 2>/dev/null | wc -l); k=$(( n < 5 ? n : 5 ))
  ( $AIAYN average "$WORK/$name" --last "$k" --out "$WORK/$name-avg5" --force > /dev/null &&
    $AIAYN eval --backend torch --model "$WORK/$name-avg5" --data "$DATA" --split val \
      --beam 4 --alpha 0.6 --json > "$WORK/$name-avg5.val.json" 2> "$WORK/$name-avg5.err" ) &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done

best=$($PY - "$WORK" "${RUNS[@]}" <<'PYEOF'
import json, sys, pathlib
work = pathlib.Path(sys.argv[1]); scores = {}
for spec in sys.argv[2:]:
    name = spec.split("|")[0]
    f = work / f"{name}-avg5.val.json"
    if f.is_file() and f.stat().st_size:
        scores[name] = json.loads(f.read_text())["bleu"]
for n, s in sorted(scores.items(), key=lambda x: -x[1]):
    print(f"  val BLEU {s:6.2f}  {n}", file=sys.stderr)
print(max(scores, key=scores.get))
PYEOF
)
log "best on val: $best"
B="$WORK/$best-avg5"
pids=()
for split in test_2016_flickr test_2017_flickr; do
  $AIAYN eval --backend torch --model "$B" --data "$DATA" --split "$split" --beam 4 --alpha 0.6 \
      --json > "$WORK/best.$split.json" 2>/dev/null &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done

$PY - "$WORK" "$best" "$OUT" "${RUNS[@]}" <<'PYEOF'
import json, sys, pathlib
work, best, out = pathlib.Path(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
runs = {}
for spec in sys.argv[4:]:
    name, opts = spec.split("|", 1)
    rec = {"options": opts, "valid": [], "train_last": None}
    m = work / name / "metrics.jsonl"
    if m.is_file():
        for line in m.read_text().splitlines():
            r = json.loads(line)
            if r["event"] == "valid":
                rec["valid"].append({k: r.get(k) for k in ("epoch", "step", "loss", "ppl", "bleu")})
            else:
                rec["train_last"] = r
    v = work / f"{name}-avg5.val.json"
    if v.is_file() and v.stat().st_size:
        rec["avg5_val"] = {k: v_ for k, v_ in json.loads(v.read_text()).items() if k != "outputs"}
    runs[name] = rec
tests = {}
for split in ("test_2016_flickr", "test_2017_flickr"):
    f = work / f"best.{split}.json"
    if f.is_file() and f.stat().st_size:
        tests[split] = json.loads(f.read_text())
(out / "results.json").write_text(json.dumps({"best": best, "runs": runs, "test": tests}, indent=1))
PYEOF
log "$(cat "$WORK"/best.test_2016_flickr.json 2>/dev/null | grep '"bleu"')"
# Bring the chosen checkpoint back (fp32 weights in chunks under 16 MiB).
cp "$B/config.json" "$B/spm.model" "$OUT/"
split -b 15M -d -a 2 "$B/model.safetensors" "$OUT/model.safetensors.part"
log "done"
