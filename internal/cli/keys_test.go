package cli_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/cli"
	"github.com/idemhq/idem/store/sqlitestore"
	"github.com/idemhq/idem/store/storetest"
)

func noEnv(string) string { return "" }

func run(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut strings.Builder
	code = cli.Main(context.Background(), args, noEnv, &out, &errOut)
	return code, out.String(), errOut.String()
}

var fp = idem.NewFingerprint(idem.Payload{Method: "POST", Path: "/v1/charges"})

// seed writes records 26 hours in the past: one completed (so its 24 h
// retention ran out 2 hours ago), one whose owner died after a checkpoint and
// one unknown; and now, one completed and one still running.
func seed(t *testing.T) (dsn string, eng func() *idem.Engine) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "idem.db")
	s, err := sqlitestore.Open(context.Background(), sqlitestore.Config{Path: path})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	past, _ := idem.New(idem.Config{Store: s, Clock: storetest.NewClock(time.Now().Add(-26 * time.Hour))})
	now, _ := idem.New(idem.Config{Store: s})
	begin := func(e *idem.Engine, key string) idem.Lease {
		out, err := e.Begin(context.Background(), idem.BeginParams{Scope: "tenant", Key: key, Fingerprint: fp})
		if err != nil || out.Decision != idem.Execute {
			t.Fatal(out.Decision, err)
		}
		return out.Lease
	}
	ctx := context.Background()
	if err := past.Complete(ctx, begin(past, "expired"), &idem.Response{Status: 201, Body: []byte(`{"id":"ch_0"}`)}); err != nil {
		t.Fatal(err)
	}
	if err := now.Complete(ctx, begin(now, "done"), &idem.Response{Status: 201, Body: []byte(`{"id":"ch_1"}`)}); err != nil {
		t.Fatal(err)
	}
	if err := past.Checkpoint(ctx, begin(past, "stuck"), "authorize", []byte("idem_k1")); err != nil {
		t.Fatal(err)
	}
	if err := past.MarkUnknown(ctx, begin(past, "unknown")); err != nil {
		t.Fatal(err)
	}
	begin(now, "running")
	return "sqlite:" + path, func() *idem.Engine {
		s, err := sqlitestore.Open(context.Background(), sqlitestore.Config{Path: path})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		e, _ := idem.New(idem.Config{Store: s})
		return e
	}
}

func TestKeysCommands(t *testing.T) {
	dsn, engine := seed(t)

	// keys ls lists every live record, whatever its state; the filters
	// narrow it down.
	for _, c := range []struct {
		args []string
		want []string
	}{
		{nil, []string{"done", "running", "stuck", "unknown"}},
		{[]string{"--state", "stale"}, []string{"stuck", "unknown"}},
		{[]string{"--state", "completed"}, []string{"done"}},
		{[]string{"--state", "unknown,in_progress"}, []string{"running", "stuck", "unknown"}},
		{[]string{"--key", "st"}, []string{"stuck"}},
		{[]string{"--since", "1h"}, []string{"done", "running"}},
		{[]string{"--until", "1h"}, []string{"stuck", "unknown"}},
		{[]string{"--scope", "ten", "--state", "failed"}, nil},
		{[]string{"--scope", "other"}, nil},
	} {
		code, out, errOut := run(t, append([]string{"keys", "ls", "--store", dsn, "--json"}, c.args...)...)
		var got []string
		for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
			var r struct{ Scope, Key string }
			if line != "" && json.Unmarshal([]byte(line), &r) == nil && r.Scope == "tenant" {
				got = append(got, r.Key)
			}
		}
		slices.Sort(got)
		if code != 0 || !slices.Equal(got, c.want) {
			t.Errorf("keys ls %v: %d %v (%s); want %v", c.args, code, got, errOut, c.want)
		}
	}
	code, out, _ := run(t, "keys", "ls", "--store", dsn, "--state", "stale")
	if code != 0 || !strings.Contains(out, "stuck") || !strings.Contains(out, "authorize") || !strings.Contains(out, "2 record(s)") {
		t.Fatalf("keys ls --state stale: %d\n%s", code, out)
	}
	if code, out, _ := run(t, "keys", "ls", "--store", dsn, "--limit", "1"); code != 0 || !strings.Contains(out, "1 record(s) shown; there are more") {
		t.Fatalf("keys ls --limit 1: %d\n%s", code, out)
	}
	for _, args := range [][]string{{"--state", "done"}, {"--state", "stale", "--key", "a"}, {"--since", "yesterday"}, {"--limit", "0"}} {
		if code, _, errOut := run(t, append([]string{"keys", "ls", "--store", dsn}, args...)...); code != 2 || !strings.Contains(errOut, "--help") {
			t.Errorf("keys ls %v: exit %d %q; want a usage error", args, code, errOut)
		}
	}

	// show finds a key by its scope, the start of it, or alone when only
	// one scope holds it.
	for _, scope := range []string{"tenant", "ten", ""} {
		code, out, errOut := run(t, "keys", "show", "done", "--scope", scope, "--store", dsn)
		var shown struct {
			State    string
			Response struct {
				Status int
				Body   string
			}
		}
		if err := json.Unmarshal([]byte(out), &shown); code != 0 || err != nil || shown.State != "completed" || shown.Response.Status != 201 || shown.Response.Body != `{"id":"ch_1"}` {
			t.Fatalf("keys show --scope %q: %d %v %s\n%s", scope, code, err, errOut, out)
		}
	}
	if code, _, errOut := run(t, "keys", "show", "absent", "--store", dsn); code != 1 || !strings.Contains(errOut, `no record of key "absent"`) {
		t.Fatalf("keys show of a missing key: %d %s", code, errOut)
	}
	if _, err := engine().Begin(context.Background(), idem.BeginParams{Scope: "other", Key: "done", Fingerprint: fp}); err != nil {
		t.Fatal(err)
	}
	if code, _, errOut := run(t, "keys", "show", "done", "--store", dsn); code != 2 || !strings.Contains(errOut, "in 2 scopes (other, tenant)") {
		t.Fatalf("keys show of a key two scopes hold: %d %s", code, errOut)
	}

	code, _, errOut := run(t, "keys", "resolve", "stuck", "--scope", "tenant", "--store", dsn, "--completed", "--status", "201",
		"--body", `{"id":"ch_2"}`, "--header", "Content-Type: application/json")
	if code != 0 {
		t.Fatalf("keys resolve --completed: %d %s", code, errOut)
	}
	if code, _, errOut := run(t, "keys", "resolve", "unknown", "--scope", "tenant", "--store", dsn, "--failed"); code != 0 {
		t.Fatalf("keys resolve --failed: %d %s", code, errOut)
	}
	for name, args := range map[string][]string{
		"a settled record":    {"done", "--failed"},
		"a running lease":     {"running", "--failed"},
		"neither outcome":     {"stuck"},
		"completed no status": {"running", "--completed", "--force"},
	} {
		if code, _, _ := run(t, append([]string{"keys", "resolve", "--scope", "tenant", "--store", dsn}, args...)...); code == 0 {
			t.Errorf("keys resolve %s: accepted", name)
		}
	}
	e := engine()
	out2, err := e.Begin(context.Background(), idem.BeginParams{Scope: "tenant", Key: "stuck", Fingerprint: fp})
	if err != nil || out2.Decision != idem.Replay || string(out2.Record.Response.Body) != `{"id":"ch_2"}` || out2.Record.Response.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("after resolve --completed: %v %+v %v", out2.Decision, out2.Record.Response, err)
	}
	if out, _ := e.Begin(context.Background(), idem.BeginParams{Scope: "tenant", Key: "unknown", Fingerprint: fp}); out.Decision != idem.Execute {
		t.Fatalf("after resolve --failed: %v", out.Decision)
	}

	if code, out, _ := run(t, "keys", "purge", "--before", "3h", "--store", dsn); code != 0 || !strings.Contains(out, "purged 0") {
		t.Fatalf("purge of nothing expired 3 hours ago: %d %s", code, out)
	}
	if code, out, _ := run(t, "keys", "purge", "--before", "1h", "--store", dsn); code != 0 || !strings.Contains(out, "purged 1") {
		t.Fatalf("purge of the record that expired 2 hours ago: %d %s", code, out)
	}
	later := time.Now().Add(25 * time.Hour).UTC().Format(time.RFC3339)
	if code, _, errOut := run(t, "keys", "purge", "--before", later, "--store", dsn); code == 0 || !strings.Contains(errOut, "still replayed") {
		t.Fatalf("purge before %s, which would delete outcomes still replayed: %d %s", later, code, errOut)
	}
	if out, err := engine().Begin(context.Background(), idem.BeginParams{Scope: "tenant", Key: "stuck", Fingerprint: fp}); err != nil || out.Decision != idem.Replay {
		t.Fatalf("an outcome inside its retention after the refused purge: %v %v", out.Decision, err)
	}
	if code, _, _ := run(t, "keys", "purge", "--store", dsn); code == 0 {
		t.Fatal("purge without --before accepted")
	}
	// It said "after 0: idem: invalid input: cannot prune records expiring after now".
	if code, _, errOut := run(t, "keys", "purge", "--store", dsn, "--before", "2999-01-01T00:00:00Z"); code != 2 || !strings.Contains(errOut, "--before 2999-01-01T00:00:00Z is in the future") {
		t.Fatalf("purge --before in the future: %d %q; want exit 2 naming --before", code, errOut)
	}
}

func TestReconcileCommand(t *testing.T) {
	dsn, engine := seed(t)
	resolver := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var rec struct {
			Key         string
			Checkpoints []idem.Checkpoint
		}
		json.NewDecoder(r.Body).Decode(&rec)
		if rec.Key == "stuck" && len(rec.Checkpoints) == 1 && string(rec.Checkpoints[0].Data) == "idem_k1" {
			fmt.Fprint(w, `{"outcome":"completed","status":201,"body":"{\"id\":\"ch_9\"}"}`)
			return
		}
		fmt.Fprint(w, `{"outcome":"failed"}`)
	}))
	defer resolver.Close()
	code, out, errOut := run(t, "reconcile", "--once", "--store", dsn, "--resolver-url", resolver.URL)
	if code != 0 || !strings.Contains(out, "completed 1, failed 1") {
		t.Fatalf("reconcile --once: %d %q %s", code, out, errOut)
	}
	if out, _ := engine().Begin(context.Background(), idem.BeginParams{Scope: "tenant", Key: "stuck", Fingerprint: fp}); out.Decision != idem.Replay {
		t.Fatalf("after reconcile: %v", out.Decision)
	}
	if code, _, _ := run(t, "reconcile", "--once", "--store", dsn); code != 2 {
		t.Fatal("reconcile without a resolver URL accepted")
	}

	// One pass over a mistyped SQLite path is an error: it found nothing
	// because there is nothing there, not because every record is settled
	// (it reported "stale 0" on a new, empty database of its own making).
	missing := filepath.Join(t.TempDir(), "idme.db")
	code, out, errOut = run(t, "reconcile", "--once", "--store", "sqlite:"+missing, "--resolver-url", resolver.URL)
	if code != 2 || !strings.Contains(errOut, "no database at") {
		t.Fatalf("reconcile --once on a missing SQLite file: %d %q %q; want exit 2 (as idem keys) and the path named", code, out, errOut)
	}
	if _, err := os.Stat(missing); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("reconcile --once created %s: %v", missing, err)
	}

	// A long-running reconciler creates the database (a proxy beside it may
	// have yet to start), but says so, with the path made absolute: one
	// started from the wrong directory settled nothing, for good, and
	// printed nothing at all.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w := &untilWriter{want: "reconcile: started", seen: cancel}
	missing = filepath.Join(t.TempDir(), "idme.db")
	withKey := strings.Replace(resolver.URL, "http://", "http://sk_live_hunter2@", 1) // the start line names the resolver, not its key
	if code := cli.Main(ctx, []string{"reconcile", "--store", "sqlite:" + missing, "--resolver-url", withKey}, noEnv, io.Discard, w); code != 0 ||
		!strings.Contains(w.String(), "there is no database at the store's path yet") || !strings.Contains(w.String(), missing) || strings.Contains(w.String(), "hunter2") {
		t.Fatalf("a long-running reconcile on a missing SQLite file: %d %q; want a warning naming %s, and a start line without the resolver's key", code, w.String(), missing)
	}

	// A lease that ran out a second ago: inside the default grace, not
	// inside --grace 0s, which means none.
	s, err := sqlitestore.Open(context.Background(), sqlitestore.Config{Path: strings.TrimPrefix(dsn, "sqlite:")})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	recent, _ := idem.New(idem.Config{Store: s, Clock: storetest.NewClock(time.Now().Add(-31 * time.Second))})
	if _, err := recent.Begin(context.Background(), idem.BeginParams{Scope: "tenant", Key: "just-expired", Fingerprint: fp}); err != nil {
		t.Fatal(err)
	}
	if code, out, _ := run(t, "reconcile", "--once", "--store", dsn, "--resolver-url", resolver.URL); code != 0 || !strings.Contains(out, "completed 0, failed 0") {
		t.Fatalf("reconcile --once inside the default grace: %d %q", code, out)
	}
	if code, out, _ := run(t, "reconcile", "--once", "--grace", "0s", "--store", dsn, "--resolver-url", resolver.URL); code != 0 || !strings.Contains(out, "failed 1") {
		t.Fatalf("reconcile --once --grace 0s: %d %q; want the record settled at once", code, out)
	}
}

// TestKeysResolveNamesItsRecordAndKeepsItsOutcome: a key held in the
// empty scope (requests without scope headers) and in another is
// ambiguous without --scope, as any key two scopes hold is (the empty
// scope's record was taken at once, without a word); and an outcome
// resolved by hand is replayed for the deployment's retention, --retention
// (it was kept 24 h whatever the deployment promised, so a retry within
// the promise ran again).
func TestKeysResolveNamesItsRecordAndKeepsItsOutcome(t *testing.T) {
	path := filepath.Join(t.TempDir(), "idem.db")
	s, err := sqlitestore.Open(context.Background(), sqlitestore.Config{Path: path})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	eng, _ := idem.New(idem.Config{Store: s})
	for _, scope := range []string{"", "tenant"} {
		out, err := eng.Begin(context.Background(), idem.BeginParams{Scope: scope, Key: "order-1", Fingerprint: fp})
		if err != nil || out.Decision != idem.Execute {
			t.Fatal(out.Decision, err)
		}
		if err := eng.MarkUnknown(context.Background(), out.Lease); err != nil {
			t.Fatal(err)
		}
	}
	dsn := "sqlite:" + path
	if code, _, errOut := run(t, "keys", "show", "order-1", "--store", dsn); code != 2 || !strings.Contains(errOut, "in 2 scopes") {
		t.Fatalf("keys show of a key the empty scope and another hold: %d %s; want it ambiguous", code, errOut)
	}
	if code, _, errOut := run(t, "keys", "resolve", "order-1", "--failed", "--store", dsn); code != 2 || !strings.Contains(errOut, "in 2 scopes") {
		t.Fatalf("keys resolve of that key: %d %s; want it ambiguous", code, errOut)
	}
	code, _, errOut := run(t, "keys", "resolve", "order-1", "--scope", "tenant", "--completed", "--status", "201", "--retention", "72h", "--force", "--store", dsn) // unknown just now: within the grace
	if code != 0 {
		t.Fatalf("keys resolve --retention 72h: %d %s", code, errOut)
	}
	rec, err := eng.Get(context.Background(), "tenant", "order-1")
	if err != nil || rec.State != idem.StateCompleted || rec.Expires.Before(time.Now().Add(71*time.Hour)) {
		t.Fatalf("the resolved record: %v expiring %v, %v; want completed, replayed for 72 h", rec.State, rec.Expires, err)
	}
	if rec, err := eng.Get(context.Background(), "", "order-1"); err != nil || rec.State != idem.StateUnknown {
		t.Fatalf("the empty scope's record: %v, %v; want it left unknown", rec.State, err)
	}
	if code, _, errOut := run(t, "keys", "resolve", "order-1", "--scope", "tenant", "--failed", "--retention", "forever", "--store", dsn); code != 2 || !strings.Contains(errOut, "--retention") {
		t.Fatalf("keys resolve --retention forever: %d %s; want a usage error", code, errOut)
	}
}

// TestHeaderFlagErrorShowsNoValue: a --header written without its colon is
// refused without quoting it: it is often a credential.
func TestHeaderFlagErrorShowsNoValue(t *testing.T) {
	code, _, errOut := run(t, "verify", "--url", "http://127.0.0.1:1/x", "--header", "Authorization Bearer sk_live_SECRET")
	if code != 2 || strings.Contains(errOut, "sk_live_SECRET") || !strings.Contains(errOut, "--header: want Name: value") {
		t.Fatalf("%d %s; want a usage error that does not quote the header", code, errOut)
	}
}

// TestVerifyURLWithoutSchemeIsAUsageError: "localhost:8080/v1/charges"
// (the scheme left out, a common slip) is a wrong command line, exit 2,
// as "127.0.0.1:8080/v1/charges" already is, and the message says what was
// likely meant. It was sent, retried five times, and reported as "the
// endpoint cannot be reached ... Is the API running?", exit 1.
func TestVerifyURLWithoutSchemeIsAUsageError(t *testing.T) {
	for url, want := range map[string]string{
		"localhost:8080/v1/charges":       "the URL has no scheme: did you mean http://localhost:8080/v1/charges?",
		"127.0.0.1:8080/v1/charges":       "the URL has no scheme: did you mean http://127.0.0.1:8080/v1/charges?",
		"ftp://127.0.0.1:8080/v1/charges": "the URL's scheme is ftp",
	} {
		code, out, errOut := run(t, "verify", "--url", url)
		if code != 2 || !strings.Contains(errOut, want) || strings.Contains(errOut, "cannot be reached") {
			t.Errorf("verify --url %s: exit %d, want 2 (a wrong command line) saying %q\n%s%s", url, code, want, out, errOut)
		}
	}
	code, out, errOut := run(t, "verify", "--url", "http://127.0.0.1:1/v1/charges", "--effects-url", "localhost:8080/effects")
	if want := "the effects URL has no scheme: did you mean http://localhost:8080/effects?"; code != 2 || !strings.Contains(errOut, want) {
		t.Errorf("verify --effects-url localhost:8080/effects: exit %d, want 2 saying %q\n%s%s", code, want, out, errOut)
	}
}

// TestReconcileRefusesANonPositiveInterval: --interval 0s used to run a
// pass every 30 s (the reconciler's default) without a word.
func TestReconcileRefusesANonPositiveInterval(t *testing.T) {
	for _, every := range []string{"0s", "-5s"} {
		// Bounded: a reconciler that took the flag would run until ctx ends.
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		var out, errOut strings.Builder
		code := cli.Main(ctx, []string{"reconcile", "--store", "sqlite:" + filepath.Join(t.TempDir(), "idem.db"),
			"--resolver-url", "http://127.0.0.1:1/resolve", "--interval", every}, noEnv, &out, &errOut)
		cancel()
		if want := "--interval " + every + ": want a positive duration"; code != 2 || out.Len() > 0 || !strings.Contains(errOut.String(), want) {
			t.Errorf("reconcile --interval %s: exit %d, stdout %q, stderr %q; want exit 2 and %q", every, code, out.String(), errOut.String(), want)
		}
	}
}

// TestNegativeDurationsAreRefusedByTheTools: a negative duration is a
// wrong command line (idem proxy refuses one), not a silent default:
// reconcile --grace -1m settled at once a record whose lease ended a
// second ago (no grace at all); verify --timeout -1s waited 30 s a request,
// and --concurrency -1 sent 10 duplicates. So are a zero verify timeout
// or concurrency, and a zero demo reconcile interval, which also became
// defaults without a word.
func TestNegativeDurationsAreRefusedByTheTools(t *testing.T) {
	path := filepath.Join(t.TempDir(), "idem.db")
	s, err := sqlitestore.Open(context.Background(), sqlitestore.Config{Path: path})
	if err != nil {
		t.Fatal(err)
	}
	recent, _ := idem.New(idem.Config{Store: s, Clock: storetest.NewClock(time.Now().Add(-31 * time.Second))})
	if _, err := recent.Begin(context.Background(), idem.BeginParams{Scope: "tenant", Key: "just-expired", Fingerprint: fp}); err != nil {
		t.Fatal(err)
	}
	s.Close()
	resolver := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(`{"outcome":"failed"}`))
	}))
	defer resolver.Close()
	code, out, errOut := run(t, "reconcile", "--once", "--grace", "-1m", "--store", "sqlite:"+path, "--resolver-url", resolver.URL)
	if code != 2 {
		t.Errorf("reconcile --grace -1m: exit %d, want 2\n%s%s", code, out, errOut)
	}
	if strings.Contains(out, "failed 1") {
		t.Errorf("reconcile --grace -1m settled a record whose lease ended a second ago: %s", out)
	}
	if want := "--grace -1m0s: want 0s (no grace) or a positive duration"; !strings.Contains(errOut, want) {
		t.Errorf("reconcile --grace -1m: stderr %q; want it to say %q", errOut, want)
	}
	for _, tc := range []struct{ flag, value, want string }{
		{"--timeout", "-1s", "--timeout -1s: want a positive duration"},
		{"--timeout", "0s", "--timeout 0s: want a positive duration"},
		{"--concurrency", "-1", "--concurrency -1: want a positive number"},
		{"--concurrency", "0", "--concurrency 0: want a positive number"},
	} {
		code, out, errOut = run(t, "verify", "--url", "http://127.0.0.1:1/v1/charges", tc.flag, tc.value)
		if code != 2 || out != "" || !strings.Contains(errOut, tc.want) {
			t.Errorf("verify %s %s: exit %d, want 2 saying %q\n%s%s", tc.flag, tc.value, code, tc.want, out, errOut)
		}
	}
	dir := t.TempDir()
	for _, tc := range []struct{ flag, value, want string }{
		{"--grace", "-1s", "--grace -1s: want 0s (no grace) or a positive duration"},
		{"--reconcile-every", "0s", "--reconcile-every 0s: want a positive duration"},
	} {
		// Bounded, on ports and files of its own: a demo that took the
		// flag would serve until ctx ends.
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		var out, errOut strings.Builder
		code := cli.Main(ctx, []string{"demo", tc.flag, tc.value, "--store", "sqlite:" + filepath.Join(dir, "demo.db"),
			"--listen", "127.0.0.1:0", "--acquirer-listen", "127.0.0.1:0", "--admin-listen", "",
			"--audit-log", filepath.Join(dir, "audit.log"), "--journal-dir", filepath.Join(dir, "journal")}, noEnv, &out, &errOut)
		cancel()
		if code != 2 || !strings.Contains(errOut.String(), tc.want) {
			t.Errorf("demo %s %s: exit %d, want 2 saying %q\n%s%s", tc.flag, tc.value, code, tc.want, out.String(), errOut.String())
		}
	}
}

// TestKeysResolveRefusesAnInterimStatus: a completed outcome replays a
// final status; the store refuses a 1xx (a replay would be an empty 200)
// and its words reach the operator, with exit 2 (the command line was
// wrong). keys resolve took any status from 100.
func TestKeysResolveRefusesAnInterimStatus(t *testing.T) {
	dsn, engine := seed(t)
	for _, status := range []string{"102", "199", "1000"} {
		code, _, errOut := run(t, "keys", "resolve", "unknown", "--scope", "tenant", "--store", dsn, "--completed", "--status", status)
		if want := "response status " + status + " is not a final HTTP status (200 to 999"; code != 2 || !strings.Contains(errOut, want) {
			t.Errorf("keys resolve --completed --status %s: exit %d %q; want 2 saying %q", status, code, errOut, want)
		}
	}
	if code, _, errOut := run(t, "keys", "resolve", "unknown", "--scope", "tenant", "--store", dsn, "--completed"); code != 2 || !strings.Contains(errOut, "--completed needs --status") {
		t.Errorf("keys resolve --completed without --status: exit %d %q; want a usage error", code, errOut)
	}
	if rec, err := engine().Get(context.Background(), "tenant", "unknown"); err != nil || rec.State != idem.StateUnknown {
		t.Fatalf("after refused resolutions: %v, %v; want the record still unknown", rec.State, err)
	}
	if code, out, errOut := run(t, "keys", "resolve", "unknown", "--scope", "tenant", "--store", dsn, "--completed", "--status", "200"); code != 0 || !strings.Contains(out, "resolved unknown as completed") {
		t.Fatalf("keys resolve --completed --status 200: exit %d %s%s", code, out, errOut)
	}
}
