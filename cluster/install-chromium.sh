#!/usr/bin/env bash
# Install Chromium (Debian's `chromium` package) for the dashboard test (tests/e2e/test_dashboard.py),
# which renders the Ray dashboard's pages in headless Chromium. Does nothing when `chromium` is
# already on PATH. Otherwise it needs apt-get and root (or password-less sudo): it runs
# `apt-get update` when the package lists do not know `chromium` yet (or the first install attempt
# fails), then `apt-get install -y --no-install-recommends chromium`.
#
#   cluster/install-chromium.sh          exit 0: `chromium` is on PATH; non-zero: it is not,
#                                        with the reason on stderr
exec bash "$(dirname "$0")/install-debian.sh" chromium
