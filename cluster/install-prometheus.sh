#!/usr/bin/env bash
# Install Prometheus (Debian/Ubuntu's `prometheus` package) for the metrics test
# (tests/test_prometheus.py) and for cluster/prometheus.yml. Does nothing when `prometheus` is
# already on PATH. Otherwise it needs apt-get and root (or password-less sudo): it runs
# `apt-get update` when the package lists do not know `prometheus` yet (or the first install
# attempt fails), then `apt-get install -y --no-install-recommends prometheus`.
#
# The package would start a system service on machines where services start at install time; the
# install runs behind a policy-rc.d that refuses service starts (only when the machine has none of
# its own, and removed again afterwards). The test runs its own `prometheus` process with its own
# config, storage and loopback port; nothing here enables or starts a service.
#
#   cluster/install-prometheus.sh        exit 0: `prometheus` is on PATH; non-zero: it is not,
#                                        with the reason on stderr
set -uo pipefail

say() { echo "install-prometheus: $*" >&2; }

if command -v prometheus >/dev/null 2>&1; then
  say "already installed: $(command -v prometheus)"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  say "prometheus is not on PATH and this machine has no apt-get (not Debian/Ubuntu)."
  say "install Prometheus 2.x yourself (https://prometheus.io/download/) and put it on PATH."
  exit 1
fi

SUDO=()
if [[ "$(id -u)" != 0 ]]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
  else
    say "prometheus is not on PATH; installing it needs root (or password-less sudo):"
    say "  sudo apt-get install -y --no-install-recommends prometheus"
    exit 1
  fi
fi

export DEBIAN_FRONTEND=noninteractive
POLICY=/usr/sbin/policy-rc.d
if [[ ! -e "${POLICY}" ]]; then
  # Debian's way to keep packages from starting services during an install; ours is temporary.
  printf '#!/bin/sh\n# install-prometheus.sh: no service starts during the install\nexit 101\n' |
    "${SUDO[@]}" tee "${POLICY}" >/dev/null && "${SUDO[@]}" chmod 755 "${POLICY}"
  trap '"${SUDO[@]}" rm -f "${POLICY}"' EXIT
fi

install() {
  "${SUDO[@]}" apt-get install -y --no-install-recommends prometheus
}

if ! apt-cache show prometheus >/dev/null 2>&1; then
  say "apt-get update (the package lists do not know prometheus yet)"
  "${SUDO[@]}" apt-get update || { say "apt-get update failed (no network or no mirror?)"; exit 1; }
fi
if ! install; then
  say "install failed; refreshing the package lists and trying once more"
  "${SUDO[@]}" apt-get update || { say "apt-get update failed (no network or no mirror?)"; exit 1; }
  install || { say "apt-get install prometheus failed (see above)"; exit 1; }
fi

if ! command -v prometheus >/dev/null 2>&1; then
  say "apt-get installed the package but no prometheus is on PATH (${PATH})"
  exit 1
fi
say "installed $(command -v prometheus): $(prometheus --version 2>&1 | head -n 1)"
