#!/usr/bin/env bash
# The GPU measurements owed by the bench, memory, profile/doctor, GPU and model-family issues, in parts
# that each fit one call on the lent machine (a loan is 15 minutes with its start-up, a call at most 10: each
# part takes about 7 minutes at most; `first` and `cuda-tier` together fit one loan).
# From the repository root, on the GPU machine:
#
#   bash benchmarks/gpu_session.sh --list                 # the parts, in order of value
#   bash benchmarks/gpu_session.sh PART "$OUT" COMMIT      # one part; COMMIT: the literal commit hash
#
# A part leaves at most 8 files of at most 16 MiB directly in OUT (PART.json manifest, PART.log,
# PART-details.tar.gz, up to 5 result files); copy them to benchmarks/results/<date>-<gpu>/ and commit.
# The commit is an argument because the device has no .git: type the hash into the device command
# (bash benchmarks/gpu_session.sh best "$OUT" 3052265...), never a $(git ...) that the device expands.
# SMOKE=1 runs a part with tiny shapes on any machine (how the script is checked on a CPU).
# Runs on the device image as it is (torch, no tomli-w, no torchao, no network): nothing to carry.
# SIGINT/SIGTERM end a part cleanly with its files (exit 130/143); the manifest is rewritten after every step.
set -euo pipefail
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ "${1:-}" = "--list" ] || [ "${1:-}" = "-l" ]; then
    exec "$PY" "$ROOT/benchmarks/session.py" --list
fi
PART=${1:?"part (bash benchmarks/gpu_session.sh --list shows them)"}
OUT=${2:?"output directory (\$OUT on the device)"}
COMMIT=${3:-${TOKENMILL_GIT_COMMIT:-}}
if [ -z "$COMMIT" ]; then
    if git -C "$ROOT" rev-parse HEAD >/dev/null 2>&1; then
        COMMIT=$(git -C "$ROOT" rev-parse HEAD)
    else
        echo "gpu_session.sh: give the commit as the third argument (this copy has no .git)" >&2
        exit 2
    fi
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# a whole manifest from the first moment (the part rewrites it as soon as it starts, then after every step)
if [[ "$PART" =~ ^[a-z0-9-]+$ && "$COMMIT" =~ ^[0-9A-Za-z._-]+$ ]]; then
    printf '{"part": "%s", "commit": "%s", "date": "%s", "stopped_by": "a signal before the part started", "steps": []}\n' \
        "$PART" "$COMMIT" "$(date -u +%Y-%m-%dT%H:%M:%S+0000)" > "$OUT/.$PART.json.start" && mv -f "$OUT/.$PART.json.start" "$OUT/$PART.json"
fi
cd "$ROOT"
export TOKENMILL_GIT_COMMIT=$COMMIT
export TOKENMILL_CACHE="${TOKENMILL_CACHE:-/tmp/tokenmill-cache}"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" benchmarks/session.py "$PART" "$OUT" --commit "$COMMIT"
