#!/bin/sh
# start-dynalite.sh starts dynalite (a DynamoDB-compatible server on Node.js
# and LevelDB, in memory) on 127.0.0.1:${PORT:-8000} for the dynamostore tests:
#
#	store/dynamostore/testdata/start-dynalite.sh
#	IDEM_TEST_DYNAMODB_URL=http://127.0.0.1:8000 go test ./store/dynamostore/
#
# It installs dynalite@4.0.0 with npm into ${IDEM_CACHE:-$HOME/.cache/idem}/dynalite
# the first time (outside the repository; its LevelDB module ships prebuilt
# binaries, so no compiler is needed), and starts it in the background unless
# something already answers on the port. It is idempotent. It waits up to
# 10 s for the server to answer, then prints its URL, alone on standard
# output (npm's messages go to standard error), so that
#
#	export IDEM_TEST_DYNAMODB_URL=$(store/dynamostore/testdata/start-dynalite.sh)
#
# works. Stop it with
#
#	kill "$(cat "${IDEM_CACHE:-$HOME/.cache/idem}/dynalite/dynalite-${PORT:-8000}.pid")"
#
# Tables become ACTIVE 10 ms after CreateTable and vanish 10 ms after
# DeleteTable (dynalite's default is 500 ms), so that each test can afford a
# table of its own. Needs node (18 or later), npm and curl on PATH.
set -eu

host=127.0.0.1
port=${PORT:-8000}
url="http://$host:$port"
dir="${IDEM_CACHE:-$HOME/.cache/idem}/dynalite"
cli="$dir/node_modules/dynalite/cli.js"
pidfile="$dir/dynalite-$port.pid"
log="$dir/dynalite-$port.log"

# answers: anything that speaks HTTP on the port (dynalite answers a bare GET
# with an error document).
answers() { curl -s -o /dev/null --max-time 1 "$url/" 2>/dev/null; }

if answers; then
	echo "$url"
	exit 0
fi

if [ ! -f "$cli" ]; then
	mkdir -p "$dir"
	npm install --prefix "$dir" --no-audit --no-fund --no-save --loglevel=error dynalite@4.0.0 >&2
fi

nohup node "$cli" --host "$host" --port "$port" --createTableMs 10 --deleteTableMs 10 --updateTableMs 10 \
	>"$log" 2>&1 &
echo $! >"$pidfile"

i=0
until answers; do
	i=$((i + 1))
	if [ "$i" -gt 100 ]; then
		echo "dynalite did not answer on $url within 10 s; see $log" >&2
		exit 1
	fi
	sleep 0.1
done
echo "$url"
