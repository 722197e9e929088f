package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
)

// serverStats reads what the stores' servers did: Redis commands, and
// PostgreSQL WAL bytes and HOT updates.
type serverStats struct {
	redis  *redis.Client
	prefix string // of the run's Redis keys
	pg     *pgx.Conn
	schema string
}

func newServerStats(dsns map[string]string) *serverStats {
	s := &serverStats{}
	ctx := context.Background()
	if dsn, ok := dsns["redis"]; ok {
		if opt, err := redis.ParseURL(strings.Split(dsn, "?")[0]); err == nil {
			s.redis, s.prefix = redis.NewClient(opt), redisPrefix(dsn)
		}
	}
	if dsn, ok := dsns["postgres"]; ok {
		base, q, _ := strings.Cut(dsn, "?")
		var keep []string
		for _, kv := range strings.Split(q, "&") {
			if name, v, _ := strings.Cut(kv, "="); name == "idem_schema" {
				s.schema = v
			} else if kv != "" {
				keep = append(keep, kv)
			}
		}
		if len(keep) > 0 {
			base += "?" + strings.Join(keep, "&")
		}
		if c, err := pgx.Connect(ctx, base); err == nil {
			s.pg = c
		}
	}
	return s
}

// close drops what the run wrote (its Redis keys; its PostgreSQL schema and
// the raw table), so that a run leaves the servers as it found them, and
// closes the connections.
func (s *serverStats) close() {
	ctx := context.Background()
	if s.redis != nil && s.prefix != "" {
		iter := s.redis.Scan(ctx, 0, s.prefix+"*", 10000).Iterator()
		var batch []string
		for iter.Next(ctx) {
			if batch = append(batch, iter.Val()); len(batch) == 1000 {
				s.redis.Unlink(ctx, batch...)
				batch = batch[:0]
			}
		}
		if len(batch) > 0 {
			s.redis.Unlink(ctx, batch...)
		}
	}
	if s.redis != nil {
		s.redis.Close()
	}
	if s.pg != nil {
		s.pg.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{s.schema}.Sanitize()+` CASCADE`)
		s.pg.Exec(ctx, `DROP TABLE IF EXISTS bench_raw`)
		s.pg.Close(ctx)
	}
}

// read returns the server's counter for a target's store: Redis commands
// run, or PostgreSQL WAL bytes written, so far.
func (s *serverStats) read(target string) int64 {
	ctx := context.Background()
	switch {
	case strings.HasSuffix(target, ":redis") && s.redis != nil:
		info, err := s.redis.Info(ctx, "commandstats").Result()
		if err != nil {
			return 0
		}
		var total int64
		for _, line := range strings.Split(info, "\n") {
			if _, rest, ok := strings.Cut(line, ":calls="); ok {
				n, _ := strconv.ParseInt(strings.Split(rest, ",")[0], 10, 64)
				total += n
			}
		}
		return total
	case strings.HasSuffix(target, ":postgres") && s.pg != nil:
		var lsn int64
		s.pg.QueryRow(ctx, `SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint`).Scan(&lsn)
		return lsn
	}
	return 0
}

// prefill writes n completed records, retained for a day, to idem's
// records table and as many rows to the raw table, in batches.
func (s *serverStats) prefill(ctx context.Context, n int) error {
	if s.pg == nil {
		return fmt.Errorf("-prefill needs PostgreSQL (IDEM_TEST_DATABASE_URL)")
	}
	const batch = 500_000
	for from := 0; from < n; from += batch {
		to := min(from+batch, n) - 1
		if _, err := s.pg.Exec(ctx, `INSERT INTO `+pgx.Identifier{s.schema, "records"}.Sanitize()+` (scope, key, state, fingerprint, token, fence,
			lease_expires, takeover_safe, response, created, updated, expires)
			SELECT 'prefill', 'k' || i, 'completed', 'v1.prefill', md5(i::text), 1, now(), false, '\x7b7d', now(), now(), now() + interval '1 day'
			FROM generate_series($1::int, $2::int) i`, from, to); err != nil {
			return fmt.Errorf("prefilling records: %w", err)
		}
		if _, err := s.pg.Exec(ctx, `INSERT INTO bench_raw (scope, key, state, body)
			SELECT 'prefill', 'k' || i, 'completed', '\x7b7d' FROM generate_series($1::int, $2::int) i ON CONFLICT DO NOTHING`, from, to); err != nil {
			return fmt.Errorf("prefilling the raw table: %w", err)
		}
	}
	_, err := s.pg.Exec(ctx, `ANALYZE `+pgx.Identifier{s.schema, "records"}.Sanitize()+`; ANALYZE bench_raw`)
	return err
}

// notes are what the servers say about the whole run: the share of
// PostgreSQL updates that were HOT, idem's records and the raw table's.
func (s *serverStats) notes() []string {
	if s.pg == nil {
		return nil
	}
	var out []string
	for _, t := range []struct{ what, schema, table string }{{"idem's records", s.schema, "records"}, {"the raw table", "public", "bench_raw"}} {
		var upd, hot int64
		err := s.pg.QueryRow(context.Background(), `SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = $2`,
			t.schema, t.table).Scan(&upd, &hot)
		if err == nil && upd > 0 {
			out = append(out, fmt.Sprintf("PostgreSQL: %.0f%% of the updates of %s were HOT (%d of %d)", 100*float64(hot)/float64(upd), t.what, hot, upd))
		}
	}
	return out
}

// stormResult is what a storm of duplicates cost.
type stormResult struct {
	Target     string
	Duplicates int
	Answered   int // with the outcome (201)
	StoreOps   int64
	Took       time.Duration
}

// report is a run's results.
type report struct {
	Rounds   int
	Duration time.Duration
	Conns    int
	Prefill  int
	Targets  []string
	Results  map[string][]result
	Storms   []stormResult
	Server   []string
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	xs = slices.Clone(xs)
	slices.Sort(xs)
	if len(xs)%2 == 1 {
		return xs[len(xs)/2]
	}
	return (xs[len(xs)/2-1] + xs[len(xs)/2]) / 2
}

// summary is a target's medians over the rounds.
func (r report) summary(key string) result {
	rs := r.Results[key]
	pick := func(f func(result) float64) float64 {
		var xs []float64
		for _, x := range rs {
			xs = append(xs, f(x))
		}
		return median(xs)
	}
	return result{
		RPS:       pick(func(x result) float64 { return x.RPS }),
		P50:       time.Duration(pick(func(x result) float64 { return float64(x.P50) })),
		P99:       time.Duration(pick(func(x result) float64 { return float64(x.P99) })),
		StoreOps:  pick(func(x result) float64 { return x.StoreOps }),
		ServerOps: pick(func(x result) float64 { return x.ServerOps }),
		CPUTarget: pick(func(x result) float64 { return x.CPUTarget }),
		CPUStore:  pick(func(x result) float64 { return x.CPUStore }),
		CPUClient: pick(func(x result) float64 { return x.CPUClient }),
		Errors:    int64(pick(func(x result) float64 { return float64(x.Errors) })),
	}
}

// ratio is the median over the rounds of a's throughput over b's.
func (r report) ratio(a, b string) (float64, bool) {
	ra, rb := r.Results[a], r.Results[b]
	if len(ra) == 0 || len(ra) != len(rb) {
		return 0, false
	}
	var xs []float64
	for i := range ra {
		if rb[i].RPS > 0 {
			xs = append(xs, ra[i].RPS/rb[i].RPS)
		}
	}
	return median(xs), len(xs) > 0
}

// ratios are the comparisons the targets are for.
func (r report) ratios() [][3]string {
	var rows [][3]string
	add := func(what, a, b string) {
		if x, ok := r.ratio(a, b); ok {
			rows = append(rows, [3]string{what, a + " / " + b, fmt.Sprintf("%.2f", x)})
		}
	}
	for _, w := range []workload{fresh, replay} {
		add("middleware, "+string(w)+" keys", "idem:memory/"+string(w), "bare/"+string(w))
		for _, s := range []string{"sqlite", "postgres", "redis"} {
			add("middleware, "+string(w)+" keys", "idem:"+s+"/"+string(w), "raw:"+s+"/"+string(w))
			add("middleware, "+string(w)+" keys, raw check scoped", "idem:"+s+"/"+string(w), "raw-scoped:"+s+"/"+string(w))
		}
		for _, s := range []string{"sqlite", "postgres", "redis"} {
			add("idem proxy, "+string(w)+" keys", "proxy:"+s+"/"+string(w), "hop-raw:"+s+"/"+string(w))
		}
		add("idem proxy, "+string(w)+" keys", "proxy:memory/"+string(w), "hop/"+string(w))
	}
	return rows
}

func (r report) print(w io.Writer) {
	fmt.Fprintf(w, "%d rounds of %v per target and workload, %d keep-alive connections; medians over the rounds.\n", r.Rounds, r.Duration, r.Conns)
	if r.Prefill > 0 {
		fmt.Fprintf(w, "PostgreSQL's tables held %d settled records before the run.\n", r.Prefill)
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "\t\t\t\t\t\t\tCPU µs/req:\t\t\t\t")
	fmt.Fprintln(tw, "target\tkeys\treq/s\tp50\tp99\tstore calls/req\tserver ops/req\ttarget\tstore\tclient\terrors\t")
	for _, t := range r.Targets {
		for _, wl := range []workload{fresh, replay} {
			if len(r.Results[t+"/"+string(wl)]) == 0 {
				continue // not loaded (-workloads)
			}
			s := r.summary(t + "/" + string(wl))
			fmt.Fprintf(tw, "%s\t%s\t%.0f\t%v\t%v\t%.2f\t%.1f\t%.0f\t%.0f\t%.0f\t%d\t\n", t, wl, s.RPS, s.P50.Round(time.Microsecond), s.P99.Round(time.Microsecond),
				s.StoreOps, s.ServerOps, s.CPUTarget, s.CPUStore, s.CPUClient, s.Errors)
		}
	}
	tw.Flush()
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "comparison\tratio of throughput\t")
	for _, row := range r.ratios() {
		fmt.Fprintf(tw, "%s: %s\t%s\t\n", row[0], row[1], row[2])
	}
	tw.Flush()
	for _, s := range r.Storms {
		fmt.Fprintf(w, "\nstorm on %s: %d duplicates of one key at once, %d answered with the outcome in %v, %d store calls in all",
			s.Target, s.Duplicates, s.Answered, s.Took.Round(time.Millisecond), s.StoreOps)
	}
	fmt.Fprintln(w)
	for _, n := range r.Server {
		fmt.Fprintln(w, n)
	}
}

// write puts the report, its data and its plots in dir.
func (r report) write(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	var b strings.Builder
	r.print(&b)
	if err := os.WriteFile(filepath.Join(dir, "results.txt"), []byte(b.String()), 0o644); err != nil {
		return err
	}
	data, _ := json.MarshalIndent(r, "", "  ")
	if err := os.WriteFile(filepath.Join(dir, "results.json"), data, 0o644); err != nil {
		return err
	}
	for _, plot := range []struct {
		file, title, unit string
		value             func(result) float64
	}{
		{"throughput.svg", "Throughput (requests/s, higher is better)", "req/s", func(x result) float64 { return x.RPS }},
		{"p99.svg", "p99 latency (ms, lower is better)", "ms", func(x result) float64 { return float64(x.P99) / 1e6 }},
	} {
		if err := os.WriteFile(filepath.Join(dir, plot.file), []byte(r.svg(plot.title, plot.unit, plot.value)), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// svg draws a horizontal bar chart: a bar per target and workload.
func (r report) svg(title, unit string, value func(result) float64) string {
	type bar struct {
		label string
		v     float64
		w     workload
	}
	var bars []bar
	max := 0.0
	for _, t := range r.Targets {
		for _, wl := range []workload{fresh, replay} {
			if len(r.Results[t+"/"+string(wl)]) == 0 {
				continue
			}
			v := value(r.summary(t + "/" + string(wl)))
			bars = append(bars, bar{t, v, wl})
			if v > max {
				max = v
			}
		}
	}
	const left, width, row = 130, 520, 14
	height := 40 + len(bars)*row + 30
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="11">`+"\n", left+width+90, height)
	fmt.Fprintf(&b, `<text x="10" y="20" font-size="14">%s</text>`+"\n", title)
	fmt.Fprintf(&b, `<rect x="%d" y="26" width="10" height="10" fill="#3b6ea8"/><text x="%d" y="35">fresh keys</text>`, left, left+14)
	fmt.Fprintf(&b, `<rect x="%d" y="26" width="10" height="10" fill="#e08a2c"/><text x="%d" y="35">replays</text>`+"\n", left+90, left+104)
	for i, br := range bars {
		y := 44 + i*row
		w := 0.0
		if max > 0 {
			w = br.v / max * width
		}
		color := "#3b6ea8"
		if br.w == replay {
			color = "#e08a2c"
		}
		if br.w == fresh {
			fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="end">%s</text>`, left-6, y+row+2, br.label)
		}
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%.1f" height="%d" fill="%s"/><text x="%.1f" y="%d">%.1f %s</text>`+"\n",
			left, y, w, row-3, color, float64(left)+w+4, y+row-4, br.v, unit)
	}
	b.WriteString("</svg>\n")
	return b.String()
}
