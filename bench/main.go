// Command bench is idem's load harness. It measures, in one interleaved run,
// a bare handler, the raw store operations a hand-written idempotency check
// makes (the limit), idem's middleware on every store, a bare reverse-proxy
// hop, the same hop with the raw store inline (the proxy's limit) and idem
// proxy on every store; with fresh keys, replays and a storm of duplicates.
// Each target is served by a process of its own; the load comes from this one.
//
//	go run ./bench -rounds 5 -duration 5s -out bench/results
//
// PostgreSQL and Redis are measured when IDEM_TEST_DATABASE_URL and
// IDEM_TEST_REDIS_URL name them. It prints a table of every target and the
// ratios (medians of the per-round ratios), and writes them, with SVG plots,
// to -out. BENCHMARKS.md holds a run.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "serve" {
		delay, _ := time.ParseDuration(os.Args[4])
		if err := serve(os.Args[2], os.Args[3], delay); err != nil {
			fmt.Fprintln(os.Stderr, "bench serve:", err)
			os.Exit(1)
		}
		return
	}
	rounds := flag.Int("rounds", 3, "interleaved rounds; ratios are the medians of the rounds' ratios")
	duration := flag.Duration("duration", 3*time.Second, "how long each target is loaded per round and workload")
	conns := flag.Int("conns", 16, "keep-alive connections")
	stormN := flag.Int("storm", 1000, "duplicates of one key sent at once (0: no storm)")
	stormDelay := flag.Duration("storm-delay", 50*time.Millisecond, "how long the handler takes in the storm")
	out := flag.String("out", "", "directory for results.md, results.json and the SVG plots")
	onlyStores := flag.String("stores", "", "comma-separated stores to measure (default: memory, sqlite, and postgres and redis when their variables are set)")
	workloads := flag.String("workloads", "fresh,replay", "comma-separated workloads: fresh (a new key every request), replay (completed keys)")
	only := flag.String("targets", "", "comma-separated targets to load, e.g. idem:redis,raw:redis (default: all of the stores measured)")
	prefill := flag.Int("prefill", 0, "settled records written to PostgreSQL's records table before the run (to see how cost grows with the table)")
	flag.Parse()
	if err := run(*rounds, *duration, *conns, *stormN, *stormDelay, *out, *onlyStores, *only, *workloads, *prefill); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// target is one server the harness loads.
type target struct {
	name, dsn string
	url       string
	cmd       *exec.Cmd
	stdin     io.WriteCloser
}

// stores returns the DSN of each store measured.
func stores(only, dir string) (map[string]string, error) {
	suffix := strconv.FormatUint(rand.Uint64()%1e9, 36)
	all := map[string]string{"memory": "memory:", "sqlite": "sqlite:" + filepath.Join(dir, "idem.db")}
	if u := os.Getenv("IDEM_TEST_DATABASE_URL"); u != "" {
		all["postgres"] = u + sep(u) + "idem_schema=bench_" + suffix
	}
	if u := os.Getenv("IDEM_TEST_REDIS_URL"); u != "" {
		all["redis"] = u + sep(u) + "idem_prefix=bench-" + suffix
	}
	if only == "" {
		return all, nil
	}
	picked := map[string]string{}
	for _, name := range strings.Split(only, ",") {
		dsn, ok := all[name]
		if !ok {
			return nil, fmt.Errorf("store %q is not available (memory, sqlite; postgres and redis need IDEM_TEST_DATABASE_URL and IDEM_TEST_REDIS_URL)", name)
		}
		picked[name] = dsn
	}
	return picked, nil
}

func sep(u string) string {
	if strings.Contains(u, "?") {
		return "&"
	}
	return "?"
}

// start runs a target's server process and waits for its address.
func start(self, name, dsn string, delay time.Duration) (*target, error) {
	cmd := exec.Command(self, "serve", name, dsn, delay.String())
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	addr, ok := strings.CutPrefix(strings.TrimSpace(line), "ADDR ")
	if err != nil || !ok {
		cmd.Process.Kill()
		return nil, fmt.Errorf("target %s did not start: %q %v", name, line, err)
	}
	return &target{name: name, dsn: dsn, url: "http://" + addr, cmd: cmd, stdin: stdin}, nil
}

func (t *target) stop() {
	t.stdin.Close()
	t.cmd.Wait()
}

// cpu reads the CPU time used so far, in microseconds, by the target's
// process, its store's server and this process (the load client).
func (t *target) cpu() [3]int64 {
	var server int64
	switch {
	case strings.HasSuffix(t.name, ":postgres"):
		server = cpuOfServer("postgres", "")
	case strings.HasSuffix(t.name, ":redis"):
		server = cpuOfServer("redis-server", redisAddr(t.dsn))
	}
	return [3]int64{cpuOf(t.cmd.Process.Pid), server, cpuOf(os.Getpid())}
}

// calls is how many store calls the target has made so far.
func (t *target) calls() int64 {
	resp, err := http.Get(t.url + "/_calls")
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	var n int64
	json.NewDecoder(resp.Body).Decode(&n)
	return n
}

func run(rounds int, d time.Duration, conns, stormN int, stormDelay time.Duration, out, only, onlyTargets, workloads string, prefill int) error {
	var loads []workload
	for _, name := range strings.Split(workloads, ",") {
		w := workload(name)
		if w != fresh && w != replay {
			return fmt.Errorf("workload %q is neither fresh nor replay", w)
		}
		loads = append(loads, w)
	}
	ctx := context.Background()
	self, err := os.Executable()
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "idem-bench")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	dsns, err := stores(only, dir)
	if err != nil {
		return err
	}
	names := []string{"bare", "hop"}
	for _, s := range slices.Sorted(maps.Keys(dsns)) {
		if s != "memory" {
			names = append(names, "raw:"+s, "hop-raw:"+s)
		}
		names = append(names, "idem:"+s, "proxy:"+s)
	}
	if onlyTargets != "" {
		// raw-scoped:S, the raw check keyed under the caller too, is run
		// only when named.
		for s := range dsns {
			if s != "memory" {
				names = append(names, "raw-scoped:"+s)
			}
		}
		picked := strings.Split(onlyTargets, ",")
		for _, name := range picked {
			if !slices.Contains(names, name) {
				return fmt.Errorf("target %q is not among %s", name, strings.Join(names, ", "))
			}
		}
		names = slices.DeleteFunc(names, func(n string) bool { return !slices.Contains(picked, n) })
	}
	progress := newProgress()
	var targets []*target
	defer func() {
		for _, t := range targets {
			t.stop()
		}
	}()
	for _, name := range names {
		_, s, _ := strings.Cut(name, ":")
		progress.say("starting %s", name)
		t, err := start(self, name, dsns[s], 0)
		if err != nil {
			return err
		}
		targets = append(targets, t)
	}
	server := newServerStats(dsns)
	defer server.close()
	if prefill > 0 {
		progress.say("writing %d settled records to PostgreSQL", prefill)
		if err := server.prefill(ctx, prefill); err != nil {
			return err
		}
	}
	results := map[string][]result{} // "target/workload" → one per round
	for r := range rounds {
		for _, w := range loads {
			for _, t := range targets {
				progress.say("round %d/%d: %s, %s keys", r+1, rounds, t.name, w)
				before, sBefore := t.calls(), server.read(t.name)
				cpu := t.cpu()
				res := load(ctx, t.url, w, conns, d, fmt.Sprintf("r%d-%s-%s-%d", r, w, strings.ReplaceAll(t.name, ":", "-"), rand.Uint32()))
				if n := float64(res.Requests); n > 0 {
					res.StoreOps = float64(t.calls()-before) / n
					res.ServerOps = float64(server.read(t.name)-sBefore) / n
					after := t.cpu()
					res.CPUTarget, res.CPUStore, res.CPUClient = float64(after[0]-cpu[0])/n, float64(after[1]-cpu[1])/n, float64(after[2]-cpu[2])/n
				}
				key := t.name + "/" + string(w)
				results[key] = append(results[key], res)
				progress.say("round %d/%d: %s, %s keys: %.0f req/s, p99 %v", r+1, rounds, t.name, w, res.RPS, res.P99.Round(10*time.Microsecond))
			}
		}
	}
	var storms []stormResult
	if stormN > 0 {
		for s, dsn := range dsns {
			for _, kind := range []string{"idem", "proxy"} {
				name := kind + ":" + s
				progress.say("storm: %d duplicates of one key on %s", stormN, name)
				t, err := start(self, name, dsn, stormDelay)
				if err != nil {
					return err
				}
				before := t.calls()
				ok, took := storm(ctx, t.url, stormN, fmt.Sprintf("storm-%d", rand.Uint32()))
				storms = append(storms, stormResult{Target: name, Duplicates: stormN, Answered: ok, StoreOps: t.calls() - before, Took: took})
				t.stop()
			}
		}
		slices.SortFunc(storms, func(a, b stormResult) int { return strings.Compare(a.Target, b.Target) })
	}
	progress.done()
	rep := report{Rounds: rounds, Duration: d, Conns: conns, Prefill: prefill, Targets: names, Results: results, Storms: storms, Server: server.notes()}
	rep.print(os.Stdout)
	if out != "" {
		return rep.write(out)
	}
	return nil
}

// progress shows what the harness is doing on a terminal, on one line.
type progress struct{ tty bool }

func newProgress() *progress {
	fi, err := os.Stderr.Stat()
	return &progress{tty: err == nil && fi.Mode()&os.ModeCharDevice != 0}
}

func (p *progress) say(format string, args ...any) {
	if p.tty {
		fmt.Fprintf(os.Stderr, "\r\033[K"+format, args...)
	}
}

func (p *progress) done() {
	if p.tty {
		fmt.Fprint(os.Stderr, "\r\033[K")
	}
}
