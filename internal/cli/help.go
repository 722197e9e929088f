package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"runtime/debug"
	"slices"
	"strings"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/proxy"
	"github.com/idemhq/idem/internal/storeopen"
	"github.com/idemhq/idem/internal/telemetry"
)

// command is a subcommand as its help presents it.
type command struct {
	name     string // "proxy", "keys ls"
	summary  string // what it does, in a line
	synopsis string // how to call it
	examples []string
}

// storeKinds lists the store DSNs, for flags' help.
const storeKinds = "sqlite:PATH, postgres://…, redis://…, redis+cluster://…, dynamodb://…, memcached://… or memory:"

// commands are every subcommand, in the order `idem help` lists them.
var commands = []command{
	{"proxy", "put the idempotency contract in front of any HTTP API", "idem proxy --upstream URL [flags]", []string{
		"idem proxy --upstream http://127.0.0.1:9000",
		"idem proxy --upstream http://api:9000 --store postgres://idem@db/payments --admin-listen 127.0.0.1:9090",
		"idem proxy --config idem.yaml",
	}},
	{"demo", "the reference payments service, a simulated card acquirer and a reconciler", "idem demo [flags]", []string{
		"idem demo",
		"idem demo --store postgres://postgres@127.0.0.1/test --listen 127.0.0.1:8080",
	}},
	{"keys ls", "list records by state, scope, key and creation time", "idem keys ls [flags]", []string{
		"idem keys ls --state completed --key order- --since 2h",
		"idem keys ls --state stale",
		"idem keys ls --scope 9f86d081 --json",
	}},
	{"keys show", "print one record as JSON, its stored response included", "idem keys show KEY [--scope SCOPE] [flags]", []string{
		"idem keys show order-1",
		"idem keys show order-1 --scope 9f86d081",
	}},
	{"keys resolve", "settle a record by hand: it happened (--completed) or it did not (--failed)", "idem keys resolve KEY [--scope SCOPE] (--failed | --completed --status N [--body TEXT]) [flags]", []string{
		"idem keys resolve order-1 --failed",
		"idem keys resolve order-1 --scope 9f86d081 --completed --status 201 --body '{\"id\":\"ch_1\"}' --header 'Content-Type: application/json'",
	}},
	{"keys purge", "delete settled records whose retention ran out before a time", "idem keys purge --before TIME [flags]", []string{
		"idem keys purge --before 72h",
		"idem keys purge --before 2026-11-01T00:00:00Z",
	}},
	{"reconcile", "settle stale records by asking a resolver URL what happened", "idem reconcile --resolver-url URL [flags]", []string{
		"idem reconcile --store sqlite:idem.db --resolver-url http://127.0.0.1:9000/idem/resolve",
		"idem reconcile --resolver-url http://api/idem/resolve --once",
	}},
	{"verify", "check, from the outside, that an API honours the idempotency contract", "idem verify --url URL [flags]", []string{
		"idem verify --url http://127.0.0.1:8081/orders",
		"idem verify --url http://127.0.0.1:8080/v1/charges --body '{\"amount\":1000,\"currency\":\"eur\",\"customer\":\"cus_1\"}' --require-key --credential 'Bearer sk_a' --credential 'Bearer sk_b'",
	}},
	{"echo", "a toy API that numbers each request it runs, to try idem on", "idem echo [flags]", []string{
		"idem echo --listen 127.0.0.1:9000 --delay 3s",
	}},
	{"version", "print idem's version", "idem version", nil},
}

func commandNamed(name string) command {
	for _, c := range commands {
		if c.name == name {
			return c
		}
	}
	return command{name: name, synopsis: "idem " + name}
}

// newFlags returns a command's flag set; parseFlags reports its errors.
func newFlags(name string) *flag.FlagSet {
	fs := flag.NewFlagSet("idem "+name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	return fs
}

// errReported is a command-line error already told to the user: the exit
// status is 2.
var errReported = errors.New("reported")

// parseFlags parses a command's flags, which may come before or after its
// arguments, and returns the arguments. On --help it prints the command's
// help to stdout and returns flag.ErrHelp; on a wrong flag it says what is
// wrong to stderr and returns errReported.
func parseFlags(fs *flag.FlagSet, args []string, stdout, stderr io.Writer) ([]string, error) {
	var pos []string
	for {
		err := fs.Parse(args)
		switch {
		case errors.Is(err, flag.ErrHelp):
			printHelp(stdout, commandNamed(strings.TrimPrefix(fs.Name(), "idem ")), fs)
			return nil, flag.ErrHelp
		case err != nil:
			usageError(stderr, fs.Name(), flagError(fs, err))
			return nil, errReported
		}
		if fs.NArg() == 0 {
			return pos, nil
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
}

// parseFlagsOnly is parseFlags for a command that takes no arguments.
func parseFlagsOnly(fs *flag.FlagSet, args []string, stdout, stderr io.Writer) error {
	pos, err := parseFlags(fs, args, stdout, stderr)
	if err == nil && len(pos) > 0 {
		usageError(stderr, fs.Name(), fmt.Sprintf("unexpected argument %q: this command takes only flags", pos[0]))
		return errReported
	}
	return err
}

// usageError tells the user what is wrong with the command line and where to
// read how it goes.
func usageError(stderr io.Writer, name, msg string) {
	fmt.Fprintf(stderr, "%s: %s\nRun '%s --help' for its flags and examples.\n", name, msg, name)
}

// exitStatus is the exit status of a command that stopped at its command
// line: 0 after its help, 2 after a usage error.
func exitStatus(err error) int {
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	return 2
}

// message is err's text for a person: without the "idem: invalid input: "
// or "idem: " that the library's errors start with.
func message(err error) string {
	msg := strings.TrimPrefix(err.Error(), idem.ErrInvalid.Error()+": ")
	return strings.TrimPrefix(msg, "idem: ")
}

// fail tells the user that command name failed with err, and returns the
// exit status.
func fail(stderr io.Writer, name string, err error) int {
	fmt.Fprintf(stderr, "%s: %s\n", name, message(err))
	return errorStatus(err)
}

// errorStatus is the exit status of a command that failed with err: 2 when what it
// was given is invalid (a DSN that does not parse, say), 1 otherwise.
func errorStatus(err error) int {
	if errors.Is(err, idem.ErrInvalid) {
		return 2
	}
	return 1
}

// flagError rewords the flag package's errors the way idem spells flags.
func flagError(fs *flag.FlagSet, err error) string {
	msg := err.Error()
	if name, ok := strings.CutPrefix(msg, "flag provided but not defined: -"); ok {
		return "unknown flag --" + strings.TrimPrefix(name, "-")
	}
	if name, ok := strings.CutPrefix(msg, "flag needs an argument: -"); ok {
		return "--" + strings.TrimPrefix(name, "-") + " needs a value"
	}
	var value, name string
	if _, err := fmt.Sscanf(strings.Replace(msg, "invalid boolean value", "invalid value", 1), "invalid value %q for flag -%s", &value, &name); err == nil {
		name = strings.TrimSuffix(name, ":")
		_, want, _ := strings.Cut(msg, " for flag -"+name+": ")
		return badValue(fs.Lookup(name), "--"+name, value, want)
	}
	return msg
}

// badValue says that value, given to flag f as label (--lease, or
// $IDEM_LEASE), is not one it takes, and what it takes where the flag's
// type says more than want, the flag package's words. A secret's value is
// not repeated.
func badValue(f *flag.Flag, label, value, want string) string {
	if g, ok := f.Value.(flag.Getter); ok {
		switch g.Get().(type) {
		case time.Duration:
			want = "want a duration such as 30s or 5m"
		case int, int64, uint, uint64:
			want = "want a whole number"
		case bool:
			want = "want true or false"
		}
	}
	if _, ok := f.Value.(interface{ secret() }); ok {
		return fmt.Sprintf("%s: %s", label, want)
	}
	return fmt.Sprintf("%s %q: %s", label, value, want)
}

// printHelp prints a command's help in the one style every command shares.
func printHelp(w io.Writer, c command, fs *flag.FlagSet) {
	fmt.Fprintf(w, "idem %s: %s.\n\nUsage:\n  %s\n", c.name, c.summary, c.synopsis)
	if len(c.examples) > 0 {
		fmt.Fprint(w, "\nExamples:\n")
		for _, e := range c.examples {
			fmt.Fprintf(w, "  %s\n", e)
		}
	}
	if fs == nil {
		return
	}
	type line struct{ name, usage string }
	var lines []line
	width := 0
	fs.VisitAll(func(f *flag.Flag) {
		placeholder, usage := flag.UnquoteUsage(f)
		if p, ok := f.Value.(interface{ placeholder() string }); ok && usage == f.Usage {
			placeholder = p.placeholder() // no `NAME` in the usage
		}
		if placeholder == "int" {
			placeholder = "n"
		}
		name := "--" + f.Name
		if placeholder != "" && !isBool(f) {
			name += " " + strings.ToUpper(placeholder)
		}
		d := f.DefValue
		if g, ok := f.Value.(flag.Getter); ok {
			if v, ok := g.Get().(time.Duration); ok {
				d = formatDuration(v)
			}
		}
		if d != "" && d != "false" && d != "0" && d != "0s" && d != "[]" && !strings.Contains(usage, "(default") {
			env := ""
			if i := strings.LastIndex(usage, " [$"); i >= 0 {
				usage, env = usage[:i], usage[i:]
			}
			usage += " (default " + d + ")" + env
		}
		lines = append(lines, line{name, usage})
		width = max(width, len(name))
	})
	if len(lines) > 0 {
		fmt.Fprint(w, "\nFlags:\n")
		for _, l := range lines {
			fmt.Fprintf(w, "  %-*s  %s\n", width, l.name, l.usage)
		}
	}
}

func isBool(f *flag.Flag) bool {
	b, ok := f.Value.(interface{ IsBoolFlag() bool })
	return ok && b.IsBoolFlag()
}

// printUsage prints idem's own help: every command in a line.
func printUsage(w io.Writer) {
	fmt.Fprint(w, "idem makes side effects behind HTTP APIs happen exactly once.\n\nUsage:\n  idem COMMAND [flags]\n\nCommands:\n")
	for _, c := range commands {
		fmt.Fprintf(w, "  %-13s %s\n", c.name, c.summary)
	}
	fmt.Fprint(w, "\nRun 'idem help COMMAND' (or 'idem COMMAND --help') for a command's flags and examples.\n")
}

// version is idem's version as the build recorded it: the module's version,
// or the commit it was built from.
func version() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	v := info.Main.Version
	rev, dirty := "", false
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if (v == "" || v == "(devel)") && rev != "" {
		v = "devel " + rev[:min(12, len(rev))]
		if dirty {
			v += " (modified)"
		}
	}
	if v == "" {
		v = "(devel)"
	}
	return v + " " + info.GoVersion
}

// deployment are the flags of the commands that work on a deployment's
// store (keys, reconcile): --config, --store and, for those that settle
// records, --retention. They are read as the proxy reads them: its
// defaults, then the YAML file, then the environment, then the flags; the
// flags' defaults in help are the proxy's, never the environment's (which
// may hold a password).
type deployment struct {
	config, store, retention *string
}

// deploymentFlags adds the deployment's flags to fs; settles adds
// --retention.
func deploymentFlags(fs *flag.FlagSet, settles bool) *deployment {
	d := &deployment{
		config: fs.String("config", "", "the proxy's YAML configuration `file`, for its store and its longest retention [$IDEM_CONFIG]"),
		store:  fs.String("store", storeopen.Default, "the store, a `DSN`: "+storeKinds+" [$IDEM_STORE]"),
	}
	if settles {
		// It must be the deployment's (its longest, when routes differ): a
		// shorter one lets a retry the deployment promises to answer run
		// again.
		d.retention = fs.String("retention", idem.DefaultRetention.String(),
			"how long an outcome settled here is replayed: the deployment's `retention` (its longest) [$IDEM_RETENTION]")
	}
	return d
}

// deploymentNames are the flags of a deployment, which applyEnv leaves to
// it.
var deploymentNames = []string{"config", "store", "retention"}

// resolve returns the store and the retention (the longest of the
// routes') of the deployment the parsed flags, the environment and the
// configuration file describe.
func (d *deployment) resolve(fs *flag.FlagSet, env Env) (string, time.Duration, error) {
	cfg := proxy.DefaultConfig()
	path := configFile(fs, *d.config, env)
	routes, err := readConfigFile(path, &cfg)
	if err != nil {
		return "", 0, err
	}
	for _, s := range proxySettings() {
		if s.yaml != "store" && (s.yaml != "retention" || d.retention == nil) {
			continue
		}
		if v := env(s.env); v != "" {
			if err := s.set(&cfg, v, true); err != nil {
				return "", 0, fmt.Errorf("$%s: %w", s.env, err)
			}
		}
		if isSet(fs, s.flag) {
			v := *d.store
			if s.flag == "retention" {
				v = *d.retention
			}
			if err := s.set(&cfg, v, true); err != nil {
				return "", 0, fmt.Errorf("--%s: %w", s.flag, err)
			}
		}
	}
	if cfg.Engine.Retention <= 0 {
		return "", 0, fmt.Errorf("retention %s: want a positive duration, such as 72h", formatDuration(cfg.Engine.Retention))
	}
	if err := routes.decode(&cfg); err != nil {
		return "", 0, fmt.Errorf("config %s: %w", path, err)
	}
	cfg = cfg.PinRetentions()
	return cfg.Store, cfg.Engine.Retention, nil
}

// isSet reports whether the flag name was given on the command line.
func isSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

// applyEnv gives each flag of fs not on the command line the value of the
// variable its usage names ("[$IDEM_…]"), when that is set; except are
// flags read otherwise. A flag's default in help is thus never the
// environment's, which may hold a secret.
func applyEnv(fs *flag.FlagSet, env Env, except ...string) error {
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		i := strings.LastIndex(f.Usage, "[$")
		if err != nil || i < 0 || !strings.HasSuffix(f.Usage, "]") || slices.Contains(except, f.Name) || isSet(fs, f.Name) {
			return
		}
		name := f.Usage[i+2 : len(f.Usage)-1]
		if v := env(name); v != "" {
			if e := fs.Set(f.Name, v); e != nil {
				err = errors.New(badValue(f, "$"+name, v, e.Error()))
			}
		}
	})
	return err
}

// logFlag is the --log-format flag of the commands that log; the logger is
// made once the flags are parsed and the environment applied (applyEnv).
func logFlag(fs *flag.FlagSet, stderr io.Writer) func() (*slog.Logger, error) {
	format := fs.String("log-format", "text", "`format` of log lines: text or json [$IDEM_LOG_FORMAT]")
	return func() (*slog.Logger, error) {
		log, err := proxy.Config{LogFormat: *format}.Logger(stderr)
		if err == nil {
			storeopen.SetLogger(log)
			telemetry.SetLogger(log)
		}
		return log, err
	}
}
