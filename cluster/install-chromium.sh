#!/usr/bin/env bash
# Install Chromium (Debian's `chromium` package) for the dashboard test (tests/e2e/test_dashboard.py),
# which renders the Ray dashboard's pages in headless Chromium. Does nothing when `chromium` is
# already on PATH. Otherwise it needs apt-get and root (or password-less sudo): it runs
# `apt-get update` when the package lists do not know `chromium` yet (or the first install attempt
# fails), then `apt-get install -y --no-install-recommends chromium`.
#
#   cluster/install-chromium.sh          exit 0: `chromium` is on PATH; non-zero: it is not,
#                                        with the reason on stderr
set -uo pipefail

say() { echo "install-chromium: $*" >&2; }

if command -v chromium >/dev/null 2>&1; then
  say "already installed: $(command -v chromium)"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  say "chromium is not on PATH and this machine has no apt-get (not Debian/Ubuntu)."
  say "install Chromium yourself and put a \`chromium\` on PATH."
  exit 1
fi

SUDO=()
if [[ "$(id -u)" != 0 ]]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
  else
    say "chromium is not on PATH; installing it needs root (or password-less sudo):"
    say "  sudo apt-get install -y --no-install-recommends chromium"
    exit 1
  fi
fi

export DEBIAN_FRONTEND=noninteractive
install() {
  "${SUDO[@]}" apt-get install -y --no-install-recommends chromium
}

if ! apt-cache show chromium >/dev/null 2>&1; then
  say "apt-get update (the package lists do not know chromium yet)"
  "${SUDO[@]}" apt-get update || { say "apt-get update failed (no network or no mirror?)"; exit 1; }
fi
if ! install; then
  say "install failed; refreshing the package lists and trying once more"
  "${SUDO[@]}" apt-get update || { say "apt-get update failed (no network or no mirror?)"; exit 1; }
  install || { say "apt-get install chromium failed (see above)"; exit 1; }
fi

if ! command -v chromium >/dev/null 2>&1; then
  say "apt-get installed the package but no chromium is on PATH (${PATH})"
  exit 1
fi
say "installed $(command -v chromium): $(chromium --version 2>&1 | head -n 1)"
