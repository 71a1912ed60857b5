#!/usr/bin/env bash
# The GPU measurements owed by the bench, memory, profile/doctor, GPU and model-family issues, in parts
# that each fit one call on the lent machine (each part ends within 9 minutes; the call's limit is 10).
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
# The device image lacks tomli-w: carry its wheel in .device-wheels/ (see benchmarks/README.md).
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
cd "$ROOT"
export TOKENMILL_GIT_COMMIT=$COMMIT
export TOKENMILL_CACHE="${TOKENMILL_CACHE:-/tmp/tokenmill-cache}"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import tomli_w" 2>/dev/null; then
    if compgen -G ".device-wheels/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-deps --no-index --no-compile --target /tmp/tokenmill-wheels .device-wheels/*.whl
        export PYTHONPATH="$PYTHONPATH:/tmp/tokenmill-wheels"
    else
        echo "gpu_session.sh: tomli-w is missing; carry its wheel in .device-wheels/ (benchmarks/README.md)" >&2
        exit 2
    fi
fi
exec "$PY" benchmarks/session.py "$PART" "$OUT" --commit "$COMMIT"
