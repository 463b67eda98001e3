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
exec bash "$(dirname "$0")/install-debian.sh" prometheus
