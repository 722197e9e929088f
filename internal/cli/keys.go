package cli

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/storeopen"
	"github.com/idemhq/idem/reconcile"
)

const keysUsage = `Usage:
  idem keys ls      [--store DSN] [--state stale|unknown] [--limit N]
  idem keys show    KEY [--scope S] [--store DSN]
  idem keys resolve KEY [--scope S] [--store DSN] --failed
  idem keys resolve KEY [--scope S] [--store DSN] --completed --status N [--body TEXT | --body-file F] [--header 'Name: value']…
  idem keys purge   --before TIME [--store DSN]      (TIME: RFC 3339, or a duration ago such as 72h)

The store defaults to $IDEM_STORE, then sqlite:idem.db. Scopes are shown and
given as stored (the proxy stores a SHA-256 of the scope header).
`

// headerFlags collects repeated --header values.
type headerFlags http.Header

func (h headerFlags) String() string { return "" }
func (h headerFlags) Set(v string) error {
	name, value, ok := strings.Cut(v, ":")
	if !ok || strings.TrimSpace(name) == "" {
		return fmt.Errorf("%q: want 'Name: value'", v)
	}
	http.Header(h).Add(strings.TrimSpace(name), strings.TrimSpace(value))
	return nil
}

// interleaved parses flags that may come before or after positional
// arguments (idem keys show KEY --scope S).
func interleaved(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		if fs.NArg() == 0 {
			return pos, nil
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
}

// keysCommand is one subcommand of idem keys: its own flags, how many
// positional arguments (a key) it takes, and what it does with the engine.
type keysCommand struct {
	flags func(fs *flag.FlagSet) func(ctx context.Context, eng *idem.Engine, pos []string, stdout io.Writer) error
	keys  int
}

var keysCommands = map[string]keysCommand{"ls": {flags: keysLs}, "show": {flags: keysShow, keys: 1},
	"resolve": {flags: keysResolve, keys: 1}, "purge": {flags: keysPurge}}

// errUsage: the command line is wrong; the usage is shown.
var errUsage = errors.New("usage")

func runKeys(ctx context.Context, args []string, env Env, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, keysUsage)
		return 2
	}
	if args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		fmt.Fprint(stdout, keysUsage)
		return 0
	}
	sub := args[0]
	cmd, ok := keysCommands[sub]
	if !ok {
		fmt.Fprintf(stderr, "idem keys: unknown command %q\n\n%s", sub, keysUsage)
		return 2
	}
	fs := flag.NewFlagSet("idem keys "+sub, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, keysUsage) }
	store := fs.String("store", cmp.Or(env("IDEM_STORE"), storeopen.Default), "store DSN [$IDEM_STORE]")
	run := cmd.flags(fs)
	pos, err := interleaved(fs, args[1:])
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil || len(pos) != cmd.keys {
		if err == nil {
			fmt.Fprint(stderr, keysUsage)
		}
		return 2
	}
	opened, err := storeopen.Open(ctx, *store)
	if err != nil {
		fmt.Fprintf(stderr, "idem keys %s: %v\n", sub, err)
		return 1
	}
	defer opened.Close()
	eng, err := idem.New(idem.Config{Store: opened.Store})
	if err != nil {
		fmt.Fprintf(stderr, "idem keys %s: %v\n", sub, err)
		return 1
	}
	switch err := run(ctx, eng, pos, stdout); {
	case errors.Is(err, errUsage):
		fmt.Fprintf(stderr, "idem keys %s: %v\n\n%s", sub, err, keysUsage)
		return 2
	case err != nil:
		fmt.Fprintf(stderr, "idem keys %s: %v\n", sub, err)
		return 1
	}
	return 0
}

func keysLs(fs *flag.FlagSet) func(context.Context, *idem.Engine, []string, io.Writer) error {
	state := fs.String("state", "stale", "stale (unknown, or in progress past its lease) or unknown")
	limit := fs.Int("limit", 1000, "at most this many records")
	return func(ctx context.Context, eng *idem.Engine, _ []string, stdout io.Writer) error {
		if *state != "stale" && *state != "unknown" {
			return fmt.Errorf("%w: --state %q: want stale or unknown", errUsage, *state)
		}
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "SCOPE\tKEY\tSTATE\tFENCE\tLEASE ENDED\tCHECKPOINTS")
		shown, cursor := 0, ""
		for shown < *limit {
			page, err := eng.Scan(ctx, 0, cursor)
			if err != nil {
				return err
			}
			for _, r := range page.Records {
				if (*state == "unknown" && r.State != idem.StateUnknown) || shown == *limit {
					continue
				}
				shown++
				var cps []string
				for _, c := range r.Checkpoints {
					cps = append(cps, c.Name)
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\n", short(r.Scope), r.Key, r.State, r.Fence,
					r.LeaseExpires.UTC().Format(time.RFC3339), strings.Join(cps, ","))
			}
			if cursor = page.Cursor; cursor == "" {
				break
			}
		}
		tw.Flush()
		fmt.Fprintf(stdout, "%d record(s)\n", shown)
		return nil
	}
}

func keysShow(fs *flag.FlagSet) func(context.Context, *idem.Engine, []string, io.Writer) error {
	scope := fs.String("scope", "", "the record's scope, as stored")
	return func(ctx context.Context, eng *idem.Engine, pos []string, stdout io.Writer) error {
		r, err := eng.Get(ctx, *scope, pos[0])
		if err != nil {
			return err
		}
		if printJSON(stdout, recordView(r)) != 0 {
			return errors.New("writing the record")
		}
		return nil
	}
}

func keysResolve(fs *flag.FlagSet) func(context.Context, *idem.Engine, []string, io.Writer) error {
	scope := fs.String("scope", "", "the record's scope, as stored")
	failed := fs.Bool("failed", false, "nothing happened; release the key")
	completed := fs.Bool("completed", false, "it happened; store this outcome for replay")
	status := fs.Int("status", 0, "with --completed: the HTTP status to replay")
	body := fs.String("body", "", "with --completed: the body to replay")
	bodyFile := fs.String("body-file", "", "with --completed: a file holding the body to replay")
	force := fs.Bool("force", false, "even a record whose lease is still running")
	header := headerFlags{}
	fs.Var(header, "header", "with --completed: a header to replay, 'Name: value' (repeatable)")
	return func(ctx context.Context, eng *idem.Engine, pos []string, stdout io.Writer) error {
		if *failed == *completed {
			return fmt.Errorf("%w: say --failed or --completed", errUsage)
		}
		r, err := eng.Get(ctx, *scope, pos[0])
		if err != nil {
			return err
		}
		res := reconcile.Resolution{Outcome: reconcile.Failed}
		if *completed {
			if *status < 100 || *status > 999 {
				return fmt.Errorf("%w: --completed needs --status, an HTTP status", errUsage)
			}
			b := []byte(*body)
			if *bodyFile != "" {
				if b, err = os.ReadFile(*bodyFile); err != nil {
					return err
				}
			}
			res = reconcile.Resolution{Outcome: reconcile.Completed, Response: &idem.Response{Status: *status, Header: http.Header(header), Body: b}}
		}
		switch err := reconcile.Resolve(ctx, eng, r, res, *force); {
		case errors.Is(err, reconcile.ErrLeaseRunning):
			return fmt.Errorf("%v; wait, or say --force", err)
		case errors.Is(err, idem.ErrLeaseLost):
			return errors.New("the record changed meanwhile (settled or taken over); look again with show")
		case err != nil:
			return err
		}
		fmt.Fprintf(stdout, "resolved %s as %s\n", pos[0], map[bool]string{true: "failed: the next retry runs", false: "completed: retries replay it"}[*failed])
		return nil
	}
}

func keysPurge(fs *flag.FlagSet) func(context.Context, *idem.Engine, []string, io.Writer) error {
	before := fs.String("before", "", "settled records that expired before this time (RFC 3339, or a duration ago such as 72h)")
	return func(ctx context.Context, eng *idem.Engine, _ []string, stdout io.Writer) error {
		t, err := parseBefore(*before, time.Now())
		if err != nil {
			return fmt.Errorf("%w: %v", errUsage, err)
		}
		progress := newProgress(fs.Output(), "purging")
		total, err := eng.Prune(ctx, idem.PruneOptions{Before: t, Progress: progress.update})
		progress.done()
		if err != nil {
			return fmt.Errorf("after %d: %w", total, err)
		}
		fmt.Fprintf(stdout, "purged %d settled record(s) that expired before %s\n", total, t.UTC().Format(time.RFC3339))
		return nil
	}
}

// parseBefore reads an RFC 3339 time, or a duration meaning that long ago.
func parseBefore(s string, now time.Time) (time.Time, error) {
	if s == "" {
		return time.Time{}, errors.New("--before is required")
	}
	if t, err := time.Parse(time.RFC3339, s); err == nil {
		return t, nil
	}
	if d, err := time.ParseDuration(s); err == nil && d >= 0 {
		return now.Add(-d), nil
	}
	return time.Time{}, fmt.Errorf("--before %q: want an RFC 3339 time or a duration such as 72h", s)
}

func short(scope string) string {
	if scope == "" {
		return "-"
	}
	if len(scope) > 16 {
		return scope[:12] + "…"
	}
	return scope
}

type responseView struct {
	Status      int         `json:"status"`
	Header      http.Header `json:"header,omitempty"`
	Body        string      `json:"body,omitempty"`
	BodyOmitted bool        `json:"body_omitted,omitempty"`
}

type checkpointView struct {
	Name string    `json:"name"`
	Data string    `json:"data,omitempty"`
	At   time.Time `json:"at"`
}

func recordView(r idem.Record) any {
	v := map[string]any{
		"scope": r.Scope, "key": r.Key, "state": r.State, "fingerprint": r.Fingerprint, "fence": r.Fence,
		"lease_expires": r.LeaseExpires.UTC(), "takeover_safe": r.TakeoverSafe,
		"created": r.Created.UTC(), "updated": r.Updated.UTC(),
	}
	if !r.Expires.IsZero() {
		v["expires"] = r.Expires.UTC()
	}
	if r.Response != nil {
		v["response"] = responseView{Status: r.Response.Status, Header: r.Response.Header, Body: string(r.Response.Body), BodyOmitted: r.Response.BodyOmitted}
	}
	var cps []checkpointView
	for _, c := range r.Checkpoints {
		cps = append(cps, checkpointView{Name: c.Name, Data: string(c.Data), At: c.At.UTC()})
	}
	if cps != nil {
		v["checkpoints"] = cps
	}
	return v
}

func printJSON(w io.Writer, v any) int {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return 1
	}
	return 0
}

// runReconcile runs the reconciler against a store, asking a web service
// (reconcile.HTTPResolver) what happened to each stale record.
func runReconcile(ctx context.Context, args []string, env Env, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("idem reconcile", flag.ContinueOnError)
	fs.SetOutput(stderr)
	store := fs.String("store", cmp.Or(env("IDEM_STORE"), storeopen.Default), "store DSN")
	url := fs.String("resolver-url", env("IDEM_RESOLVER_URL"), "URL that answers for stale records (see the reconcile package's HTTPResolver) [$IDEM_RESOLVER_URL]")
	once := fs.Bool("once", false, "make one pass, print what it did, and exit")
	grace := fs.Duration("grace", reconcile.DefaultGrace, "how long past its lease a record is left to its owner")
	every := fs.Duration("interval", reconcile.DefaultInterval, "time between passes")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if *url == "" {
		fmt.Fprintln(stderr, "idem reconcile: --resolver-url is required")
		return 2
	}
	open := storeopen.OpenEventually // a long-running reconciler rides out a store that is down
	if *once {
		open = storeopen.Open
	}
	opened, err := open(ctx, *store)
	if err != nil {
		fmt.Fprintln(stderr, "idem reconcile:", err)
		return 1
	}
	defer opened.Close()
	eng, err := idem.New(idem.Config{Store: opened.Store})
	if err != nil {
		fmt.Fprintln(stderr, "idem reconcile:", err)
		return 1
	}
	r, err := reconcile.New(reconcile.Config{Engine: eng, Resolver: reconcile.HTTPResolver{URL: *url}, Grace: graceOf(*grace), Interval: *every,
		Logger: slog.New(slog.NewTextHandler(stderr, nil))})
	if err != nil {
		fmt.Fprintln(stderr, "idem reconcile:", err)
		return 2
	}
	if *once {
		rep, err := r.RunOnce(ctx)
		if err != nil {
			fmt.Fprintln(stderr, "idem reconcile:", err)
			return 1
		}
		fmt.Fprintf(stdout, "stale %d: completed %d, failed %d, still unknown %d, waiting %d, settled elsewhere %d, errors %d\n",
			rep.Stale, rep.Completed, rep.Failed, rep.Unknown, rep.Waiting, rep.Lost, rep.Errors)
		if rep.Errors > 0 {
			return 1
		}
		return 0
	}
	r.Start(ctx)
	<-ctx.Done()
	r.Stop()
	return 0
}

// progress shows a running count on a terminal, and nothing elsewhere.
type progress struct {
	w     io.Writer
	label string
	tty   bool
	last  time.Time
}

func newProgress(w io.Writer, label string) *progress {
	f, ok := w.(*os.File)
	tty := false
	if ok {
		if st, err := f.Stat(); err == nil && st.Mode()&os.ModeCharDevice != 0 {
			tty = true
		}
	}
	return &progress{w: w, label: label, tty: tty}
}

func (p *progress) update(n int) {
	if p.tty && time.Since(p.last) > 100*time.Millisecond {
		p.last = time.Now()
		fmt.Fprintf(p.w, "\r%s: %s", p.label, strconv.Itoa(n))
	}
}

func (p *progress) done() {
	if p.tty && !p.last.IsZero() {
		fmt.Fprint(p.w, "\r\033[K")
	}
}

// graceOf is a --grace flag as reconcile.Config takes it: 0 means none
// (reconcile's zero means its default).
func graceOf(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}
