#!/usr/bin/env bash
# Run Prometheus for a head started by cluster/start-head.sh: cluster/prometheus.yml (every node
# found through Ray's service-discovery file, scraped every 5 s), listening on loopback only. The
# head's dashboard queries it (start-head.sh sets RAY_PROMETHEUS_HOST=http://127.0.0.1:9090), so
# the job page's Ray Data Overview fills in its columns; its own graph page plots the rayjobs
# series (docs/metrics.md, "Prometheus without Grafana"). No Grafana needed.
#
#   cluster/start-prometheus.sh [extra prometheus options ...]     runs in the foreground
#
# Environment (all optional):
#   RAYJOBS_PROMETHEUS_PORT (9090)
#   RAYJOBS_PROMETHEUS_DATA  where Prometheus keeps its samples (/tmp/rayjobs-prometheus)
set -euo pipefail

if ! command -v prometheus >/dev/null 2>&1; then
  echo "start-prometheus: no prometheus on PATH; run cluster/install-prometheus.sh first" >&2
  exit 1
fi
HERE="$(cd "$(dirname "$0")" && pwd)"
exec prometheus \
  --config.file="${HERE}/prometheus.yml" \
  --web.listen-address="127.0.0.1:${RAYJOBS_PROMETHEUS_PORT:-9090}" \
  --storage.tsdb.path="${RAYJOBS_PROMETHEUS_DATA:-/tmp/rayjobs-prometheus}" \
  "$@"
