#!/usr/bin/env bash
# Run the fast test suite against the oldest supported transformers (5.17, the GPU machine's) in a
# second environment: a venv that sees this machine's packages but overrides transformers.
#   bash scripts/test_transformers_min.sh [VERSION] [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-5.17.0}
shift || true
venv=${CACHECLIP_MIN_VENV:-/tmp/cacheclip-transformers-$version}
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv --system-site-packages "$venv"
fi
"$venv/bin/python" -m pip install -q "transformers==$version"
"$venv/bin/python" -c "import transformers; print('transformers', transformers.__version__)"
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(-q -m "not slow and not gpu" tests)
exec "$venv/bin/python" -m pytest -p no:cacheprovider "${args[@]}"
