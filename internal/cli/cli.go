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
	"strings"
	"time"

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

// loadProxyConfig builds the configuration: the defaults, then the YAML file
// (from --config or IDEM_CONFIG), then environment variables, then flags.
func loadProxyConfig(args []string, env Env, stderr io.Writer) (proxy.Config, *slog.Logger, error) {
	cfg := proxy.DefaultConfig()
	defaults := proxy.DefaultConfig()
	fs := flag.NewFlagSet("idem proxy", flag.ContinueOnError)
	fs.SetOutput(stderr)
	settings := proxySettings()
	flags := make([]*flagSetting, len(settings))
	for i, s := range settings {
		flags[i] = &flagSetting{s: s}
		help := settingHelp[strings.TrimPrefix(s.yaml, "defaults.")]
		fs.Var(flags[i], s.flag, fmt.Sprintf("%s (default %s) [$%s]", help, s.show(&defaults), s.env))
	}
	configPath := fs.String("config", "", "YAML configuration file [$IDEM_CONFIG]")
	logFormat := fs.String("log-format", "", "text or json (default text) [$IDEM_LOG_FORMAT]")
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), "Usage: idem proxy --upstream URL [flags]\n\nFlags (each also from its $IDEM_… variable, or the config file):\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return cfg, nil, err
	}
	if fs.NArg() > 0 {
		return cfg, nil, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	if path := cmp.Or(*configPath, env("IDEM_CONFIG")); path != "" {
		data, err := os.ReadFile(path)
		if err != nil {
			return cfg, nil, err
		}
		if err := decodeProxyYAML(data, &cfg); err != nil {
			return cfg, nil, fmt.Errorf("config %s: %w", path, err)
		}
	}
	for i, s := range settings {
		if v := env(s.env); v != "" {
			if err := s.set(&cfg, v, true); err != nil {
				return cfg, nil, fmt.Errorf("$%s: %w", s.env, err)
			}
		}
		for n, v := range flags[i].values {
			if err := s.set(&cfg, v, n == 0); err != nil {
				return cfg, nil, fmt.Errorf("--%s: %w", s.flag, err)
			}
		}
	}
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
	engCfg := cfg.Engine
	engCfg.Store, engCfg.Notifier, engCfg.JournalDir, engCfg.Logger = tel.Store(opened.Kind, opened.Store), notifier, cfg.JournalDir(), log
	eng, err := idem.New(engCfg)
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
