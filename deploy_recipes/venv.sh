#!/usr/bin/env bash
# Make (or reuse) the project's virtual environment, .venv at the top of the
# checkout, and install the project into it (editable) with the extras named:
#   bash deploy_recipes/venv.sh            # then: .venv/bin/tether demo
#   bash deploy_recipes/venv.sh test       # with the test extras too
# Debian and Ubuntu mark their system Python as externally managed (PEP 668):
# pip refuses to install into it, and a virtual environment is the way they
# ask for. PYTHON picks the interpreter (default python3, 3.9 or newer).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=.venv

if ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
  rm -rf "$venv"
  echo "making the virtual environment $(pwd)/$venv"
  if ! "$python" -m venv "$venv" >/dev/null 2>&1; then
    rm -rf "$venv"
    # Debian ships venv's pip bootstrap (ensurepip) in its own package.
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "installing Debian's python3-venv"
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
      "$python" -m venv "$venv"
    elif "$python" -m pip --version >/dev/null 2>&1 \
        && "$python" -m venv --without-pip "$venv" \
        && "$python" -m pip --disable-pip-version-check -q --python "$venv/bin/python" install pip; then
      :  # the system's pip put pip into the environment
    else
      rm -rf "$venv"
      echo "error: $python cannot make a virtual environment here (no ensurepip, no usable pip)." >&2
      echo "Install it with 'sudo apt install python3-venv' (Debian, Ubuntu) and run this again." >&2
      exit 1
    fi
  fi
fi

spec="."
if [ $# -gt 0 ]; then
  spec=".[$(IFS=,; echo "$*")]"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$spec"
echo "tether is installed in $(pwd)/$venv: run $venv/bin/tether (or 'source $venv/bin/activate' first)"
