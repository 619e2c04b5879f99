#!/usr/bin/env bash
# Run the whole test suite: lint, type check, package import contracts, the docs site
# (mkdocs build --strict), then pytest. Tests start their own services (mooncake_master,
# yuanrong worker, real vLLM engines) on 127.0.0.1 and stop them.
set -euo pipefail
cd "$(dirname "$0")/.."
export MC_TCP_BIND_ADDRESS=127.0.0.1
# The SSH triage tests log in to a real sshd on 127.0.0.1 (only the tests need it, not the demo).
if [ ! -x /usr/sbin/sshd ]; then
    printf '==> apt: installing openssh-server (sshd for the SSH triage tests)\n'
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openssh-server >/dev/null
fi
printf '\n==> ruff\n';  .venv/bin/ruff check kvpool_connector kvpool_agent kvpool_console kvpool_config kvpool_replay kvpool_policy tests bench scripts setup.py
printf '\n==> mypy\n';  .venv/bin/mypy
printf '\n==> import contracts\n';  .venv/bin/lint-imports
# The docs site: a broken link, a missing snippet or a page left out of the nav fails here
# (not --quiet: mkdocs then hides the warnings --strict counts).
printf '\n==> mkdocs\n'
DOCS_SITE=$(mktemp -d)
docs_rc=0
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$DOCS_SITE" || docs_rc=$?
rm -rf "$DOCS_SITE"
[ "$docs_rc" -eq 0 ] || exit "$docs_rc"
printf '\n==> pytest\n'
# Three workers, each test file whole on one (its module fixtures: hubs, masters, fleets): the
# serial suite kept the 2 cores 20-30% busy, waiting on real services. A short --basetemp: a
# worker's tmp_path gains "popen-gwN/", and a Unix socket path holds 107 bytes.
BASETEMP=$(mktemp -d /tmp/kvt.XXXXXX)
rc=0
.venv/bin/python -m pytest -p no:cacheprovider -ra --durations=15 -n "${KVPOOL_TEST_WORKERS:-3}" \
    --dist loadfile --basetemp="$BASETEMP" "$@" || rc=$?
rm -rf "$BASETEMP"
exit "$rc"
