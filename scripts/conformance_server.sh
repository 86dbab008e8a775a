# Sourced by scripts/e2b_conformance.sh and scripts/e2b_js_conformance.sh: a fresh
# `aenv server` for one run of an upstream E2B SDK test suite.
#
#   conformance_server_start LABEL AENV WORK PORT WANT_HOSTS
#
# starts AENV (the repo's aenv) on 127.0.0.1:PORT with a data dir made under WORK
# (removed with the server when the calling script exits), waits for the E2B_*
# variables it prints and exports them. With WANT_HOSTS=1, openssl and port 443
# free, the server also gets [server] domain aenv.test and a self-signed wildcard
# certificate on port 443, so https://{get_host(port)} works once the test process
# trusts $conformance_cert and resolves *.aenv.test to 127.0.0.1 (each suite does
# that its own way). Sets: conformance_hosts (0 or 1), conformance_domain,
# conformance_cert, conformance_log.

conformance_server_pid=""
conformance_data=""

conformance_server_stop() {
    if [[ -n "$conformance_server_pid" ]] && kill -0 "$conformance_server_pid" 2>/dev/null; then
        kill -TERM "$conformance_server_pid"
        for _ in $(seq 1 120); do kill -0 "$conformance_server_pid" 2>/dev/null || break; sleep 0.5; done
        kill -KILL "$conformance_server_pid" 2>/dev/null || true
    fi
    [[ -z "$conformance_data" ]] || rm -rf "$conformance_data"
}

conformance_server_start() {
    local label=$1 aenv=$2 work=$3 port=$4 want_hosts=$5
    conformance_data=$(mktemp -d "$work/data.XXXXXX")
    conformance_log="$work/server.log"
    conformance_domain=aenv.test
    conformance_cert="$conformance_data/tls.pem"
    conformance_hosts=0
    trap conformance_server_stop EXIT
    local server_env=()
    if [[ "$want_hosts" == 1 ]] && command -v openssl >/dev/null \
        && python3 -c 'import socket; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", 443))' 2>/dev/null; then
        openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
            -subj "/CN=*.$conformance_domain" -addext "subjectAltName=DNS:*.$conformance_domain,DNS:$conformance_domain" \
            -keyout "$conformance_data/tls.key" -out "$conformance_cert" 2>/dev/null
        server_env=(AENV_SERVER__DOMAIN="$conformance_domain" AENV_SERVER__TLS_CERT="$conformance_cert"
                    AENV_SERVER__TLS_KEY="$conformance_data/tls.key" AENV_SERVER__TLS_PORT=443)
        conformance_hosts=1
    else
        echo "$label: no host names over TLS (turned off, no openssl, or port 443 taken): the tests that fetch get_host() fail or are left out"
    fi
    echo "$label: starting aenv server on 127.0.0.1:$port (log: $conformance_log)"
    env "${server_env[@]}" "$aenv" server --data-dir "$conformance_data" --port "$port" \
        >"$work/server.out" 2>"$conformance_log" &
    conformance_server_pid=$!
    for _ in $(seq 1 900); do
        # the variables are written in one go, the last one ends the block
        grep -q '^export E2B_SANDBOX_URL=' "$work/server.out" 2>/dev/null && break
        kill -0 "$conformance_server_pid" 2>/dev/null \
            || { echo "$label: aenv server exited; see $conformance_log" >&2; exit 1; }
        sleep 1
    done
    grep -q '^export E2B_SANDBOX_URL=' "$work/server.out" \
        || { echo "$label: aenv server did not start in 900 s" >&2; exit 1; }
    # shellcheck disable=SC1090
    source <(grep '^export E2B_' "$work/server.out")
    export E2B_API_KEY E2B_API_URL E2B_SANDBOX_URL
}
