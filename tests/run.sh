#!/usr/bin/env bash
# Set up this machine for the test suite and run it: the README's test command.
#   bash tests/run.sh [pytest args...]
# It makes (or reuses) the project's virtual environment .venv with the test
# extras (deploy_recipes/venv.sh) and runs pytest from it. As root it also
# installs the Debian packages the emulated-ARM, SSH and farm-page tests need; as another
# user those tests skip with a message naming what to install.
# The whole emulated model zoo is left out unless --full-zoo is given:
#   bash tests/run.sh --full-zoo tests/test_zoo_emulated.py
# and so are all 2,001 onnx node cases unless --node-suite is given (the default
# run takes a few per op):
#   bash tests/run.sh --node-suite tests/test_onnx_node_suite.py
set -euo pipefail
cd "$(dirname "$0")/.."

debian_packages=(gcc qemu-user debootstrap fakeroot openssh-server openssh-client gcc-aarch64-linux-gnu gcc-arm-linux-gnueabihf libc6-dev-arm64-cross libc6-dev-armhf-cross chromium fonts-dejavu-core postgresql)
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

bash deploy_recipes/venv.sh test
exec .venv/bin/python -m pytest "$@"
