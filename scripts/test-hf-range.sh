#!/usr/bin/env bash
# The ends of the transformers range kvq.hf declares (client/python/pyproject.toml's [hf] extra),
# beyond the pinned version the test command runs: a venv per end, each the test venv's pins
# (client/python/requirements-test.txt) with transformers replaced and without lmcache (whose pins
# bound transformers), then kvq.hf's tests and the
# calibration tests against the built server. A scheduled check (docs/CI.md), not part of
# scripts/test.sh: "newest" follows PyPI, so its result can change without a commit.
# Usage: scripts/test-hf-range.sh [--help] [BUILD] [oldest|newest|both]   (default build, both)
# Environment: KVQ_HF_OLDEST (default: the [hf] extra's lower bound), KVQ_HF_VENVS (default
# ~/.cache/kvq). Exit: 0 every end passed, 1 a test failed, 2 bad usage or no server built.
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,9p' "$0" | sed 's/^# //'; exit 0; fi
cd "$(dirname "$0")/.."
BUILD="${1:-build}"
ENDS="${2:-both}"
case "$ENDS" in oldest) ENDS="oldest" ;; newest) ENDS="newest" ;; both) ENDS="oldest newest" ;;
  *) echo "test-hf-range: the end must be oldest, newest or both (got '$ENDS')" >&2; exit 2 ;; esac
SERVER_BIN="$(cd "$BUILD" 2>/dev/null && pwd)/bin/kvq-server" || true
if [[ ! -x "$SERVER_BIN" ]]; then
  echo "test-hf-range: no kvq-server in $BUILD/bin (build first: scripts/test.sh)" >&2
  exit 2
fi
REQ=client/python/requirements-test.txt
# The lower bound the [hf] extra declares, e.g. "transformers>=5.23,<6" -> 5.23.
declared="$(grep -o '"transformers>=[^",]*' client/python/pyproject.toml | head -1 | cut -d'=' -f2)"
oldest="${KVQ_HF_OLDEST:-$declared}"
# The newest 5.x release on the index.
newest="$(python3 -m pip index versions transformers 2>/dev/null |
  grep -o 'Available versions: .*' | tr -d ',' | tr ' ' '\n' | grep -E '^5\.' | head -1)"
if [[ -z "$newest" ]]; then echo "test-hf-range: cannot read transformers' versions from the index" >&2; exit 2; fi
rc=0
for end in $ENDS; do
  version="$oldest"; [[ "$end" == newest ]] && version="$newest"
  venv="${KVQ_HF_VENVS:-$HOME/.cache/kvq}/venv-hf-$end"
  req="$(mktemp)"
  # lmcache is left out: its pins bound transformers, and the LMCache plugin is not under test.
  sed "s/^transformers==.*/transformers==$version/; /^lmcache==/d" "$REQ" > "$req"
  echo "test-hf-range: $end end, transformers $version ($venv)" >&2
  bash scripts/python-venv.sh --venv "$venv" --requirements "$req" >/dev/null
  rm -f "$req"
  "$venv/bin/python" -m pip install -q --no-build-isolation --no-deps -e client/python
  set +e
  KVQ_SERVER_BIN="$SERVER_BIN" KVQ_BUILD_DIR="$(cd "$BUILD" && pwd)" "$venv/bin/python" -m pytest \
    client/python/tests/test_hf_attention.py client/python/tests/test_hf_units.py \
    client/python/tests/test_calibrate.py -q -p no:cacheprovider
  end_rc=$?
  set -e
  echo "test-hf-range: $end end (transformers $version): pytest exit $end_rc" >&2
  [[ $end_rc -ne 0 ]] && rc=1
done
exit $rc
