#!/usr/bin/env bash
# Start a one-machine Ray head for rayjobs with everything on loopback (127.0.0.1): the GCS, the
# dashboard (job submission API, 8265) and the metrics export (8080) that Prometheus scrapes.
# Nothing listens on another interface, so nothing here is reachable from the network, and no
# other machine can join: for more machines, see cluster/README.md (KubeRay, cluster launcher).
#
#   cluster/start-head.sh [extra `ray start` options ...]   e.g. --object-store-memory=4000000000
#   ray stop                                                   stops it (and every Ray on this machine)
#
# Environment (all optional):
#   RAYJOBS_HEAD_PORT (6379), RAYJOBS_DASHBOARD_PORT (8265), RAYJOBS_METRICS_PORT (8080)
#   RAYJOBS_NUM_CPUS      logical CPUs; default max(4, 2 x cores), as the embedded Ray of
#                         `rayjobs run` (README, "Resources"): with only as many logical CPUs as
#                         cores, trainers and data operators starve each other.
#   RAY_PROMETHEUS_HOST   where the dashboard queries Prometheus   (http://127.0.0.1:9090)
#   RAY_GRAFANA_HOST      where the dashboard reaches Grafana      (http://127.0.0.1:3000)
#   RAY_GRAFANA_IFRAME_HOST  Grafana URL your browser uses for the embedded panels
#                         (default: RAY_GRAFANA_HOST)
# The dashboard reads the three RAY_* settings once, when it starts: change them, then restart.
#
# Token authentication is left to Ray: `ray start` turns it on when a token exists
# (~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH) or RAY_AUTH_MODE=token is set. This
# script never sets RAY_AUTH_MODE. To turn it on: `ray get-auth-token --generate`, then rerun.
set -euo pipefail

HOST=127.0.0.1
# `ray start` replaces a loopback --node-ip-address with the machine's routable IP, and then binds
# the GCS, raylet and metrics export on every interface. Ray's single-machine mode (the default on
# macOS and Windows) keeps the node IP on loopback instead, so everything binds to 127.0.0.1.
# A driver started outside the cluster must use the same mode to connect (printed below);
# `ray job submit` drivers inherit it.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
PORT="${RAYJOBS_HEAD_PORT:-6379}"
DASHBOARD_PORT="${RAYJOBS_DASHBOARD_PORT:-8265}"
METRICS_PORT="${RAYJOBS_METRICS_PORT:-8080}"
CORES="$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)"
NUM_CPUS="${RAYJOBS_NUM_CPUS:-$((2 * CORES > 4 ? 2 * CORES : 4))}"

export RAY_PROMETHEUS_HOST="${RAY_PROMETHEUS_HOST:-http://${HOST}:9090}"
export RAY_GRAFANA_HOST="${RAY_GRAFANA_HOST:-http://${HOST}:3000}"
export RAY_GRAFANA_IFRAME_HOST="${RAY_GRAFANA_IFRAME_HOST:-${RAY_GRAFANA_HOST}}"

ray start --head \
  --node-ip-address="${HOST}" \
  --port="${PORT}" \
  --include-dashboard=true \
  --dashboard-host="${HOST}" \
  --dashboard-port="${DASHBOARD_PORT}" \
  --metrics-export-port="${METRICS_PORT}" \
  --num-cpus="${NUM_CPUS}" \
  --disable-usage-stats \
  "$@"

# The mode the head started in, decided the way `ray start` decides it.
if [[ -n "${RAY_AUTH_MODE:-}" ]]; then
  AUTH_MODE="${RAY_AUTH_MODE}"
elif [[ -n "${RAY_AUTH_TOKEN:-}" || -s "${RAY_AUTH_TOKEN_PATH:-${HOME}/.ray/auth_token}" ]]; then
  AUTH_MODE=token
else
  AUTH_MODE=disabled
fi

cat <<INFO

rayjobs head is up (everything on ${HOST}):
  Ray address     ${HOST}:${PORT}
  Dashboard       http://${HOST}:${DASHBOARD_PORT}
  Metrics export  http://${HOST}:${METRICS_PORT}/metrics   (this node; every node is listed in
                  /tmp/ray/prom_metrics_service_discovery.json)
  Token auth      ${AUTH_MODE}

Run a job (from the repository root):
  rayjobs submit configs/demo.yaml --address http://${HOST}:${DASHBOARD_PORT}
  (Ray's CLI works too: ray job submit --address http://${HOST}:${DASHBOARD_PORT} --working-dir . -- rayjobs run configs/demo.yaml --json)
  or, with the driver in this shell (single-machine mode, as the head):
  RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 rayjobs run configs/demo.yaml --address ${HOST}:${PORT}
INFO
if [[ "${AUTH_MODE}" == token ]]; then
  cat <<INFO
  Clients need the head's auth mode: export RAY_AUTH_MODE=token
  (the token is read from ~/.ray/auth_token, or RAY_AUTH_TOKEN; \`ray get-auth-token\` prints it).
INFO
fi
cat <<INFO

Metrics (cluster/README.md has the details):
  prometheus --config.file=cluster/prometheus.yml        (scrapes every node via the file above)
  The dashboard looks for Prometheus at ${RAY_PROMETHEUS_HOST}
  and Grafana at ${RAY_GRAFANA_HOST} (browser: ${RAY_GRAFANA_IFRAME_HOST}).
  To use others, set RAY_PROMETHEUS_HOST, RAY_GRAFANA_HOST, RAY_GRAFANA_IFRAME_HOST, then
  \`ray stop\` and rerun this script.
  Grafana: copy cluster/grafana/rayjobs.json into /tmp/ray/session_latest/metrics/grafana/dashboards/
  and start Grafana with --config /tmp/ray/session_latest/metrics/grafana/grafana.ini.

Stop: ray stop   (stops every Ray process on this machine)
INFO
