#!/bin/sh
# `echo2-worker join "$@"` with the provider token from WORKER_PROVIDER_TOKEN, else from the file the
# compose `provision` service writes. After the first join the worker's own credentials, saved under
# the config dir on the worker's volume, are enough: a restart re-joins as the same worker.
set -eu
config_dir="${WORKER_CONFIG_DIR:-/var/lib/echo2-worker/config}"
token="${WORKER_PROVIDER_TOKEN:-}"
token_file="${WORKER_PROVIDER_TOKEN_FILE:-/run/echo2/provider/token}"
if [ -z "$token" ] && [ -r "$token_file" ]; then
    token="$(cat "$token_file")"
fi
case "${1:-}" in
    -h|--help) exec echo2-worker join --help ;;
esac
if [ -n "$token" ]; then
    export ECHO2_PROVIDER_TOKEN="$token"  # not --token: arguments show in the process list
fi
exec echo2-worker --config-dir "$config_dir" join "$@"
