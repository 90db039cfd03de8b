#!/usr/bin/env bash
# Set up this machine for the test suite and run it: the README's test command.
#   bash tests/run.sh [pytest args...]
# As root it installs the Debian packages the emulated-ARM tests need; as
# another user those tests skip with a message naming what to install.
set -euo pipefail
cd "$(dirname "$0")/.."

debian_packages=(gcc qemu-user debootstrap openssh-server openssh-client gcc-aarch64-linux-gnu gcc-arm-linux-gnueabihf libc6-dev-arm64-cross libc6-dev-armhf-cross)
missing=()
for p in "${debian_packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "note: not installing ${missing[*]} (needs root and apt-get); their tests will skip"
  fi
fi

python3 -m pip install -q --disable-pip-version-check -e '.[test]'
exec python3 -m pytest "$@"
