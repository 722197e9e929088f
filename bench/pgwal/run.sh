#!/bin/sh
# WAL written per idempotency key on PostgreSQL, by table layout: idem's
# records table as store/pgstore's migrations make it (records), as it was
# before migration 003 (idem), the same without its two partial indexes,
# with its columns reordered, the leanest record without the indexes, the
# raw limit (scope, key, state, body) and the same under a caller's scope
# (raw_scoped). Each key is an INSERT and an
# UPDATE in transactions of their own, as idem's acquire and complete are.
#
#	sh bench/pgwal/run.sh [database URL]   # default: IDEM_TEST_DATABASE_URL
#
# It works in a schema of its own (idem_walcost) and drops it at the end.
set -eu
export PGOPTIONS="-c client_min_messages=warning"
url=${1:-${IDEM_TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test?sslmode=disable}}
dir=$(dirname "$0")
psql -q -X -v ON_ERROR_STOP=1 "$url" -f "$dir/tables.sql"
for m in "$dir"/../../store/pgstore/migrations/*.sql; do
	sed 's/{{schema}}/idem_walcost/g' "$m" | psql -q -X -v ON_ERROR_STOP=1 "$url"
done
for t in records idem idem_no_partial idem_reordered lean_no_partial raw raw_scoped; do
	psql -q -X -At -v ON_ERROR_STOP=1 -v tbl="$t" "$url" -f "$dir/load.sql"
done
psql -q -X "$url" -c 'DROP SCHEMA idem_walcost CASCADE'
