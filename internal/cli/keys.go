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
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/console"
	"github.com/idemhq/idem/internal/redact"
	"github.com/idemhq/idem/internal/storeopen"
	"github.com/idemhq/idem/reconcile"
)

// printKeysUsage lists the subcommands of idem keys.
func printKeysUsage(w io.Writer) {
	fmt.Fprint(w, "idem keys: list, inspect, resolve and purge records in any store.\n\nCommands:\n")
	for _, c := range commands {
		if name, ok := strings.CutPrefix(c.name, "keys "); ok {
			fmt.Fprintf(w, "  %-8s %s\n", name, c.summary)
		}
	}
	fmt.Fprint(w, "\nThe store is --store, then $IDEM_STORE, then the store of the proxy's configuration file\n(--config or $IDEM_CONFIG), then sqlite:idem.db. A scope is the SHA-256 of the\ncaller's scope headers (Authorization by default), in hex; --scope takes it or its start.\nRun 'idem keys COMMAND --help' for a command's flags and examples.\n")
}

// headerFlags collects repeated --header values.
type headerFlags http.Header

func (h headerFlags) String() string { return "" }

// secret says that a header's value is not repeated in an error: it is
// often a credential.
func (h headerFlags) secret() {}
func (h headerFlags) Set(v string) error {
	name, value, ok := strings.Cut(v, ":")
	if !ok || strings.TrimSpace(name) == "" {
		return errors.New("want Name: value (a name, a colon, then the value)")
	}
	http.Header(h).Add(strings.TrimSpace(name), strings.TrimSpace(value))
	return nil
}

// keysCommand is one subcommand of idem keys: its own flags, how many
// positional arguments (a key) it takes, and what it does with the engine.
type keysCommand struct {
	flags   func(fs *flag.FlagSet) func(ctx context.Context, eng *idem.Engine, pos []string, stdout io.Writer) error
	keys    int
	settles bool // it settles records: it takes --retention
}

var keysCommands = map[string]keysCommand{"ls": {flags: keysLs}, "show": {flags: keysShow, keys: 1},
	"resolve": {flags: keysResolve, keys: 1, settles: true}, "purge": {flags: keysPurge}}

// errUsage: the command line is wrong; the usage is shown.
var errUsage = errors.New("usage")

func runKeys(ctx context.Context, args []string, env Env, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		printKeysUsage(stderr)
		return 2
	}
	if args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		printKeysUsage(stdout)
		return 0
	}
	sub := args[0]
	cmd, ok := keysCommands[sub]
	if !ok {
		fmt.Fprintf(stderr, "idem keys: unknown command %q\n\n", sub)
		printKeysUsage(stderr)
		return 2
	}
	fs := newFlags("keys " + sub)
	dep := deploymentFlags(fs, cmd.settles)
	run := cmd.flags(fs)
	pos, err := parseFlags(fs, args[1:], stdout, stderr)
	switch {
	case err != nil:
		return exitStatus(err)
	case len(pos) != cmd.keys:
		usageError(stderr, fs.Name(), fmt.Sprintf("takes %d key, not %d", cmd.keys, len(pos)))
		return 2
	}
	dsn, keep, err := dep.resolve(fs, env)
	if err != nil {
		usageError(stderr, fs.Name(), message(err))
		return 2
	}
	storeopen.SetLogger(slog.New(slog.DiscardHandler)) // a failure ends the command with its error
	opened, err := storeopen.OpenExisting(ctx, dsn)    // a mistyped SQLite path is an error, not a new empty database
	if err != nil {
		return fail(stderr, fs.Name(), err)
	}
	defer opened.Close()
	eng, err := idem.New(idem.Config{Store: opened.Store, Retention: keep})
	if err != nil {
		return fail(stderr, fs.Name(), err)
	}
	switch err := run(ctx, eng, pos, stdout); {
	case errors.Is(err, errUsage):
		usageError(stderr, fs.Name(), strings.TrimPrefix(err.Error(), "usage: "))
		return 2
	case err != nil:
		return fail(stderr, fs.Name(), err)
	}
	return 0
}

func keysLs(fs *flag.FlagSet) func(context.Context, *idem.Engine, []string, io.Writer) error {
	states := fs.String("state", "", "only records in these `states`, comma-separated: in_progress, completed, failed, unknown; or stale (unknown, or in progress past its lease)")
	scope := fs.String("scope", "", "only records whose scope begins with this `prefix`")
	key := fs.String("key", "", "only records whose key begins with this `prefix`")
	since := fs.String("since", "", "only records created at or after this `time` (RFC 3339, or a duration ago such as 2h)")
	until := fs.String("until", "", "only records created before this `time` (RFC 3339, or a duration ago)")
	limit := fs.Int("limit", 100, "at most this many records")
	asJSON := fs.Bool("json", false, "print each record as a line of JSON, response included")
	return func(ctx context.Context, eng *idem.Engine, _ []string, stdout io.Writer) error {
		p := idem.ListParams{ScopePrefix: *scope, KeyPrefix: *key}
		stale := false
		for _, st := range strings.Split(*states, ",") {
			switch st := idem.State(strings.TrimSpace(st)); {
			case st == "":
			case st == "stale":
				stale = true
			case st.Valid():
				p.States = append(p.States, st)
			default:
				return fmt.Errorf("%w: --state %q: want in_progress, completed, failed, unknown or stale", errUsage, st)
			}
		}
		if stale && (len(p.States) > 0 || *scope != "" || *key != "" || *since != "" || *until != "") {
			return fmt.Errorf("%w: --state stale lists what the reconciler sees, and takes no other filter", errUsage)
		}
		var err error
		now := time.Now()
		if p.CreatedFrom, err = parseTime("--since", *since, now); err != nil {
			return fmt.Errorf("%w: %v", errUsage, err)
		}
		if p.CreatedBefore, err = parseTime("--until", *until, now); err != nil {
			return fmt.Errorf("%w: %v", errUsage, err)
		}
		if *limit <= 0 {
			return fmt.Errorf("%w: --limit %d: want at least 1", errUsage, *limit)
		}
		page := func(cursor string) (idem.ScanResult, error) {
			if stale {
				return eng.Scan(ctx, min(*limit, 1000), cursor)
			}
			p.Cursor, p.Limit = cursor, min(*limit, 1000)
			return eng.List(ctx, p)
		}
		var found []idem.Record
		seen := map[[2]string]bool{}
		more := false
		for cursor := ""; ; {
			res, err := page(cursor)
			if err != nil {
				return err
			}
			for _, r := range res.Records {
				id := [2]string{r.Scope, r.Key}
				if seen[id] {
					continue // a store may return a record twice over a listing
				}
				if len(found) == *limit {
					more = true
					break
				}
				seen[id] = true
				found = append(found, r)
			}
			if cursor = res.Cursor; cursor == "" || more {
				break
			}
		}
		slices.SortFunc(found, func(a, b idem.Record) int { return a.Created.Compare(b.Created) })
		if *asJSON {
			enc := json.NewEncoder(stdout)
			for _, r := range found {
				if err := enc.Encode(recordView(r)); err != nil {
					return err
				}
			}
			return nil
		}
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "CREATED\tSCOPE\tKEY\tSTATE\tSTATUS\tFENCE\tLEASE ENDS\tEXPIRES\tCHECKPOINTS")
		for _, r := range found {
			status, expires := "-", "-"
			if r.Response != nil {
				status = strconv.Itoa(r.Response.Status)
			}
			if !r.Expires.IsZero() {
				expires = r.Expires.UTC().Format(time.RFC3339)
			}
			var cps []string
			for _, c := range r.Checkpoints {
				cps = append(cps, c.Name)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\n", r.Created.UTC().Format(time.RFC3339), cmp.Or(r.Scope, "-"), r.Key, r.State,
				status, r.Fence, r.LeaseExpires.UTC().Format(time.RFC3339), expires, cmp.Or(strings.Join(cps, ","), "-"))
		}
		tw.Flush()
		switch {
		case more:
			fmt.Fprintf(stdout, "%d record(s) shown; there are more: raise --limit or narrow the listing\n", len(found))
		default:
			fmt.Fprintf(stdout, "%d record(s)\n", len(found))
		}
		return nil
	}
}

// findRecord returns the record of key under scope, which may be given by a
// prefix (a scope named whole is that scope, though others begin with it),
// or left out when only one scope holds the key: the empty scope, that of
// requests without scope headers, is one of the scopes then, not a default.
func findRecord(ctx context.Context, eng *idem.Engine, scope, key string) (idem.Record, error) {
	if scope != "" {
		r, err := eng.Get(ctx, scope, key)
		if !errors.Is(err, idem.ErrNotFound) {
			return r, err
		}
	}
	var matches []idem.Record
	p := idem.ListParams{ScopePrefix: scope, KeyPrefix: key, Limit: 1000}
	for {
		res, err := eng.List(ctx, p)
		if err != nil {
			return idem.Record{}, err
		}
		for _, r := range res.Records {
			if r.Key == key && !slices.ContainsFunc(matches, func(m idem.Record) bool { return m.Scope == r.Scope }) {
				matches = append(matches, r)
			}
		}
		if p.Cursor = res.Cursor; p.Cursor == "" {
			break
		}
	}
	switch len(matches) {
	case 0:
		where := "in any scope"
		if scope != "" {
			where = fmt.Sprintf("in a scope that begins with %q", scope)
		}
		return idem.Record{}, fmt.Errorf("no record of key %q %s (it may have expired; idem keys ls --key lists keys by prefix)", key, where)
	case 1:
		return matches[0], nil
	}
	scopes := make([]string, len(matches))
	for i, m := range matches {
		scopes[i] = m.Scope
	}
	return idem.Record{}, fmt.Errorf("%w: key %q is in %d scopes (%s): say which with --scope", errUsage, key, len(matches), strings.Join(scopes, ", "))
}

// scopeUsage is the help of the --scope flag of show and resolve.
const scopeUsage = "the record's `scope` as idem keys ls shows it, or the start of it; none when only one scope holds the key"

func keysShow(fs *flag.FlagSet) func(context.Context, *idem.Engine, []string, io.Writer) error {
	scope := fs.String("scope", "", scopeUsage)
	return func(ctx context.Context, eng *idem.Engine, pos []string, stdout io.Writer) error {
		r, err := findRecord(ctx, eng, *scope, pos[0])
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
	scope := fs.String("scope", "", scopeUsage)
	failed := fs.Bool("failed", false, "nothing happened; release the key")
	completed := fs.Bool("completed", false, "it happened; store this outcome for replay")
	status := fs.Int("status", 0, "with --completed: the HTTP `status` to replay, a final one (200 to 999)")
	body := fs.String("body", "", "with --completed: the `body` to replay")
	bodyFile := fs.String("body-file", "", "with --completed: a `file` holding the body to replay")
	force := fs.Bool("force", false, "even a record whose owner may still store its outcome (its lease running, or quiet for less than a minute)")
	header := headerFlags{}
	fs.Var(header, "header", "with --completed: a `header` to replay, 'Name: value' (repeatable)")
	return func(ctx context.Context, eng *idem.Engine, pos []string, stdout io.Writer) error {
		if *failed == *completed {
			return fmt.Errorf("%w: say --failed or --completed", errUsage)
		}
		r, err := findRecord(ctx, eng, *scope, pos[0])
		if err != nil {
			return err
		}
		res := reconcile.Resolution{Outcome: reconcile.Failed}
		if *completed {
			// The store judges the status (a final one, 200 to 999): its
			// refusal, an invalid input, ends the command with exit 2.
			if !flagSet(fs, "status") {
				return fmt.Errorf("%w: --completed needs --status, the HTTP status to replay (200 to 999)", errUsage)
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
	before := fs.String("before", "", "delete settled records that expired before this `time` (RFC 3339, or a duration ago such as 72h); never one still replayed")
	return func(ctx context.Context, eng *idem.Engine, _ []string, stdout io.Writer) error {
		t, err := parseTime("--before", *before, time.Now())
		if err != nil || t.IsZero() {
			return fmt.Errorf("%w: %v", errUsage, cmp.Or(err, errors.New("--before is required")))
		}
		if now := time.Now(); t.After(now) {
			return fmt.Errorf("%w: --before %s is in the future: records that expire after now (%s) are still replayed, and are never purged",
				errUsage, t.UTC().Format(time.RFC3339), now.UTC().Format(time.RFC3339))
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

// parseTime reads flag's value: an RFC 3339 time, or a duration meaning
// that long ago; "" is the zero time.
func parseTime(flag, s string, now time.Time) (time.Time, error) {
	t, err := console.ParseTime(s, now)
	if err != nil {
		return t, fmt.Errorf("%s %w", flag, err)
	}
	return t, nil
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
	fs := newFlags("reconcile")
	dep := deploymentFlags(fs, true)
	url := fs.String("resolver-url", "", "`URL` that answers for stale records (see the reconcile package's HTTPResolver) [$IDEM_RESOLVER_URL]")
	newLog := logFlag(fs, stderr)
	once := fs.Bool("once", false, "make one pass, print what it did, and exit")
	grace := fs.Duration("grace", reconcile.DefaultGrace, "how long past its lease a record is left to its owner; 0s for none")
	every := fs.Duration("interval", reconcile.DefaultInterval, "time between passes")
	if err := parseFlagsOnly(fs, args, stdout, stderr); err != nil {
		return exitStatus(err)
	}
	if err := applyEnv(fs, env, deploymentNames...); err != nil {
		usageError(stderr, fs.Name(), err.Error())
		return 2
	}
	if *url == "" {
		usageError(stderr, fs.Name(), "--resolver-url is required")
		return 2
	}
	if *every <= 0 {
		usageError(stderr, fs.Name(), fmt.Sprintf("--interval %s: want a positive duration, such as 30s", *every))
		return 2
	}
	if err := checkGrace(*grace); err != nil {
		usageError(stderr, fs.Name(), err.Error())
		return 2
	}
	log, err := newLog()
	if err != nil {
		usageError(stderr, fs.Name(), err.Error())
		return 2
	}
	// A long-running reconciler rides out a store that is down (and, beside a
	// proxy that has yet to start, may create the embedded store first). One
	// pass reads a store that must be there: over a mistyped SQLite path it
	// would find nothing to settle in a new, empty database and say so.
	open := storeopen.OpenEventually
	if *once {
		open = storeopen.OpenExisting
	}
	store, keep, err := dep.resolve(fs, env)
	if err != nil {
		usageError(stderr, fs.Name(), message(err))
		return 2
	}
	if path, missing := storeopen.Missing(store); missing && !*once {
		// It is created, for a proxy yet to start beside it; but a
		// reconciler started from the wrong directory would settle
		// nothing, for good, without a word.
		log.Warn("reconcile: there is no database at the store's path yet: a new, empty one is created, and this reconciler settles only what is stored there (is the store right?)",
			"store", storeopen.Redact(store), "path", path)
	}
	opened, err := open(ctx, store)
	if err != nil {
		return fail(stderr, fs.Name(), err)
	}
	defer opened.Close()
	eng, err := idem.New(idem.Config{Store: opened.Store, Retention: keep})
	if err != nil {
		return fail(stderr, fs.Name(), err)
	}
	r, err := reconcile.New(reconcile.Config{Engine: eng, Resolver: reconcile.HTTPResolver{URL: *url}, Grace: graceOf(*grace), Interval: *every,
		Logger: log})
	if err != nil {
		return fail(stderr, fs.Name(), err)
	}
	if *once {
		rep, err := r.RunOnce(ctx)
		if err != nil {
			return fail(stderr, fs.Name(), err)
		}
		fmt.Fprintf(stdout, "stale %d: completed %d, failed %d, still unknown %d, waiting %d, settled elsewhere %d, errors %d\n",
			rep.Stale, rep.Completed, rep.Failed, rep.Unknown, rep.Waiting, rep.Lost, rep.Errors)
		if rep.Errors > 0 {
			return 1
		}
		return 0
	}
	log.Info("reconcile: started", "store", storeopen.Redact(store), "resolver", redact.URL(*url), "interval", *every)
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

// checkGrace refuses a negative --grace: reconcile.Config would take it as
// none at all, and settle a record whose owner may still store its true
// outcome (the retry that follows would run again).
func checkGrace(d time.Duration) error {
	if d < 0 {
		return fmt.Errorf("--grace %s: want 0s (no grace) or a positive duration, such as 1m", d)
	}
	return nil
}

// flagSet reports whether name was given on the command line.
func flagSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

// graceOf is a --grace flag as reconcile.Config takes it: 0 means none
// (reconcile's zero means its default). checkGrace has refused a negative
// one.
func graceOf(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}
