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
	"reflect"
	"strings"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/console"
	"github.com/idemhq/idem/internal/proxy"
	"github.com/idemhq/idem/internal/storeopen"
	"github.com/idemhq/idem/internal/telemetry"
)

// Env reads environment variables (os.Getenv in production).
type Env func(string) string

// Main runs the command line args and returns the exit status: 0 when it
// did what was asked, 1 when that failed, 2 when the command line was wrong.
func Main(ctx context.Context, args []string, env Env, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		printUsage(stderr)
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
	case "version", "--version":
		if err := parseFlagsOnly(newFlags("version"), args[1:], stdout, stderr); err != nil {
			return exitStatus(err)
		}
		fmt.Fprintln(stdout, "idem", version())
		return 0
	case "help", "-h", "--help":
		if len(args) == 1 || args[0] != "help" {
			printUsage(stdout)
			return 0
		}
		if name := strings.Join(args[1:], " "); commandNamed(name).summary != "" || name == "keys" {
			return Main(ctx, append(args[1:], "--help"), env, stdout, stderr)
		}
		fmt.Fprintf(stderr, "idem help: no command %q\n\n", strings.Join(args[1:], " "))
		printUsage(stderr)
		return 2
	}
	fmt.Fprintf(stderr, "idem: unknown command %q\n\n", args[0])
	printUsage(stderr)
	return 2
}

// loadProxyConfig builds the configuration: the defaults, then the YAML file
// (from --config or IDEM_CONFIG), then environment variables, then flags.
func loadProxyConfig(args []string, env Env, stdout, stderr io.Writer) (proxy.Config, *slog.Logger, error) {
	cfg := proxy.DefaultConfig()
	defaults := proxy.DefaultConfig()
	fs := newFlags("proxy")
	settings := proxySettings()
	flags := make([]*flagSetting, len(settings))
	for i, s := range settings {
		flags[i] = &flagSetting{s: s}
		help := settingHelp[strings.TrimPrefix(s.yaml, "defaults.")]
		switch d := s.defaultText(&defaults); d {
		case "":
		case "required":
			help += " (required)"
		default:
			help += " (default " + d + ")"
		}
		fs.Var(flags[i], s.flag, help+" [$"+s.env+"]")
	}
	configPath := fs.String("config", "", "YAML configuration `file` (see docs/config.md) [$IDEM_CONFIG]")
	if err := parseFlagsOnly(fs, args, stdout, stderr); err != nil {
		return cfg, nil, err
	}
	path := configFile(fs, *configPath, env)
	routes, err := readConfigFile(path, &cfg)
	if err != nil {
		return cfg, nil, err
	}
	// A variable that replaces what the file says is told at start: the
	// environment may come from elsewhere than the operator who wrote the
	// file (an image's ENV).
	var replaced []setting
	for i, s := range settings {
		if v := env(s.env); v != "" {
			file := s.field(&cfg).Interface()
			if err := s.set(&cfg, v, true); err != nil {
				return cfg, nil, fmt.Errorf("$%s: %w", s.env, err)
			}
			if routes.set[s.yaml] && !reflect.DeepEqual(file, s.field(&cfg).Interface()) {
				replaced = append(replaced, s)
			}
		}
		for n, v := range flags[i].values {
			if err := s.set(&cfg, v, n == 0); err != nil {
				return cfg, nil, fmt.Errorf("--%s: %w", s.flag, err)
			}
		}
	}
	// Every route starts from the defaults as the file, the environment
	// and the flags leave them.
	if err := routes.decode(&cfg); err != nil {
		return cfg, nil, fmt.Errorf("config %s: %w", path, err)
	}
	if err := cfg.Validate(); err != nil {
		return cfg, nil, err
	}
	log, err := cfg.Logger(stderr)
	if err == nil {
		for _, s := range replaced {
			log.Warn("a variable replaces the configuration file's setting", "setting", s.yaml, "variable", "$"+s.env, "config", path)
		}
	}
	return cfg, log, err
}

// configFile is the configuration file a command reads: --config's, when
// given (empty: none), else $IDEM_CONFIG's. One rule for every command.
func configFile(fs *flag.FlagSet, flagValue string, env Env) string {
	if isSet(fs, "config") {
		return flagValue
	}
	return env("IDEM_CONFIG")
}

// readConfigFile reads the YAML file at path, if any, over cfg, all but its
// routes, which it returns to be read once the defaults are complete.
func readConfigFile(path string, cfg *proxy.Config) (fileRoutes, error) {
	if path == "" {
		return fileRoutes{}, nil
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return fileRoutes{}, err
	}
	routes, err := decodeProxyFile(data, cfg)
	if err != nil {
		return fileRoutes{}, fmt.Errorf("config %s: %w", path, err)
	}
	return routes, nil
}

func runProxy(ctx context.Context, args []string, env Env, stdout, stderr io.Writer) (code int) {
	cfg, log, err := loadProxyConfig(args, env, stdout, stderr)
	switch {
	case errors.Is(err, flag.ErrHelp) || errors.Is(err, errReported):
		return exitStatus(err)
	case err != nil:
		fmt.Fprintln(stderr, "idem proxy:", message(err))
		return 2
	}
	shutdown, upstream := cmp.Or(cfg.ShutdownTimeout, proxy.DefaultShutdownTimeout), cmp.Or(cfg.UpstreamTimeout, proxy.DefaultUpstreamTimeout)
	if shutdown <= upstream {
		log.Warn("shutdown_timeout is not above upstream_timeout: a graceful stop may cut a request still waiting on the upstream, its outcome then unknown until reconciled",
			"shutdown_timeout", shutdown, "upstream_timeout", upstream)
	}
	// The shutdown's one deadline, from the first signal: the servers'
	// drain, then the engine's close, share it.
	stop := &proxy.Stop{Timeout: shutdown}
	defer stop.Release()
	storeopen.SetLogger(log)
	telemetry.SetLogger(log)
	opened, err := storeopen.OpenEventually(ctx, cfg.Store)
	if err != nil {
		return fail(stderr, "idem proxy: opening the store", err)
	}
	defer func() { opened.Close() }() // the Close of when it returns: NewNotifier replaces it
	tel, err := telemetry.New(ctx, env)
	if err != nil {
		return fail(stderr, "idem proxy: telemetry", err)
	}
	defer tel.Shutdown(context.Background()) // bounded by telemetry.FlushTimeout
	var notifier idem.Notifier
	if opened.NewNotifier != nil && cfg.Waits() {
		if notifier, err = opened.NewNotifier(ctx); err != nil {
			return fail(stderr, "idem proxy: starting cross-instance wake-ups", err)
		}
	}
	cfg = cfg.PinRetentions()
	engCfg := cfg.Engine
	engCfg.Store, engCfg.Notifier, engCfg.JournalDir, engCfg.Logger = tel.Store(opened.Kind, opened.Store), notifier, cfg.JournalDir(), log
	eng, err := idem.New(engCfg)
	if err != nil {
		return fail(stderr, "idem proxy", err)
	}
	listened := false
	defer func() {
		ctx := stop.Begin()
		if !listened {
			// It never served (its address taken, say): nothing of this run
			// waits, and what the journal read stays on disk for the next
			// start. Waiting the shutdown's whole deadline for a store that
			// cannot be reached held a failed start 75 s.
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, neverServedClose)
			defer cancel()
		}
		if !closeEngine(ctx, eng, log) && code == 0 {
			code = 1 // work left: the last log line says what
		}
	}()
	health := watchHealth(ctx, eng, opened, tel, log)
	con, err := newConsole(eng, tel, console.Config{Token: cfg.AdminToken, ReadOnly: cfg.ConsoleReadOnly, Mask: cfg.ConsoleMask, Remote: cfg.ConsoleRemote}, cfg.AuditLog, log)
	if err != nil {
		return fail(stderr, "idem proxy", err)
	}
	hooks := proxy.Hooks{Observe: tel.Observe, Wrap: tel.Wrap, Metrics: tel.Metrics(), Console: con}
	served := proxy.Serve(ctx, stop, cfg, eng, health, log, hooks, func(string, string) { listened = true })
	if err := proxy.Failure(served); err != nil {
		return fail(stderr, "idem proxy", err)
	}
	return 0
}

// newConsole makes the operator console of a server, as cfg says, on its
// engine and its telemetry's counters; auditPath "" keeps the audit log in
// memory.
func newConsole(eng *idem.Engine, tel *telemetry.Telemetry, cfg console.Config, auditPath string, log *slog.Logger) (*console.Console, error) {
	audit, err := console.OpenAudit(auditPath, !cfg.ReadOnly)
	if err != nil {
		return nil, err
	}
	if lines := audit.Unreadable(); len(lines) > 0 {
		log.Warn("audit log: lines that do not parse (an append cut short?) are left as they are and passed over", "file", auditPath, "lines", lines)
	}
	cfg.Engine, cfg.Counts, cfg.Audit, cfg.Logger = eng, tel.Counts, audit, log
	return console.New(cfg)
}

// neverServedClose bounds the engine's close in a proxy that never listened.
const neverServedClose = time.Second

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

// closeEngine closes the engine within what is left of the shutdown's
// deadline (ctx): the requests still running settle, then what waits in the
// journal is stored. It says what is left, and reports whether nothing is:
// every outcome stored.
func closeEngine(ctx context.Context, eng *idem.Engine, log *slog.Logger) bool {
	if err := eng.Close(ctx); err != nil {
		log.Error("stopped with work left: requests still running stay in progress, then UNKNOWN for the reconciler; "+
			"outcomes the store has not taken wait in the journal directory for the next start (without one, they are lost)", "err", err)
		return false
	}
	log.Info("stopped: every outcome is stored")
	return true
}
