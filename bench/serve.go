package main

import (
	"bufio"
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"runtime/pprof"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	_ "modernc.org/sqlite"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/internal/proxy"
	"github.com/idemhq/idem/internal/storeopen"
	"github.com/idemhq/idem/internal/testkit"
)

// responseBody is what the handler answers: 220 bytes of JSON.
var responseBody = []byte(`{"id":"ch_3PbX9k2eZvKYlo2C1a2b3c4d","object":"charge","amount":1000,"currency":"eur","customer":"cus_42","status":"succeeded","captured":true,"livemode":false,"created":1764547200,"description":"bench"}` + "\n")

// handler is the API every target serves: it reads the request and answers
// 201 with responseBody, after delay.
func handler(delay time.Duration) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		if delay > 0 {
			time.Sleep(delay)
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		w.Write(responseBody)
	})
}

// rawStore is the least a hand-written idempotency check does on a store:
// claim a key, store the answer, read it back.
type rawStore interface {
	claim(ctx context.Context, scope, key string) (bool, error)
	complete(ctx context.Context, scope, key string, body []byte) error
	get(ctx context.Context, scope, key string) ([]byte, bool, error)
}

// rawRedis keeps its keys under the run's prefix, which the run deletes
// at its end.
type rawRedis struct {
	c      *redis.Client
	prefix string
}

func (r rawRedis) claim(ctx context.Context, scope, key string) (bool, error) {
	return r.c.SetNX(ctx, r.prefix+"raw:"+scope+":"+key, "in_progress", 30*time.Second).Result()
}
func (r rawRedis) complete(ctx context.Context, scope, key string, body []byte) error {
	return r.c.Set(ctx, r.prefix+"raw:"+scope+":"+key, body, 24*time.Hour).Err()
}
func (r rawRedis) get(ctx context.Context, scope, key string) ([]byte, bool, error) {
	b, err := r.c.Get(ctx, r.prefix+"raw:"+scope+":"+key).Bytes()
	if err == redis.Nil {
		return nil, false, nil
	}
	return b, err == nil && string(b) != "in_progress", err
}

const rawTable = `CREATE TABLE IF NOT EXISTS bench_raw (scope text NOT NULL, key text NOT NULL, state text NOT NULL,
	body bytea, PRIMARY KEY (scope, key))`

type rawPG struct{ p *pgxpool.Pool }

func (r rawPG) claim(ctx context.Context, scope, key string) (bool, error) {
	tag, err := r.p.Exec(ctx, `INSERT INTO bench_raw (scope, key, state) VALUES ($1, $2, 'in_progress') ON CONFLICT DO NOTHING`, scope, key)
	return tag.RowsAffected() == 1, err
}
func (r rawPG) complete(ctx context.Context, scope, key string, body []byte) error {
	_, err := r.p.Exec(ctx, `UPDATE bench_raw SET state = 'completed', body = $3 WHERE scope = $1 AND key = $2`, scope, key, body)
	return err
}
func (r rawPG) get(ctx context.Context, scope, key string) ([]byte, bool, error) {
	var state string
	var body []byte
	err := r.p.QueryRow(ctx, `SELECT state, body FROM bench_raw WHERE scope = $1 AND key = $2`, scope, key).Scan(&state, &body)
	if err != nil && strings.Contains(err.Error(), "no rows") {
		return nil, false, nil
	}
	return body, err == nil && state == "completed", err
}

// rawSQLite serialises its writes in the process, as sqlitestore does.
type rawSQLite struct {
	mu                               *sync.Mutex
	claimStmt, completeStmt, getStmt *sql.Stmt
}

func (r rawSQLite) claim(ctx context.Context, scope, key string) (bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	res, err := r.claimStmt.ExecContext(ctx, scope, key)
	if err != nil {
		return false, err
	}
	n, _ := res.RowsAffected()
	return n == 1, nil
}
func (r rawSQLite) complete(ctx context.Context, scope, key string, body []byte) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, err := r.completeStmt.ExecContext(ctx, body, scope, key)
	return err
}
func (r rawSQLite) get(ctx context.Context, scope, key string) ([]byte, bool, error) {
	var state string
	var body []byte
	err := r.getStmt.QueryRowContext(ctx, scope, key).Scan(&state, &body)
	if err == sql.ErrNoRows {
		return nil, false, nil
	}
	return body, err == nil && state == "completed", err
}

// openRaw opens the raw store of a DSN, on a table (or key prefix) of its own.
func openRaw(ctx context.Context, dsn string) (rawStore, func(), error) {
	switch storeopen.Kind(dsn) {
	case "redis":
		opt, err := redis.ParseURL(strings.Split(dsn, "?")[0])
		if err != nil {
			return nil, nil, err
		}
		opt.PoolSize = 64
		c := redis.NewClient(opt)
		return rawRedis{c, redisPrefix(dsn)}, func() { c.Close() }, nil
	case "postgres":
		u, _ := url.Parse(dsn)
		q := u.Query()
		q.Del("idem_schema")
		u.RawQuery = q.Encode()
		p, err := pgxpool.New(ctx, u.String())
		if err != nil {
			return nil, nil, err
		}
		if _, err := p.Exec(ctx, rawTable); err != nil {
			return nil, nil, err
		}
		return rawPG{p}, p.Close, nil
	case "sqlite":
		path := strings.TrimPrefix(dsn, "sqlite:")
		db, err := sql.Open("sqlite", "file:"+filepath.Join(filepath.Dir(path), "raw.db")+"?_txlock=immediate&_journal_mode=WAL&_synchronous=FULL&_busy_timeout=10000")
		if err != nil {
			return nil, nil, err
		}
		if _, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS bench_raw (scope TEXT NOT NULL, key TEXT NOT NULL, state TEXT NOT NULL, body BLOB, PRIMARY KEY (scope, key))`); err != nil {
			return nil, nil, err
		}
		r := rawSQLite{mu: new(sync.Mutex)}
		for st, q := range map[**sql.Stmt]string{
			&r.claimStmt:    `INSERT INTO bench_raw (scope, key, state) VALUES (?, ?, 'in_progress') ON CONFLICT DO NOTHING`,
			&r.completeStmt: `UPDATE bench_raw SET state = 'completed', body = ? WHERE scope = ? AND key = ?`,
			&r.getStmt:      `SELECT state, body FROM bench_raw WHERE scope = ? AND key = ?`,
		} {
			if *st, err = db.PrepareContext(ctx, q); err != nil {
				return nil, nil, err
			}
		}
		return r, func() { db.Close() }, nil
	}
	return nil, nil, fmt.Errorf("no raw operations for %s", dsn)
}

// withRaw runs next behind the raw idempotency check: a replay is the stored
// body, a new key is claimed, run and completed. calls counts its store
// operations. scope, when set, names the caller whose keys a key is
// among (as idem's targets do, by httpidem.HashScope("Authorization")).
func withRaw(raw rawStore, next http.Handler, calls *atomic.Int64, scope func(*http.Request) string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key, caller := r.Header.Get("Idempotency-Key"), ""
		if scope != nil {
			caller = scope(r)
		}
		ctx := r.Context()
		calls.Add(1)
		body, done, err := raw.get(ctx, caller, key)
		switch {
		case err != nil:
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		case done:
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			w.Write(body)
			return
		}
		calls.Add(2) // the claim and the completion
		if ok, err := raw.claim(ctx, caller, key); err != nil || !ok {
			http.Error(w, "in progress", http.StatusConflict)
			return
		}
		rec := &capture{header: http.Header{}}
		next.ServeHTTP(rec, r)
		if err := raw.complete(ctx, caller, key, rec.body); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		for k, v := range rec.header {
			w.Header()[k] = v
		}
		w.WriteHeader(rec.status)
		w.Write(rec.body)
	})
}

// capture keeps a response (for the raw check, which stores it).
type capture struct {
	header http.Header
	status int
	body   []byte
}

func (c *capture) Header() http.Header         { return c.header }
func (c *capture) WriteHeader(s int)           { c.status = s }
func (c *capture) Write(b []byte) (int, error) { c.body = append(c.body, b...); return len(b), nil }

// serve is the child process: it serves one target, prints its address and
// serves until its standard input closes.
func serve(target, dsn string, delay time.Duration) error {
	ctx := context.Background()
	quiet := slog.New(slog.DiscardHandler)
	var h http.Handler
	var calls func() int64
	upstream := func() (string, error) { // a bare API for the hops
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return "", err
		}
		go (&http.Server{Handler: handler(delay)}).Serve(ln)
		return "http://" + ln.Addr().String(), nil
	}
	engine := func() (*idem.Engine, error) {
		opened, err := storeopen.Open(ctx, dsn)
		if err != nil {
			return nil, err
		}
		c := &testkit.Counted{Store: opened.Store}
		calls = c.Calls
		return idem.New(idem.Config{Store: c, Logger: quiet})
	}
	kind, _, _ := strings.Cut(target, ":")
	switch kind {
	case "bare":
		h = handler(delay)
	case "raw", "raw-scoped", "hop-raw":
		raw, _, err := openRaw(ctx, dsn)
		if err != nil {
			return err
		}
		next := handler(delay)
		if kind == "hop-raw" {
			up, err := upstream()
			if err != nil {
				return err
			}
			u, _ := url.Parse(up)
			next = httputil.NewSingleHostReverseProxy(u)
		}
		var n atomic.Int64
		calls = n.Load
		var scope func(*http.Request) string
		if kind == "raw-scoped" {
			scope = httpidem.HashScope("Authorization")
		}
		h = withRaw(raw, next, &n, scope)
	case "idem":
		eng, err := engine()
		if err != nil {
			return err
		}
		mw, err := httpidem.New(httpidem.Config{Engine: eng, Scope: httpidem.HashScope("Authorization"), Logger: quiet})
		if err != nil {
			return err
		}
		h = mw.Wrap(handler(delay))
	case "hop":
		up, err := upstream()
		if err != nil {
			return err
		}
		u, _ := url.Parse(up)
		h = httputil.NewSingleHostReverseProxy(u)
	case "proxy":
		eng, err := engine()
		if err != nil {
			return err
		}
		up, err := upstream()
		if err != nil {
			return err
		}
		cfg := proxy.DefaultConfig()
		cfg.Upstream = up
		if h, err = proxy.Handler(cfg, eng, quiet, proxy.Hooks{}); err != nil {
			return err
		}
	default:
		return fmt.Errorf("no target %q", target)
	}
	mux := http.NewServeMux()
	mux.Handle("/", h)
	mux.HandleFunc("GET /_calls", func(w http.ResponseWriter, r *http.Request) {
		var n int64
		if calls != nil {
			n = calls()
		}
		json.NewEncoder(w).Encode(n)
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	if dir := os.Getenv("BENCH_CPUPROFILE"); dir != "" { // a CPU profile of each target
		f, err := os.Create(filepath.Join(dir, strings.ReplaceAll(target, ":", "-")+".pprof"))
		if err != nil {
			return err
		}
		defer f.Close()
		pprof.StartCPUProfile(f)
		defer pprof.StopCPUProfile()
	}
	fmt.Println("ADDR", ln.Addr().String())
	go (&http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}).Serve(ln)
	bufio.NewReader(os.Stdin).ReadString('\n') // until the parent closes it
	return nil
}

// redisAddr is the host:port of a Redis DSN.
func redisAddr(dsn string) string {
	if u, err := url.Parse(dsn); err == nil {
		return u.Host
	}
	return ""
}

// redisPrefix is the idem_prefix of a Redis DSN: the run's keys begin with it.
func redisPrefix(dsn string) string {
	if u, err := url.Parse(dsn); err == nil {
		return u.Query().Get("idem_prefix")
	}
	return ""
}
