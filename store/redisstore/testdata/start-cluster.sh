#!/bin/sh
# start-cluster.sh starts a three-node Redis Cluster (masters only, no
# persistence) on 127.0.0.1:7000-7002 for the redisstore tests:
#
#	store/redisstore/testdata/start-cluster.sh
#	IDEM_TEST_REDIS_CLUSTER_ADDRS=127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002 \
#		go test -run Cluster ./store/redisstore/
#
# It is idempotent: when the three nodes already answer and the cluster is
# ok, it does nothing. Stop the cluster with
#
#	for p in 7000 7001 7002; do redis-cli -p $p shutdown nosave; done
#
# Needs redis-server and redis-cli 7 (or 6.2) on PATH.
set -eu

host=127.0.0.1
ports="7000 7001 7002"

answers() { redis-cli -h "$host" -p "$1" ping >/dev/null 2>&1; }
cluster_ok() {
	for p in $ports; do
		redis-cli -h "$host" -p "$p" cluster info 2>/dev/null | grep -q '^cluster_state:ok' || return 1
	done
}
addrs() {
	out=
	for p in $ports; do out="$out${out:+,}$host:$p"; done
	echo "$out"
}

all_answer=yes
for p in $ports; do answers "$p" || all_answer=no; done
if [ "$all_answer" = yes ] && cluster_ok; then
	echo "redis cluster already running: IDEM_TEST_REDIS_CLUSTER_ADDRS=$(addrs)"
	exit 0
fi

dir=$(mktemp -d "${TMPDIR:-/tmp}/idem-redis-cluster.XXXXXX")
for p in $ports; do
	if answers "$p"; then
		continue
	fi
	redis-server --port "$p" --bind "$host" --cluster-enabled yes \
		--cluster-config-file "nodes-$p.conf" --cluster-node-timeout 5000 \
		--save '' --appendonly no --dir "$dir" --logfile "$dir/redis-$p.log" \
		--daemonize yes
done

# Wait for the nodes to answer (up to 10 s).
i=0
for p in $ports; do
	until answers "$p"; do
		i=$((i + 1))
		if [ "$i" -gt 100 ]; then
			echo "redis-server on port $p did not start; see $dir/redis-$p.log" >&2
			exit 1
		fi
		sleep 0.1
	done
done

# Create the cluster unless the nodes already form one.
if ! redis-cli -h "$host" -p 7000 cluster info | grep -q '^cluster_slots_assigned:16384'; then
	set --
	for p in $ports; do set -- "$@" "$host:$p"; done
	redis-cli --cluster create "$@" --cluster-replicas 0 --cluster-yes >"$dir/create.log" 2>&1 || {
		cat "$dir/create.log" >&2
		exit 1
	}
fi

# Wait until every node says the cluster is ok (up to 30 s).
i=0
until cluster_ok; do
	i=$((i + 1))
	if [ "$i" -gt 300 ]; then
		echo "the cluster did not become ok; logs in $dir" >&2
		exit 1
	fi
	sleep 0.1
done
echo "redis cluster ok (data in $dir): IDEM_TEST_REDIS_CLUSTER_ADDRS=$(addrs)"
