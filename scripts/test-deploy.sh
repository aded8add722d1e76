#!/usr/bin/env bash
# The deployment test on a real Docker engine (run by scripts/test.sh after the Python tests):
# starts dockerd when no engine answers (scripts/docker-engine.sh; stopped again at the end
# only if started here), makes the images deploy/ needs where no registry is reachable
# (scripts/docker-local-images.sh: Debian 12 base by debootstrap, cached; Prometheus and HAProxy
# stand-ins from Debian packages), builds the kvq image from the binaries of BUILD_DIR
# (scripts/docker-kvq-image.sh prebuilt: no compiling inside Docker), then runs
# tests/deploy/k8s_test.py validate (deploy/k8s against the Kubernetes schemas, with the pinned
# kubernetes-validate of tests/deploy/requirements.txt, in its own venv) and
# tests/deploy/compose_test.py against the compose stack (health, router, the k8s probes, load,
# Prometheus and the dashboard's queries, down -v). The full multi-stage build of deploy/Dockerfile is not
# run here: `scripts/docker-kvq-image.sh source` (README, deployment).
# Usage: scripts/test-deploy.sh [--help] [BUILD_DIR]   (BUILD_DIR default: build)
#   Environment: KVQ_DEPLOY_TEST=0 skips it, saying so (a machine without Docker support in
#   its kernel); KVQ_PROMETHEUS_IMAGE / KVQ_HAPROXY_IMAGE run those images instead of the
#   stand-ins (official ones, when they can be pulled); KVQ_VENV as scripts/python-venv.sh;
#   KVQ_DEPLOY_VENV (default ~/.cache/kvq/deploy-venv); KVQ_DOCKER (default /usr/bin/docker).
# Exit 0 pass, 1 fail.
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
cd "$(dirname "$0")/.."
BUILD="${1:-build}"
log() { echo "test-deploy: $*" >&2; }
if [[ "${KVQ_DEPLOY_TEST:-1}" == 0 ]]; then log "SKIPPED (KVQ_DEPLOY_TEST=0)"; exit 0; fi
[[ -x "$BUILD/bin/kvq" ]] || { log "no kvq in $BUILD/bin (build first: scripts/test.sh)"; exit 1; }
start=$(date +%s)
stamp() { log "$1 ($(($(date +%s) - start)) s)"; }

bash scripts/install-deps.sh
export KVQ_DOCKER="${KVQ_DOCKER:-/usr/bin/docker}"
# Debian's docker client first: docker-compose 1.29 runs `docker` for some commands, and a
# newer client elsewhere in PATH may lack what Debian's engine expects.
export PATH="$(dirname "$KVQ_DOCKER"):$PATH"
state="$(mktemp -d)"
trap 'bash scripts/docker-engine.sh stop "$state/engine" || true; rm -rf "$state"' EXIT
bash scripts/docker-engine.sh start "$state/engine"
stamp "engine answers"
bash scripts/docker-local-images.sh all
stamp "base and stand-in images present"
export KVQ_IMAGE=kvq:deploy-test
bash scripts/docker-kvq-image.sh --tag "$KVQ_IMAGE" prebuilt "$BUILD"
stamp "kvq image built"
export KVQ_PROMETHEUS_IMAGE="${KVQ_PROMETHEUS_IMAGE:-kvq-standin/prometheus:2.42}"
export KVQ_HAPROXY_IMAGE="${KVQ_HAPROXY_IMAGE:-kvq-standin/haproxy:2.6}"

# The kvq Python package in the tests' venv (as scripts/test-python.sh installs it; a no-op
# when that already ran).
VENV="$(bash scripts/python-venv.sh)"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/kvq/ccache}" CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/python" -m pip install -q --no-build-isolation \
  --no-deps -e client/python
# The deployment test's own tools (kubernetes-validate), in a venv of their own.
DEPLOY_VENV="$(bash scripts/python-venv.sh --venv "${KVQ_DEPLOY_VENV:-$HOME/.cache/kvq/deploy-venv}" \
               --requirements tests/deploy/requirements.txt)"
rc=0
"$DEPLOY_VENV/bin/python" tests/deploy/k8s_test.py validate || rc=$?
"$VENV/bin/python" tests/deploy/compose_test.py --kvq-bin "$BUILD/bin/kvq" \
  --k8s-python "$DEPLOY_VENV/bin/python" || rc=$?
"$KVQ_DOCKER" rmi "$KVQ_IMAGE" >/dev/null 2>&1 || true
stamp "exit $rc"
exit $rc
