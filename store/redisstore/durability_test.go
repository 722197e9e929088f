package redisstore

import (
	"context"
	"errors"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/internal/wait"
	"github.com/redis/go-redis/v9"
)

// ownRedis starts a Redis of the test's own and returns a client of it.
func ownRedis(t *testing.T, args ...string) (*redis.Client, string, *exec.Cmd) {
	t.Helper()
	port := testkit.FreePort(t)
	if slices.Contains(args, "--cluster-enabled") { // a cluster node needs a port under 55535
		var err error
		if port, err = testkit.ClusterPort(); err != nil {
			t.Fatal(err)
		}
	}
	cmd := testkit.StartRedis(t, port, args...)
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + port})
	t.Cleanup(func() { client.Close() })
	return client, port, cmd
}

// configSet runs CONFIG SET with the pairs kv on the server of client.
func configSet(t *testing.T, client *redis.Client, kv ...string) {
	t.Helper()
	args := []any{"CONFIG", "SET"}
	for _, s := range kv {
		args = append(args, s)
	}
	if err := client.Do(context.Background(), args...).Err(); err != nil {
		t.Fatalf("CONFIG SET %v: %v", kv, err)
	}
}

// infoField returns the field name of the INFO section of the server of
// client, or "" when it has none.
func infoField(t *testing.T, client *redis.Client, section, name string) string {
	t.Helper()
	info, err := client.Info(context.Background(), section).Result()
	if err != nil {
		t.Fatalf("INFO %s: %v", section, err)
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), name+":"); ok {
			return v
		}
	}
	return ""
}

// durability returns the store's report on client, failing the test on an
// error.
func durability(t *testing.T, client redis.UniversalClient) (crashSafe bool, detail string) {
	t.Helper()
	s, err := New(Config{Client: client})
	if err != nil {
		t.Fatal(err)
	}
	d, err := s.Durability(context.Background())
	if err != nil {
		t.Fatalf("Durability: %v", err)
	}
	return d.CrashSafe, d.Detail
}

// TestDurabilityReportsEviction: a Redis with a maxmemory and any policy but
// noeviction evicts records when memory fills (under volatile-* the settled
// ones, which have a TTL, within their retention; under allkeys-* running
// records and the pending sets too), so a retry runs the work again: it is
// not crash safe, however it persists. Without a maxmemory, or under
// noeviction, nothing is evicted.
func TestDurabilityReportsEviction(t *testing.T) {
	t.Parallel()
	client, _, _ := ownRedis(t)
	configSet(t, client, "appendonly", "yes", "appendfsync", "always")
	for _, c := range []struct {
		policy, maxmemory string
		safe              bool
	}{
		{"noeviction", "0", true},
		{"volatile-lru", "1gb", false},
		{"volatile-ttl", "1gb", false},
		{"allkeys-lru", "1gb", false},
		{"noeviction", "1gb", true},
		{"volatile-lru", "0", true}, // no limit: nothing is evicted
	} {
		configSet(t, client, "maxmemory-policy", c.policy, "maxmemory", c.maxmemory)
		safe, detail := durability(t, client)
		if safe != c.safe {
			t.Errorf("maxmemory-policy %s, maxmemory %s: CrashSafe = %v (%s), want %v", c.policy, c.maxmemory, safe, detail, c.safe)
		}
		if !c.safe && !strings.Contains(detail, "maxmemory-policy "+c.policy) {
			t.Errorf("maxmemory-policy %s, maxmemory %s: Detail %q does not name the policy", c.policy, c.maxmemory, detail)
		}
	}
}

// TestDurabilityReportsReplicas: a master with a replica may fail over to it,
// and replication is asynchronous, so a failover loses writes the master had
// acknowledged, even with appendfsync always; so does a store talking to a
// replica.
func TestDurabilityReportsReplicas(t *testing.T) {
	t.Parallel()
	master, port, _ := ownRedis(t)
	configSet(t, master, "appendonly", "yes", "appendfsync", "always")
	if safe, detail := durability(t, master); !safe {
		t.Fatalf("a master without replicas, appendfsync always: not crash safe (%s)", detail)
	}
	replica, _, _ := ownRedis(t)
	configSet(t, replica, "appendonly", "yes", "appendfsync", "always")
	if err := replica.Do(context.Background(), "REPLICAOF", "127.0.0.1", port).Err(); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 20*time.Second, "the replica to connect", func() bool {
		return infoField(t, master, "replication", "connected_slaves") == "1"
	})
	if safe, detail := durability(t, master); safe || !strings.Contains(detail, "failover") {
		t.Errorf("a master with a replica: CrashSafe = %v, Detail %q; want false, naming the failover", safe, detail)
	}
	if safe, detail := durability(t, replica); safe || !strings.Contains(detail, "replica") {
		t.Errorf("a replica: CrashSafe = %v, Detail %q; want false, naming the role", safe, detail)
	}
}

// TestDurabilityReportsClusterReplicas: a Redis Cluster master with a
// replica fails over to it on its own, losing the writes the replica had not
// received; a replica that is disconnected for now still counts, since it
// may be promoted. A cluster without replicas has nothing to fail over to.
func TestDurabilityReportsClusterReplicas(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	a, portA, _ := ownRedis(t, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
	b, portB, cmdB := ownRedis(t, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
	configSet(t, a, "appendonly", "yes", "appendfsync", "always")
	slots := []any{"CLUSTER", "ADDSLOTS"}
	for i := range 16384 {
		slots = append(slots, i)
	}
	if err := a.Do(ctx, slots...).Err(); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 20*time.Second, "the one-node cluster to be ok", func() bool {
		return strings.Contains(a.ClusterInfo(ctx).Val(), "cluster_state:ok")
	})
	cluster := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{"127.0.0.1:" + portA}})
	t.Cleanup(func() { cluster.Close() })
	if safe, detail := durability(t, cluster); !safe {
		t.Fatalf("a cluster without replicas, appendfsync always: not crash safe (%s)", detail)
	}

	idA, err := a.Do(ctx, "CLUSTER", "MYID").Text()
	if err != nil {
		t.Fatal(err)
	}
	if err := a.ClusterMeet(ctx, "127.0.0.1", portB).Err(); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 20*time.Second, "the second node to know the first", func() bool {
		return strings.Contains(b.ClusterNodes(ctx).Val(), idA)
	})
	if err := b.ClusterReplicate(ctx, idA).Err(); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 20*time.Second, "the replica to connect", func() bool {
		return infoField(t, a, "replication", "connected_slaves") == "1"
	})
	if safe, detail := durability(t, cluster); safe || !strings.Contains(detail, "failover") {
		t.Errorf("a cluster master with a replica: CrashSafe = %v, Detail %q; want false, naming the failover", safe, detail)
	}

	idB, err := b.Do(ctx, "CLUSTER", "MYID").Text()
	if err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 20*time.Second, "the master to list its replica", func() bool {
		for _, line := range strings.Split(a.ClusterNodes(ctx).Val(), "\n") {
			if f := strings.Fields(line); len(f) > 3 && f[0] == idB && f[3] == idA {
				return true
			}
		}
		return false
	})
	cmdB.Process.Kill()
	cmdB.Wait()
	wait.Until(t, 20*time.Second, "the master to see its replica gone", func() bool {
		return infoField(t, a, "replication", "connected_slaves") == "0"
	})
	if safe, detail := durability(t, cluster); safe || !strings.Contains(detail, "failover") {
		t.Errorf("a cluster master whose replica is disconnected: CrashSafe = %v, Detail %q; want false, naming the failover", safe, detail)
	}
}

// TestDurabilityRefusedCommands: a user that may not run CONFIG leaves
// appendfsync unknown, so the server is not called crash safe (the eviction
// settings come from INFO, which it may run); a user that may not run INFO
// gets Redis's refusal as it is, not unavailability, so a health check does
// not take a store that answers for one that cannot be reached.
func TestDurabilityRefusedCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin, port, _ := ownRedis(t)
	configSet(t, admin, "appendonly", "yes", "appendfsync", "always", "maxmemory-policy", "volatile-lru", "maxmemory", "1gb")
	for _, acl := range [][]any{
		{"ACL", "SETUSER", "noconfig", "on", ">noconfig-secret", "~*", "&*", "+@all", "-config"},
		{"ACL", "SETUSER", "noinfo", "on", ">noinfo-secret", "~*", "&*", "+@all", "-info"},
	} {
		if err := admin.Do(ctx, acl...).Err(); err != nil {
			t.Fatalf("%v: %v", acl[:3], err)
		}
	}
	as := func(user string) *redis.Client {
		c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + port, Username: user, Password: user + "-secret"})
		t.Cleanup(func() { c.Close() })
		return c
	}
	if safe, detail := durability(t, as("noconfig")); safe || !strings.Contains(detail, "CONFIG GET refused") ||
		!strings.Contains(detail, "maxmemory-policy volatile-lru") {
		t.Errorf("CONFIG refused: CrashSafe = %v, Detail %q; want false, naming the refusal and the eviction policy", safe, detail)
	}
	s, err := New(Config{Client: as("noinfo")})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Durability(ctx); err == nil || errors.Is(err, idem.ErrUnavailable) || strings.Contains(err.Error(), "secret") {
		t.Errorf("INFO refused: %v, want Redis's refusal, not ErrUnavailable", err)
	}
}
