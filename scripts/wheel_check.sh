#!/usr/bin/env bash
# The package as a user installs it without cloning (issue 71): the wheel built from this checkout, installed
# into a new virtual environment from the lock with the framework extras (no SmolLM2: the default needs
# none), then run from another folder: the demo's first question, and the README's Python blocks (the
# first example, LlamaIndex, LangChain), each in a fresh process, each checked for the answer it must print.
#   bash scripts/wheel_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip wheel -q --no-deps -w "$work/dist" .
python3 -m venv "$work/env"
# shellcheck disable=SC1091
source "$work/env/bin/activate"
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q torch==2.13.0
wheel=$(ls "$work"/dist/cacheclip_rag-*.whl)
python3 -m pip install -q -c "$root/requirements.lock" "$wheel[llamaindex,langchain]"
cd "$work"  # outside the checkout: nothing of it on the path
python3 -c "import cacheclip_rag, sys; assert not cacheclip_rag.__file__.startswith('$root'), cacheclip_rag.__file__"
cacheclip demo --questions 1 --methods full,cacheclip | tee "$work/demo.txt"
grep -qE "^full .* \+ '" "$work/demo.txt" || { echo "wheel_check: full attention missed the demo's first answer" >&2; exit 1; }
python3 - "$root/README.md" <<'EOF'
import re
import subprocess
import sys

readme = open(sys.argv[1]).read()
first = re.search(r"## Use it from Python.*?```python\n(.*?)```", readme, re.S).group(1)
named = {name: re.search(rf"<!-- snippet: {name}[^>]*-->\n```python\n(.*?)```", readme, re.S).group(1)
         for name in ("llamaindex", "langchain")}
for name, code, answer in (("first example", first, "7:40"), ("llamaindex", named["llamaindex"], "7:40"),
                           ("langchain", named["langchain"], "1871")):
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    print(f"wheel_check: {name}: rc {done.returncode}: {done.stdout.strip()[:200]!r}")
    if done.returncode != 0 or answer not in done.stdout:
        sys.exit(f"wheel_check: the README's {name} block did not print {answer!r}:\n{done.stderr[-2000:]}")
EOF
echo "wheel_check: the wheel installs and runs from outside the checkout"
