// Package cli is the `idem` command: its subcommands, flags, environment
// variables and configuration file.
package cli

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/proxy"
	"github.com/idemhq/idem/internal/storeopen"
	"github.com/idemhq/idem/internal/telemetry"
)

// Env reads environment variables (os.Getenv in production).
type Env func(string) string

const usage = `idem makes side effects behind HTTP APIs happen exactly once.

Usage:
  idem proxy --upstream URL [--listen ADDR] [--store DSN] [--config FILE] [flags]
  idem demo [--listen ADDR] [--store DSN] [--acquirer URL]
  idem keys ls|show|resolve|purge [flags]
  idem reconcile --resolver-url URL [--store DSN] [--once]
  idem verify --url URL [--body JSON] [--header 'H: V']… [--require-key] [--credential C]… [--json]
  idem echo [--listen ADDR] [--delay D]
  idem help [COMMAND]

Commands:
  proxy      put the idempotency contract in front of any HTTP API
  demo       the reference payments service, a simulated card acquirer and a reconciler
  keys       list, inspect, resolve and purge records in any store
  reconcile  settle stale records by asking a resolver URL what happened
  verify     check, from the outside, that an API honours the idempotency contract
  echo       a toy API that numbers each request it runs, to try idem on

Run 'idem help proxy' for its flags.
`

// Main runs the command line args and returns the exit status.
func Main(ctx context.Context, args []string, env Env, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	switch args[0] {
	case "proxy":
		return runProxy(ctx, args[1:], env, stdout, stderr)
	case "echo":
		return runEcho(ctx, args[1:], stdout, stderr)
	case "demo":
		return runDemo(ctx, args[1:], env, stdout, stderr)
	case "keys":
		return runKeys(ctx, args[1:], env, stdout, stderr)
	case "reconcile":
		return runReconcile(ctx, args[1:], env, stdout, stderr)
	case "verify":
		return runVerify(ctx, args[1:], stdout, stderr)
	case "help", "-h", "--help":
		if len(args) > 1 && args[1] == "proxy" {
			runProxy(ctx, []string{"-h"}, env, stdout, stdout)
			return 0
		}
		fmt.Fprint(stdout, usage)
		return 0
	}
	fmt.Fprintf(stderr, "idem: unknown command %q\n\n%s", args[0], usage)
	return 2
}

// setting is one configuration value, settable from the YAML file, an
// IDEM_* environment variable and a flag, in that order of precedence
// (the flag wins).
type setting struct {
	flag, env, help string
	set             func(*proxy.Config, string) error
}

// boolFlags are the settings that are flags without a value (--require-key).
var boolFlags = map[string]bool{"require-key": true}

// flagValue holds a flag as text until the settings are applied in order.
type flagValue struct {
	v      string
	isBool bool
}

func (f *flagValue) String() string     { return f.v }
func (f *flagValue) Set(v string) error { f.v = v; return nil }
func (f *flagValue) IsBoolFlag() bool   { return f.isBool }

func duration(dst func(*proxy.Config) *time.Duration) func(*proxy.Config, string) error {
	return func(c *proxy.Config, v string) error {
		d, err := time.ParseDuration(v)
		if err != nil || d < 0 {
			return fmt.Errorf("%q is not a duration such as 30s or 24h", v)
		}
		*dst(c) = d
		return nil
	}
}

func text(dst func(*proxy.Config) *string) func(*proxy.Config, string) error {
	return func(c *proxy.Config, v string) error { *dst(c) = v; return nil }
}

var proxySettings = []setting{
	{"listen", "IDEM_LISTEN", "address to serve the proxied API on (default " + proxy.DefaultListen + ")",
		text(func(c *proxy.Config) *string { return &c.Listen })},
	{"upstream", "IDEM_UPSTREAM", "URL of the API behind the proxy (required)",
		text(func(c *proxy.Config) *string { return &c.Upstream })},
	{"store", "IDEM_STORE", "store DSN: sqlite:PATH, postgres://…, redis://…, memory: (default " + storeopen.Default + ")",
		text(func(c *proxy.Config) *string { return &c.Store })},
	{"admin-listen", "IDEM_ADMIN_LISTEN", "address for /healthz and /readyz (default off)",
		text(func(c *proxy.Config) *string { return &c.AdminListen })},
	{"lease", "IDEM_LEASE", "lease length, renewed while the upstream works (default 30s)",
		duration(func(c *proxy.Config) *time.Duration { return &c.Lease })},
	{"retention", "IDEM_RETENTION", "how long outcomes are replayed (default 24h)",
		duration(func(c *proxy.Config) *time.Duration { return &c.Retention })},
	{"upstream-timeout", "IDEM_UPSTREAM_TIMEOUT", "wait for upstream response headers; past it the outcome is unknown (default 60s)",
		duration(func(c *proxy.Config) *time.Duration { return &c.UpstreamTimeout })},
	{"shutdown-timeout", "IDEM_SHUTDOWN_TIMEOUT", "how long SIGTERM lets in-flight requests finish (default 30s)",
		duration(func(c *proxy.Config) *time.Duration { return &c.ShutdownTimeout })},
	{"scope-header", "IDEM_SCOPE_HEADER", "header whose SHA-256 scopes keys per caller, or none (default " + proxy.DefaultScopeHeader + ")",
		text(func(c *proxy.Config) *string { return &c.Defaults.ScopeHeader })},
	{"require-key", "IDEM_REQUIRE_KEY", "answer 400 to covered requests without a key (default false)",
		func(c *proxy.Config, v string) error {
			b, err := strconv.ParseBool(v)
			if err != nil {
				return fmt.Errorf("%q is not true or false", v)
			}
			c.Defaults.RequireKey = &b
			return nil
		}},
	{"wait", "IDEM_WAIT", "let a duplicate wait this long for the first request instead of a 409 (default 0)",
		duration(func(c *proxy.Config) *time.Duration { return &c.Defaults.Wait })},
	{"store-timeout", "IDEM_STORE_TIMEOUT", "bound on each store call for a request, retries included (default 5s)",
		duration(func(c *proxy.Config) *time.Duration { return &c.StoreTimeout })},
	{"journal-dir", "IDEM_JOURNAL_DIR", "directory where outcomes wait while the store is unreachable, or none (default " + proxy.DefaultJournalDir + ")",
		text(func(c *proxy.Config) *string { return &c.JournalDir })},
	{"read-timeout", "IDEM_READ_TIMEOUT", "bound on reading a whole request, body included (default 30s)",
		duration(func(c *proxy.Config) *time.Duration { return &c.ReadTimeout })},
	{"write-timeout", "IDEM_WRITE_TIMEOUT", "bound from a request's headers to the end of its response; keep it above upstream-timeout + wait (default 90s)",
		duration(func(c *proxy.Config) *time.Duration { return &c.WriteTimeout })},
	{"idle-timeout", "IDEM_IDLE_TIMEOUT", "close a kept-alive client connection idle this long (default 60s)",
		duration(func(c *proxy.Config) *time.Duration { return &c.IdleTimeout })},
}

// loadProxyConfig builds the configuration: the YAML file (from --config or
// IDEM_CONFIG), then environment variables, then flags.
func loadProxyConfig(args []string, env Env, stderr io.Writer) (proxy.Config, *slog.Logger, error) {
	fs := flag.NewFlagSet("idem proxy", flag.ContinueOnError)
	fs.SetOutput(stderr)
	values := map[string]*flagValue{}
	for _, s := range proxySettings {
		values[s.flag] = &flagValue{isBool: boolFlags[s.flag]}
		fs.Var(values[s.flag], s.flag, s.help+" [$"+s.env+"]")
	}
	configPath := fs.String("config", "", "YAML configuration file [$IDEM_CONFIG]")
	logFormat := fs.String("log-format", "", "text or json (default text) [$IDEM_LOG_FORMAT]")
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), "Usage: idem proxy --upstream URL [flags]\n\nFlags (each also from its $IDEM_… variable, or the config file):\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return proxy.Config{}, nil, err
	}
	if fs.NArg() > 0 {
		return proxy.Config{}, nil, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	var cfg proxy.Config
	if path := cmp.Or(*configPath, env("IDEM_CONFIG")); path != "" {
		data, err := os.ReadFile(path)
		if err != nil {
			return cfg, nil, err
		}
		dec := yaml.NewDecoder(strings.NewReader(string(data)))
		dec.KnownFields(true)
		if err := dec.Decode(&cfg); err != nil && !errors.Is(err, io.EOF) {
			return cfg, nil, fmt.Errorf("config %s: %w", path, err)
		}
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	for _, s := range proxySettings {
		if v := env(s.env); v != "" {
			if err := s.set(&cfg, v); err != nil {
				return cfg, nil, fmt.Errorf("$%s: %w", s.env, err)
			}
		}
		if set[s.flag] {
			if err := s.set(&cfg, values[s.flag].v); err != nil {
				return cfg, nil, fmt.Errorf("--%s: %w", s.flag, err)
			}
		}
	}
	cfg.Store = cmp.Or(cfg.Store, storeopen.Default)
	var handler slog.Handler
	switch f := cmp.Or(*logFormat, env("IDEM_LOG_FORMAT"), "text"); f {
	case "text":
		handler = slog.NewTextHandler(stderr, nil)
	case "json":
		handler = slog.NewJSONHandler(stderr, nil)
	default:
		return cfg, nil, fmt.Errorf("--log-format %q: want text or json", f)
	}
	return cfg, slog.New(handler), nil
}

func runProxy(ctx context.Context, args []string, env Env, stdout, stderr io.Writer) int {
	cfg, log, err := loadProxyConfig(args, env, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(stderr, "idem proxy:", err)
		return 2
	}
	if err := cfg.Validate(); err != nil {
		fmt.Fprintln(stderr, "idem proxy:", err)
		return 2
	}
	opened, err := storeopen.OpenEventually(ctx, cfg.Store)
	if err != nil {
		fmt.Fprintln(stderr, "idem proxy: opening the store:", err)
		return 1
	}
	defer opened.Close()
	tel, err := telemetry.New(ctx, env)
	if err != nil {
		fmt.Fprintln(stderr, "idem proxy: telemetry:", err)
		return 1
	}
	defer tel.Shutdown(context.WithoutCancel(ctx))
	var notifier idem.Notifier
	if opened.NewNotifier != nil && cfg.Waits() {
		if notifier, err = opened.NewNotifier(ctx); err != nil {
			fmt.Fprintln(stderr, "idem proxy: starting cross-instance wake-ups:", err)
			return 1
		}
	}
	journal := cmp.Or(cfg.JournalDir, proxy.DefaultJournalDir)
	if journal == "none" {
		journal = ""
	}
	eng, err := idem.New(idem.Config{Store: tel.Store(opened.Kind, opened.Store), Notifier: notifier, Lease: cfg.Lease,
		Retention: cfg.Retention, StoreTimeout: cfg.StoreTimeout, JournalDir: journal, Logger: log})
	if err != nil {
		fmt.Fprintln(stderr, "idem proxy:", err)
		return 2
	}
	defer closeEngine(eng, cmp.Or(cfg.ShutdownTimeout, proxy.DefaultShutdownTimeout), log)
	health := watchHealth(ctx, eng, opened, tel, log)
	hooks := proxy.Hooks{Observe: tel.Observe, Wrap: tel.Wrap, Metrics: tel.Metrics()}
	if err := proxy.Serve(ctx, cfg, eng, health, log, hooks, nil); err != nil {
		fmt.Fprintln(stderr, "idem proxy:", err)
		return 1
	}
	return 0
}

// healthEvery is how often a server looks at its store's health.
const healthEvery = 10 * time.Second

// watchHealth starts looking at the store's health until ctx ends, and
// publishes it in the metrics.
func watchHealth(ctx context.Context, eng *idem.Engine, opened *storeopen.Opened, tel *telemetry.Telemetry, log *slog.Logger) *proxy.Health {
	health := proxy.NewHealth(eng, opened.Store, opened.Kind, log)
	health.Start(ctx, healthEvery)
	tel.Health(opened.Kind, func() (bool, bool, int, int) {
		st := health.Status()
		return st.Reachable, st.Known && st.Durability.CrashSafe, st.Restarts, st.Pending
	})
	return health
}

// closeEngine lands what waits in the engine's journal, for as long as the
// shutdown allows, and says what is left.
func closeEngine(eng *idem.Engine, within time.Duration, log *slog.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	if err := eng.Close(ctx); err != nil {
		log.Error("shutting down with outcomes the store has not taken", "err", err)
		return
	}
	log.Info("shut down")
}
