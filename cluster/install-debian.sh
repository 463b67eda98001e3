#!/usr/bin/env bash
# Install a Debian/Ubuntu package whose command has the package's name (`prometheus`, `chromium`)
# when that command is not on PATH: cluster/install-prometheus.sh and cluster/install-chromium.sh
# call it. Otherwise it needs apt-get and root (or password-less sudo): it runs `apt-get update`
# when the package lists do not know the package yet (or the first install attempt fails), then
# `apt-get install -y --no-install-recommends PACKAGE`.
#
# A package may start a system service on machines where services start at install time; the
# install runs behind a policy-rc.d that refuses service starts (only when the machine has none of
# its own, and removed again afterwards). Nothing here enables or starts a service.
#
#   cluster/install-debian.sh PACKAGE    exit 0: PACKAGE's command is on PATH; non-zero: it is
#                                        not, with the reason on stderr
set -uo pipefail

PACKAGE="${1:?usage: install-debian.sh PACKAGE}"
say() { echo "install-${PACKAGE}: $*" >&2; }

if command -v "${PACKAGE}" >/dev/null 2>&1; then
  say "already installed: $(command -v "${PACKAGE}")"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  say "${PACKAGE} is not on PATH and this machine has no apt-get (not Debian/Ubuntu)."
  say "install it yourself and put \`${PACKAGE}\` on PATH."
  exit 1
fi

SUDO=()
if [[ "$(id -u)" != 0 ]]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
  else
    say "${PACKAGE} is not on PATH; installing it needs root (or password-less sudo):"
    say "  sudo apt-get install -y --no-install-recommends ${PACKAGE}"
    exit 1
  fi
fi

export DEBIAN_FRONTEND=noninteractive
POLICY=/usr/sbin/policy-rc.d
if [[ ! -e "${POLICY}" ]]; then
  # Debian's way to keep packages from starting services during an install; ours is temporary.
  printf '#!/bin/sh\n# install-debian.sh: no service starts during the install\nexit 101\n' |
    "${SUDO[@]}" tee "${POLICY}" >/dev/null && "${SUDO[@]}" chmod 755 "${POLICY}"
  trap '"${SUDO[@]}" rm -f "${POLICY}"' EXIT
fi

install() {
  "${SUDO[@]}" apt-get install -y --no-install-recommends "${PACKAGE}"
}

if ! apt-cache show "${PACKAGE}" >/dev/null 2>&1; then
  say "apt-get update (the package lists do not know ${PACKAGE} yet)"
  "${SUDO[@]}" apt-get update || { say "apt-get update failed (no network or no mirror?)"; exit 1; }
fi
if ! install; then
  say "install failed; refreshing the package lists and trying once more"
  "${SUDO[@]}" apt-get update || { say "apt-get update failed (no network or no mirror?)"; exit 1; }
  install || { say "apt-get install ${PACKAGE} failed (see above)"; exit 1; }
fi

if ! command -v "${PACKAGE}" >/dev/null 2>&1; then
  say "apt-get installed the package but no ${PACKAGE} is on PATH (${PATH})"
  exit 1
fi
say "installed $(command -v "${PACKAGE}"): $("${PACKAGE}" --version 2>&1 | head -n 1)"
