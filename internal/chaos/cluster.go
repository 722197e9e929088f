package chaos

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/internal/faultnet"
	"github.com/idemhq/idem/internal/testkit"
)

// RedisCluster is a three-master Redis Cluster of the suite's own whose
// clients reach every node through a fault-injecting proxy: each node
// announces its proxy's port, so a cluster client follows the topology
// through the proxies, while the nodes talk to each other directly.
type RedisCluster struct {
	Faults []*faultnet.Proxy
	nodes  []*exec.Cmd
}

// StartRedisCluster starts the nodes (redis-server 7, no persistence) with
// their files in dir, and waits until the cluster is up.
func StartRedisCluster(ctx context.Context, dir string) (*RedisCluster, error) {
	c := &RedisCluster{}
	ports := make([]int, 3)
	for i := range ports {
		p, err := testkit.ClusterPort() // the bus port is port+10000
		if err != nil {
			c.Stop()
			return nil, err
		}
		port, _ := strconv.Atoi(p)
		ports[i] = port
		f, err := faultnet.Listen("127.0.0.1:" + strconv.Itoa(port))
		if err != nil {
			c.Stop()
			return nil, err
		}
		c.Faults = append(c.Faults, f)
		_, fport, _ := net.SplitHostPort(f.Addr())
		nodeDir := filepath.Join(dir, "redis-"+strconv.Itoa(port))
		cmd := exec.Command("sh", "-c", "mkdir -p "+nodeDir+" && exec redis-server --port "+strconv.Itoa(port)+
			" --bind 127.0.0.1 --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 5000"+
			" --cluster-announce-ip 127.0.0.1 --cluster-announce-port "+fport+
			" --cluster-announce-bus-port "+strconv.Itoa(port+10000)+
			" --save '' --appendonly no --dir "+nodeDir+" --logfile "+filepath.Join(nodeDir, "redis.log"))
		if err := cmd.Start(); err != nil {
			c.Stop()
			return nil, err
		}
		c.nodes = append(c.nodes, cmd)
	}
	direct := make([]*redis.Client, len(ports))
	for i, port := range ports {
		direct[i] = redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + strconv.Itoa(port)})
		defer direct[i].Close()
	}
	deadline := time.Now().Add(20 * time.Second)
	for _, d := range direct {
		for d.Ping(ctx).Err() != nil {
			if time.Now().After(deadline) {
				c.Stop()
				return nil, fmt.Errorf("redis cluster node %s did not start", d.Options().Addr)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	const slots = 16384
	for i, d := range direct {
		lo, hi := i*slots/len(direct), (i+1)*slots/len(direct)-1
		if err := d.Do(ctx, "CLUSTER", "ADDSLOTSRANGE", lo, hi).Err(); err != nil {
			c.Stop()
			return nil, fmt.Errorf("assigning slots: %w", err)
		}
		if i > 0 {
			if err := direct[0].Do(ctx, "CLUSTER", "MEET", "127.0.0.1", ports[i], ports[i]+10000).Err(); err != nil {
				c.Stop()
				return nil, fmt.Errorf("meeting node %d: %w", ports[i], err)
			}
		}
	}
	// The nodes learn of each other by gossip, slower on a loaded machine
	// (the race detector, other packages' tests): a bound of its own.
	deadline = time.Now().Add(60 * time.Second)
	for _, d := range direct {
		for {
			info, _ := d.ClusterInfo(ctx).Result()
			nodes, _ := d.ClusterNodes(ctx).Result()
			if strings.Contains(info, "cluster_state:ok") && strings.Count(nodes, "master") == 3 {
				break
			}
			if time.Now().After(deadline) {
				c.Stop()
				return nil, fmt.Errorf("redis cluster did not come up in a minute: node %s says\n%s\n%s", d.Options().Addr, info, nodes)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return c, nil
}

// DSN is the store DSN that reaches the cluster through the proxies.
func (c *RedisCluster) DSN(prefix string) string {
	dsn := "redis+cluster://" + c.Faults[0].Addr() + "?"
	for _, f := range c.Faults[1:] {
		dsn += "addr=" + f.Addr() + "&"
	}
	return dsn + "idem_prefix=" + prefix
}

// Stop kills the nodes and closes the proxies.
func (c *RedisCluster) Stop() {
	for _, n := range c.nodes {
		n.Process.Kill()
		n.Wait()
	}
	for _, f := range c.Faults {
		f.Close()
	}
}
