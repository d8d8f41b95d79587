#!/usr/bin/env bash
# A throwaway PostgreSQL server for the tests of tuning workers that share one study
# (tests/search/test_postgres.py). It listens on 127.0.0.1 only, on a free port, with its cluster,
# socket and log in one temporary folder.
#
#   bash .ci/postgres.sh start [DIR]   start a cluster in DIR (default: a new mktemp folder) and
#                                      print its SQLAlchemy URL on stdout, e.g.
#                                      postgresql+psycopg://autoprec:autoprec@127.0.0.1:PORT/autoprec
#   bash .ci/postgres.sh stop DIR      stop that cluster and remove DIR
#
# Debian's `postgresql` package is installed (apt-get) only when initdb/pg_ctl cannot be found.
# PostgreSQL refuses to run as root: as root the server runs as the `postgres` system user
# (created when missing), otherwise as the calling user.
set -euo pipefail

PG_USER=autoprec
PG_PASSWORD=autoprec
PG_DB=autoprec

die() { echo "postgres.sh: $*" >&2; exit 1; }

find_bindir() {  # the folder holding initdb and pg_ctl, or nothing
    local d
    for d in /usr/lib/postgresql/*/bin; do  # Debian/Ubuntu: the newest version last
        [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ] && bin="$d"
    done
    if [ -z "${bin:-}" ] && command -v initdb >/dev/null && command -v pg_ctl >/dev/null; then
        bin="$(dirname "$(command -v initdb)")"
    fi
    echo "${bin:-}"
}

bindir() {
    local b
    b="$(find_bindir)"
    if [ -z "$b" ]; then
        local sudo=""
        [ "$(id -u)" = 0 ] || sudo="sudo"
        echo "postgres.sh: initdb/pg_ctl not found; installing Debian's postgresql package" >&2
        $sudo apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq postgresql >&2 \
            || die "could not install postgresql (apt-get); install it and retry"
        b="$(find_bindir)"
    fi
    [ -n "$b" ] || die "initdb/pg_ctl still not found after installing postgresql"
    echo "$b"
}

as_owner() {  # run a command as the user owning the cluster
    if [ "$(id -u)" = 0 ]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start() {
    local dir="${1:-}" bin port url
    bin="$(bindir)"
    if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
        useradd --system --home-dir /nonexistent --shell /usr/sbin/nologin postgres \
            || die "could not create the postgres system user"
    fi
    [ -n "$dir" ] || dir="$(mktemp -d "${TMPDIR:-/tmp}/autoprec-pg.XXXXXX")"
    mkdir -p "$dir"
    [ -z "$(ls -A "$dir")" ] || die "$dir is not empty (give a new folder, or stop that cluster first)"
    [ "$(id -u)" = 0 ] && chown postgres "$dir"
    chmod 700 "$dir"
    printf '%s\n' "$PG_PASSWORD" > "$dir/pwfile"
    [ "$(id -u)" = 0 ] && chown postgres "$dir/pwfile"
    as_owner "$bin/initdb" -D "$dir/data" -U "$PG_USER" --pwfile="$dir/pwfile" --auth=scram-sha-256 \
        -E UTF8 --no-instructions >"$dir/initdb.log" 2>&1 || { cat "$dir/initdb.log" >&2; die "initdb failed"; }
    rm -f "$dir/pwfile"
    port="$(free_port)"
    as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
        -o "-c listen_addresses=127.0.0.1 -c port=$port -c unix_socket_directories=$dir -c max_connections=100 -c fsync=off" \
        start >&2 || { cat "$dir/server.log" >&2; die "the server did not start (log above)"; }
    PGPASSWORD="$PG_PASSWORD" "$bin/createdb" -h 127.0.0.1 -p "$port" -U "$PG_USER" "$PG_DB" \
        || { as_owner "$bin/pg_ctl" -D "$dir/data" -m immediate stop >&2 || true; die "createdb failed"; }
    url="postgresql+psycopg://$PG_USER:$PG_PASSWORD@127.0.0.1:$port/$PG_DB"
    printf '%s\n' "$url" > "$dir/url"
    echo "postgres.sh: server in $dir; stop it with: bash .ci/postgres.sh stop $dir" >&2
    echo "$url"
}

stop() {
    local dir="${1:-}" bin
    [ -n "$dir" ] || die "usage: postgres.sh stop DIR (the folder start printed)"
    [ -d "$dir" ] || return 0
    if [ -f "$dir/data/postmaster.pid" ]; then
        bin="$(find_bindir)"
        [ -n "$bin" ] && as_owner "$bin/pg_ctl" -D "$dir/data" -m fast -w -t 60 stop >&2 || true
    fi
    rm -rf "$dir"
}

case "${1:-}" in
    start) start "${2:-}" ;;
    stop) stop "${2:-}" ;;
    *) die "usage: postgres.sh start [DIR] | stop DIR" ;;
esac
