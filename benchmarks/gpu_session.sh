#!/usr/bin/env bash
# The GPU measurements owed by the bench, profile/doctor and scale-out issues, in parts that each fit
# one device call (< 10 minutes on one H100). Run from the repository root on the GPU machine:
#
#   TOKENMILL_GIT_COMMIT=<commit> bash benchmarks/gpu_session.sh PART OUT_DIR
#
# PART: check | best | rasbt | book-perf | memory | memory-ladder | profile ; OUT_DIR: where results go ($OUT on the
# device machine); copy them to benchmarks/results/<date>-<gpu>/ and commit. SMOKE=1 runs every part
# with tiny shapes on any machine (how CI-less checks of this script are done on a CPU).
# The device image lacks tomli-w: carry its wheel in .device-wheels/ (see benchmarks/README.md).
set -euo pipefail
PART=${1:?part: check, best, rasbt, book-perf, memory, memory-ladder or profile}
OUT=${2:?output directory}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if compgen -G ".device-wheels/*.whl" >/dev/null; then
    $PY -m pip install -q --no-deps --no-index .device-wheels/*.whl
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TOKENMILL_CACHE="${TOKENMILL_CACHE:-/tmp/tokenmill-cache}"
tm() { $PY -m tokenmill "$@"; }
SMOKE_FLAG=()
[ "${SMOKE:-0}" = 1 ] && SMOKE_FLAG=(--smoke)
# tiny shapes for SMOKE=1 runs of the train/profile/max-model parts
TINY=()
[ "${SMOKE:-0}" = 1 ] && TINY=(--model.n_layer 2 --model.n_head 2 --model.n_embd 64 --model.block_size 64
                              --train.batch_size 2)

ladder() {  # ladder NAME: run it into OUT/NAME (ladder.json, ladder.md, ladder.png)
    tm bench ladder "$1" --out "$OUT/$1" --quiet "${SMOKE_FLAG[@]}" || true  # failed rungs are in the table
}

case "$PART" in
check)
    nvidia-smi || true
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
            torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
    # the whole suite on this torch, CUDA-only tests included
    $PY -m pytest -q -x -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest.txt" | tail -15
    ;;
best | rasbt | book-perf) ladder "$PART" ;;
memory-ladder) ladder memory ;;  # the memory ladder alone, when the memory part does not fit one call
memory)
    ladder book-memory
    ladder memory
    tm train --preset gpt2-large --config benchmarks/configs/book-memory-5gb.toml \
        --run-dir "$OUT/book-memory-5gb" --log.progress plain "${TINY[@]}"
    $PY - "$OUT/book-memory-5gb" <<'PYEOF'  # summary + config + GPU/torch/CUDA/date/commit in one JSON
import json, sys, tomllib
from pathlib import Path
from tokenmill.bench.env import probe_environment
run = Path(sys.argv[1])
doc = {"kind": "train", "summary": json.loads((run / "summary.json").read_text()),
       "config": tomllib.loads((run / "config.toml").read_text()), "environment": probe_environment()}
(run.parent / f"{run.name}.json").write_text(json.dumps(doc, indent=2))
PYEOF
    rm -rf "$OUT/book-memory-5gb/checkpoints"
    MAXP=()
    [ "${SMOKE:-0}" = 1 ] && MAXP=(--shapes "a:2:2:64,b:2:2:128" --model.vocab_size 256)
    tm bench max-model --config benchmarks/configs/max-model-memory.toml --run-dir "$OUT/max-model" \
        --probe-steps 3 --timeout 240 "${MAXP[@]}" || true
    ;;
profile)
    # the gpt2-124m preset as it is (baseline), then the fastest rung of a `best` ladder run
    BEST_JSON=${BEST_JSON:-$OUT/best/ladder.json}
    tm profile --preset gpt2-124m --data.source synthetic --model.vocab_size 50257 \
        --run-dir "$OUT/profile-baseline" --quiet "${TINY[@]}"
    if [ -f "$BEST_JSON" ]; then
        $PY - "$BEST_JSON" "$OUT/fastest.toml" <<'PYEOF' || true
import json, sys
from tokenmill import config as C
doc = json.load(open(sys.argv[1]))
ok = [r for r in doc["rungs"] if r["status"] == "measured" and (r.get("summary") or {}).get("tokens_per_sec")]
if not ok:
    sys.exit("no measured rung in the best ladder: no fastest profile")
best = max(ok, key=lambda r: r["summary"]["tokens_per_sec"])
cfg = C.from_dict(best["config"])
cfg.checkpoint.save_final = False
C.save(cfg, sys.argv[2])
print(f"fastest rung: {best['name']} ({best['summary']['tokens_per_sec']:,.0f} tokens/s)")
PYEOF
        [ -f "$OUT/fastest.toml" ] && tm profile --config "$OUT/fastest.toml" --run-dir "$OUT/profile-fastest" \
            --quiet "${TINY[@]}"
    fi
    for d in "$OUT"/profile-*; do
        tm doctor "$d" | tee "$d/doctor.txt"
        tm doctor --json "$d" > "$d/doctor.json"
        rm -rf "$d/checkpoints" "$d/tensorboard"
        find "$d" -name "*.json" -size +20M -delete  # traces too large to commit
    done
    ;;
*) echo "unknown part '$PART'" >&2; exit 2 ;;
esac
echo "done: $PART -> $OUT"
