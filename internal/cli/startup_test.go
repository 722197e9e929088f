package cli_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/internal/faultnet"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/internal/wait"
)

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestProxyStartsWhileStoreIsDown: whatever the store, `idem proxy` started
// while its store cannot be reached starts all the same, says not ready,
// refuses keyed requests with 503 quickly, and serves as soon as the store
// answers.
func TestProxyStartsWhileStoreIsDown(t *testing.T) {
	var runs sync.Map
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, _ := runs.LoadOrStore(r.Header.Get("Idempotency-Key"), new(int))
		*n.(*int)++
		w.WriteHeader(201)
		fmt.Fprint(w, "ran")
	}))
	defer upstream.Close()
	for _, tc := range []struct{ name, env string }{{"postgres", "IDEM_TEST_DATABASE_URL"}, {"redis", "IDEM_TEST_REDIS_URL"}} {
		t.Run(tc.name, func(t *testing.T) {
			server := testkit.Server(t, tc.env)
			u, err := url.Parse(server)
			if err != nil {
				t.Fatal(err)
			}
			faults, err := faultnet.Listen(u.Host)
			if err != nil {
				t.Fatal(err)
			}
			defer faults.Close()
			end := faults.Outage()
			u.Host = faults.Addr()
			q := u.Query()
			name := "idem_startup_" + strconv.FormatInt(time.Now().UnixNano(), 36)
			q.Set(map[string]string{"postgres": "idem_schema", "redis": "idem_prefix"}[tc.name], name)
			if tc.name == "postgres" {
				t.Cleanup(func() { dropSchema(server, name) })
			}
			u.RawQuery = q.Encode()
			p := runProxy(t, "--upstream", upstream.URL, "--store", u.String(), "--store-timeout", "500ms", "--admin-listen", "127.0.0.1:0")
			proxyURL, admin, logs := p.url, p.admin, p.logs
			if status, body := get(t, admin+"/readyz"); status != 503 || !strings.Contains(body, "not ready") {
				t.Fatalf("/readyz with the store down: %d %q", status, body)
			}
			began := time.Now()
			if status, body, err := post(proxyURL+"/v1/charges", "startup-"+tc.name); err != nil || status != 503 {
				t.Fatalf("a keyed request with the store down: %d %q %v; want 503", status, body, err)
			}
			if took := time.Since(began); took > 3*time.Second {
				t.Fatalf("the 503 took %v", took)
			}
			wait.Until(t, 5*time.Second, "the log to say the store cannot be reached", func() bool { return logs.has("the store cannot be reached") })
			end()
			wait.Until(t, 20*time.Second, "/readyz to say ready once the store answers", func() bool {
				status, _ := get(t, admin+"/readyz")
				return status == 200
			})
			if status, body, err := post(proxyURL+"/v1/charges", "startup-"+tc.name); err != nil || status != 201 || body != "ran" {
				t.Fatalf("a keyed request once the store answers: %d %q %v; want it to run", status, body, err)
			}
		})
	}
}

// TestRedisRestartIsNoticed: a Redis that keeps nothing on disk is
// restarted under a running proxy. The proxy said from the start that a
// crash of its store loses records, and it notices the restart (the run_id
// changes): loudly in its log, on /readyz and in its metrics.
func TestRedisRestartIsNoticed(t *testing.T) {
	port := testkit.FreePort(t)
	redis := testkit.StartRedis(t, port)
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(201) }))
	defer upstream.Close()
	p := runProxy(t, "--upstream", upstream.URL, "--store", "redis://127.0.0.1:"+port+"/0", "--admin-listen", "127.0.0.1:0")
	admin, logs := p.admin, p.logs
	status, body := get(t, admin+"/readyz")
	if status != 200 || !strings.Contains(body, "durability: NOT crash-safe (appendonly no, no snapshots: a restart loses every record)") ||
		!strings.Contains(body, "restarts seen: 0") {
		t.Fatalf("/readyz before the restart: %d\n%s", status, body)
	}
	wait.Until(t, 5*time.Second, "the log to say that a crash of the store loses records", func() bool {
		return logs.has("a crash of the store loses records")
	})
	redis.Process.Kill()
	redis.Wait()
	testkit.StartRedis(t, port)
	wait.Until(t, 20*time.Second, "/readyz to count the restart", func() bool {
		_, body := get(t, admin+"/readyz")
		return strings.Contains(body, "restarts seen: 1")
	})
	wait.Until(t, 5*time.Second, "the log to say loudly that the store restarted", func() bool { return logs.has("THE STORE'S SERVER RESTARTED") })
	if _, metrics := get(t, admin+"/metrics"); !strings.Contains(metrics, `idem_store_restarts_total{store="redis"} 1`) ||
		!strings.Contains(metrics, `idem_store_crash_safe{store="redis"} 0`) {
		t.Fatalf("/metrics lacks the restart or the durability:\n%s", metrics)
	}
}

// dropSchema drops a schema a test made, with everything in it.
func dropSchema(dsn, schema string) {
	c, err := pgx.Connect(context.Background(), dsn)
	if err == nil {
		c.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		c.Close(context.Background())
	}
}
