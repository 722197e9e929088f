package cli_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/idemhq/idem/internal/cli"
	"github.com/idemhq/idem/internal/testbin"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/internal/wait"
)

var idemBin string

func TestMain(m *testing.M) { testbin.Main(m, &idemBin) }

var listening = regexp.MustCompile(`msg="idem proxy listening" addr=(\S+) upstream=\S+ store=\S+(?: admin=(\S+))?`)

// proxyProc is an `idem proxy` running as a real process.
type proxyProc struct {
	cmd        *exec.Cmd
	url, admin string // admin is empty without --admin-listen
	logs       *logLines
	logsDone   chan struct{} // closed once the process's stderr is read to its end
}

// logLines collects a process's log lines for a test to look at.
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) add(line string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, line)
}

func (l *logLines) has(sub string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, line := range l.lines {
		if strings.Contains(line, sub) {
			return true
		}
	}
	return false
}

// runProxy runs `idem proxy` on a free port, with a journal of its own, and
// returns it once it says it is listening.
func runProxy(t *testing.T, args ...string) *proxyProc {
	t.Helper()
	return runProxyVia(t, nil, args...)
}

// runProxyVia is runProxy through a launcher: a command line that runs the
// one it is given after it ($0 and the arguments), as a shell does.
func runProxyVia(t *testing.T, launcher []string, args ...string) *proxyProc {
	t.Helper()
	line := append(append(slices.Clone(launcher), idemBin, "proxy", "--listen", "127.0.0.1:0",
		"--journal-dir", filepath.Join(t.TempDir(), "journal")), args...)
	cmd := exec.Command(line[0], line[1:]...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	p := &proxyProc{cmd: cmd, logs: &logLines{}, logsDone: make(chan struct{})}
	addr := make(chan []string, 1)
	go func() {
		defer close(p.logsDone)
		defer close(addr)
		lines := bufio.NewScanner(stderr)
		for lines.Scan() {
			p.logs.add(lines.Text())
			if m := listening.FindStringSubmatch(lines.Text()); m != nil {
				addr <- m
			}
		}
	}()
	select {
	case m, ok := <-addr:
		if !ok {
			t.Fatalf("idem proxy exited before listening: %q", p.logs.lines)
		}
		p.url = "http://" + m[1]
		if admin := strings.Trim(m[2], `"`); admin != "" {
			p.admin = "http://" + admin
		}
		return p
	case <-time.After(30 * time.Second):
		t.Fatal("idem proxy did not say it was listening within 30s")
	}
	return nil
}

// startProxy is runProxy for the tests that need only the process and its
// addresses.
func startProxy(t *testing.T, args ...string) (*exec.Cmd, string, string) {
	t.Helper()
	p := runProxy(t, args...)
	return p.cmd, p.url, p.admin
}

func post(url, key string) (int, string, error) {
	req, _ := http.NewRequest("POST", url, strings.NewReader(`{"amount":100}`))
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), nil
}

// TestKilledProxyNeverRunsTwice kills the proxy (SIGKILL) while the upstream
// is in the middle of two requests, restarts it on the same SQLite file, and
// retries both: the ordinary route answers operation-uncertain instead of
// running again; the takeover-safe route runs the retry exactly once.
func TestKilledProxyNeverRunsTwice(t *testing.T) {
	var mu sync.Mutex
	runs := map[string]int{}
	started := make(chan string, 2)
	testOver := make(chan struct{})
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		mu.Lock()
		runs[key]++
		n := runs[key]
		mu.Unlock()
		if n == 1 {
			started <- key
			select { // mid side effect when the proxy dies
			case <-r.Context().Done():
			case <-testOver:
			}
			return
		}
		w.WriteHeader(201)
		fmt.Fprintf(w, "%s run %d", key, n)
	}))
	defer upstream.Close()
	defer close(testOver)
	count := func(key string) int { mu.Lock(); defer mu.Unlock(); return runs[key] }

	dir := t.TempDir()
	config := filepath.Join(dir, "idem.yaml")
	os.WriteFile(config, []byte("lease: 1s\nroutes:\n  - match: POST /tx\n    takeover_safe: true\n"), 0o600)
	args := []string{"--upstream", upstream.URL, "--store", "sqlite:" + filepath.Join(dir, "idem.db"), "--config", config}

	proc, url, _ := startProxy(t, args...)
	for _, path := range []string{"/charge", "/tx"} {
		go post(url+path, "key"+path) // this client never hears back
	}
	wait.Recv(t, started, 10*time.Second, "the upstream to take the first request")
	wait.Recv(t, started, 10*time.Second, "the upstream to take the second request")
	proc.Process.Kill()
	proc.Wait()

	_, url, _ = startProxy(t, args...)
	retry := func(path string) (int, string) {
		deadline := time.Now().Add(20 * time.Second)
		for {
			status, body, err := post(url+path, "key"+path)
			if err != nil {
				t.Fatal(err)
			}
			// 409 in-progress until the dead proxy's 1s lease runs out.
			if !strings.Contains(body, "#in-progress") || time.Now().After(deadline) {
				return status, body
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	if status, body := retry("/charge"); status != 409 || !strings.Contains(body, "#operation-uncertain") {
		t.Fatalf("retry after the crash: %d %s; want 409 operation-uncertain", status, body)
	}
	if status, body := retry("/tx"); status != 201 || body != "key/tx run 2" {
		t.Fatalf("takeover-safe retry after the crash: %d %s; want it to run", status, body)
	}
	if status, body, _ := post(url+"/tx", "key/tx"); status != 201 || body != "key/tx run 2" {
		t.Fatalf("second retry: %d %s; want the replay", status, body)
	}
	if count("key/charge") != 1 || count("key/tx") != 2 {
		t.Fatalf("upstream runs: /charge %d (want 1), /tx %d (want 1 + the one retry)", count("key/charge"), count("key/tx"))
	}
}

// startProcess runs the idem binary and waits for a line of its output that
// matches re, returning the first submatch.
func startProcess(t *testing.T, re *regexp.Regexp, args ...string) (*exec.Cmd, string) {
	t.Helper()
	cmd := exec.Command(idemBin, args...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = io.Discard
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	found := make(chan string, 1)
	go func() {
		defer close(found)
		lines := bufio.NewScanner(out)
		for lines.Scan() {
			if m := re.FindStringSubmatch(lines.Text()); m != nil {
				found <- m[1]
				io.Copy(io.Discard, out)
				return
			}
		}
	}()
	select {
	case v, ok := <-found:
		if !ok {
			t.Fatalf("idem %s exited before saying %s", args[0], re)
		}
		return cmd, v
	case <-time.After(30 * time.Second):
		t.Fatalf("idem %s did not say %s within 30s", args[0], re)
	}
	return nil, ""
}

func verifyOK(t *testing.T, args ...string) {
	t.Helper()
	var out, errOut strings.Builder
	code := cli.Main(context.Background(), append([]string{"verify"}, args...), func(string) string { return "" }, &out, &errOut)
	if code != 0 || strings.Contains(out.String(), "FAIL") || strings.Count(out.String(), " pass ") < 7 {
		t.Fatalf("idem verify %v: exit %d\n%s%s", args, code, out.String(), errOut.String())
	}
}

// TestVerifyPassesAgainstTheProxy runs `idem verify` against `idem proxy` on
// every store.
func TestVerifyPassesAgainstTheProxy(t *testing.T) {
	var n atomic.Int64
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(20 * time.Millisecond)
		w.WriteHeader(201)
		fmt.Fprintf(w, `{"execution":%d}`, n.Add(1))
	}))
	defer upstream.Close()
	// Keyed by the store's metric label; the networked ones need their
	// test server (CI runs them all).
	with := func(base, q string) string {
		if strings.Contains(base, "?") {
			return base + "&" + q
		}
		return base + "?" + q
	}
	stores := map[string]func(env string) string{
		"memory":   func(string) string { return "memory:" },
		"sqlite":   func(string) string { return "sqlite:" + filepath.Join(t.TempDir(), "idem.db") },
		"postgres": func(pg string) string { return with(pg, "idem_schema=idem_verify_test") },
		"redis":    func(rd string) string { return with(rd, "idem_prefix=idem-verify-test") },
		"dynamodb": func(dy string) string {
			return "dynamodb://local:secret@" + strings.TrimPrefix(dy, "http://") + "?region=us-east-1&table=idem_verify_test&create_table=true"
		},
		"memcached": func(mc string) string { return "memcached://" + mc + "?idem_prefix=idem-verify-test" },
	}
	envs := map[string]string{"postgres": "IDEM_TEST_DATABASE_URL", "redis": "IDEM_TEST_REDIS_URL",
		"dynamodb": "IDEM_TEST_DYNAMODB_URL", "memcached": "IDEM_TEST_MEMCACHED_ADDR"}
	for name, makeDSN := range stores {
		t.Run(name, func(t *testing.T) {
			server := ""
			if env := envs[name]; env != "" {
				server = testkit.Server(t, env)
			}
			dsn := makeDSN(server)
			_, url, admin := startProxy(t, "--upstream", upstream.URL, "--store", dsn, "--require-key", "--admin-listen", "127.0.0.1:0", "--console-read-only")
			verifyOK(t, "--url", url+"/v1/charges", "--require-key", "--credential", "Bearer a", "--credential", "Bearer b")
			// The console lists what verify left, on this store.
			if code, page := get(t, admin+"/console/records?state=completed"); code != http.StatusOK || !strings.Contains(page, `<span class="state state-completed">completed</span>`) {
				t.Errorf("console records: %d, want completed records listed:\n%s", code, page)
			}
			if code, js := get(t, admin+"/console/api/overview"); code != http.StatusOK || strings.Contains(js, `"completed":0`) || strings.Contains(js, `"error"`) {
				t.Errorf("console overview: %d %s; want completed records counted", code, js)
			}
			resp, err := http.Get(admin + "/metrics")
			if err != nil {
				t.Fatal(err)
			}
			metrics, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			for _, want := range []string{`idem_requests_total{outcome="replayed"}`, `idem_requests_total{outcome="mismatch"}`,
				`idem_store_operation_duration_seconds_count{operation="acquire",result="ok",store="` + name + `"}`} {
				if !strings.Contains(string(metrics), want) {
					t.Errorf("/metrics lacks %s", want)
				}
			}
		})
	}
}

var demoListening = regexp.MustCompile(`payments API listening on (http://\S+)`)

func TestVerifyPassesAgainstTheDemo(t *testing.T) {
	_, url := startProcess(t, demoListening, "demo", "--listen", "127.0.0.1:0", "--acquirer-listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
		"--journal-dir", filepath.Join(t.TempDir(), "journal"),
		"--store", "sqlite:"+filepath.Join(t.TempDir(), "demo.db"))
	verifyOK(t, "--url", url+"/v1/charges", "--body", `{"amount":100,"currency":"eur","customer":"cus_1"}`,
		"--changed-body", `{"amount":101,"currency":"eur","customer":"cus_1"}`, "--require-key", "--credential", "Bearer sk_a", "--credential", "Bearer sk_b")
}

// TestProxyStartsAndStopsSaying: the start-up line names the store (and no
// admin address when there is none), and SIGTERM ends with a line saying
// that every outcome is stored, and exit status 0.
func TestProxyStartsAndStopsSaying(t *testing.T) {
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(201) }))
	defer upstream.Close()
	p := runProxy(t, "--upstream", upstream.URL, "--store", "memory:")
	if !p.logs.has("store=memory") || p.logs.has("admin=") {
		t.Fatalf("start-up lines: %q", p.logs.lines)
	}
	if code, _, err := post(p.url+"/pay", "k"); err != nil || code != 201 {
		t.Fatalf("a request: %d %v", code, err)
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select { // stderr ends when the process does; Wait only after reading it all
	case <-p.logsDone:
	case <-time.After(30 * time.Second):
		t.Fatalf("idem proxy did not exit within 30s of SIGTERM: %q", p.logs.lines)
	}
	if err := p.cmd.Wait(); err != nil {
		t.Fatalf("exit after SIGTERM: %v (logs %q)", err, p.logs.lines)
	}
	if !p.logs.has("stopped: every outcome is stored") {
		t.Fatalf("no word that it stopped: %q", p.logs.lines)
	}
}
