// Package console is the operator console that `idem proxy` and `idem demo`
// serve on their admin listener, under /console/: the request rates and the
// records by state, live; the records, filtered and one by one; and the
// actions that settle them (resolve an UNKNOWN record, release a stale
// lease, purge expired records), each confirmed, done through the same
// library operations as `idem keys`, and written to an audit log.
//
// Security: pages are rendered on the server with html/template and a
// Content-Security-Policy that lets no inline script run, so a stored body
// is always text. Every action is a POST that carries the admin token,
// compared in constant time, and comes from the console's own origin; no
// GET changes anything. Without a token the console is off, unless it is
// asked for read-only.
package console

import (
	"cmp"
	"context"
	"crypto/subtle"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/internal/telemetry"
	"github.com/idemhq/idem/reconcile"
)

// Config is what the console shows and acts on.
type Config struct {
	// Engine is the engine whose store the console reads and settles. Required.
	Engine *idem.Engine
	// Counts reads the process's counters; nil shows no rates.
	Counts func() telemetry.Counts
	// Token is the admin token every action must carry. Without it the
	// console is off, unless ReadOnly.
	Token string
	// ReadOnly serves the console without any action, token or not.
	ReadOnly bool
	// Mask hides keys (only their first characters are shown) and stored
	// bodies.
	Mask bool
	// Audit is where actions are written; nil keeps them in memory.
	Audit *Audit
	// Logger logs each action; nil is slog.Default().
	Logger *slog.Logger
}

// Console serves the console. Mount it at /console/.
type Console struct {
	cfg  Config
	mux  *http.ServeMux
	page *template.Template

	mu      sync.Mutex
	tally   tally
	tallied time.Time
}

// Prefix is the path the console is served under.
const Prefix = "/console/"

//go:embed assets
var assets embed.FS

// New returns the console for cfg.
func New(cfg Config) (*Console, error) {
	if cfg.Engine == nil {
		return nil, errors.New("console: no engine")
	}
	if cfg.Audit == nil {
		cfg.Audit = &Audit{}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	c := &Console{cfg: cfg, mux: http.NewServeMux()}
	var err error
	c.page, err = template.New("").Funcs(template.FuncMap{
		"time":  func(t time.Time) string { return formatTime(t) },
		"ago":   func(t time.Time) string { return c.ago(t) },
		"key":   c.showKey,
		"query": func(kv ...string) string { return query(kv...) },
		"size":  formatSize,
		"list":  func(s ...string) []string { return s },
	}).ParseFS(assets, "assets/*.html")
	if err != nil {
		return nil, err
	}
	static, _ := fs.Sub(assets, "assets")
	c.mux.Handle("GET /console/assets/", http.StripPrefix("/console/assets/", http.FileServerFS(static)))
	c.mux.HandleFunc("GET /console/{$}", c.overview)
	c.mux.HandleFunc("GET /console/api/overview", c.overviewJSON)
	c.mux.HandleFunc("GET /console/records", c.records)
	c.mux.HandleFunc("GET /console/record", c.record)
	c.mux.HandleFunc("GET /console/audit", c.audit)
	c.mux.HandleFunc("POST /console/confirm", c.confirm)
	c.mux.HandleFunc("POST /console/act", c.act)
	return c, nil
}

// Mode says what the console allows: "actions" (with the token),
// "read-only", or "off" (no token, and read-only was not asked for).
func (c *Console) Mode() string {
	switch {
	case c.cfg.ReadOnly:
		return "read-only"
	case c.cfg.Token != "":
		return "actions"
	}
	return "off"
}

// ServeHTTP serves the console's pages, with headers that keep the browser
// from running anything but the console's own script.
func (c *Console) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "same-origin")
	h.Set("X-Frame-Options", "DENY")
	h.Set("Cache-Control", "no-store")
	if c.Mode() == "off" && !strings.HasPrefix(r.URL.Path, "/console/assets/") {
		c.render(w, http.StatusForbidden, "off", nil)
		return
	}
	c.mux.ServeHTTP(w, r)
}

// view is what every page gets.
type view struct {
	Title, Nav string
	Mode       string
	AuditPath  string
	Masked     bool
	Data       any
}

func (c *Console) render(w http.ResponseWriter, status int, name string, data any) {
	titles := map[string]string{"overview": "Overview", "records": "Records", "record": "Record", "audit": "Audit log",
		"confirm": "Confirm", "done": "Done", "problem": "Refused", "off": "Console off"}
	nav := map[string]string{"record": "records", "confirm": "records", "done": "records"}[name]
	v := view{Title: titles[name], Nav: cmp.Or(nav, name), Mode: c.Mode(), AuditPath: c.cfg.Audit.Path(), Masked: c.cfg.Mask, Data: data}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	if err := c.page.ExecuteTemplate(w, name+".html", v); err != nil {
		c.cfg.Logger.Warn("console: rendering a page", "page", name, "err", err)
	}
}

// problem answers with a page that says what went wrong.
func (c *Console) problem(w http.ResponseWriter, status int, msg string) {
	c.render(w, status, "problem", msg)
}

// outcomes are the request outcomes the overview shows, in this order.
var outcomes = []string{httpidem.ObservedExecuted, httpidem.ObservedReplayed, httpidem.ObservedInFlight,
	httpidem.ObservedUncertain, httpidem.ObservedMismatch, httpidem.ObservedNotReplayable, httpidem.ObservedStoreError,
	httpidem.ObservedFailOpen, httpidem.ObservedKeyMissing, httpidem.ObservedKeyInvalid, httpidem.ObservedNoKey,
	httpidem.ObservedRejected, httpidem.ObservedClientGone}

// tally is the records counted by state, and the stale ones.
type tally struct {
	States      map[string]int `json:"states"`
	Stale       int            `json:"stale"`
	OldestStale time.Time      `json:"oldest_stale,omitzero"`
	// Capped is true when a count stopped at countCap (or at the time
	// bound): the number is a floor.
	Capped bool   `json:"capped"`
	Error  string `json:"error,omitempty"`
}

// countCap bounds each count, so the overview stays cheap on a large table.
const countCap = 10000

// recount is how long the records' counts are kept: listing costs the
// store reads (on DynamoDB, read capacity), so an open overview recounts
// at most this often; an action recounts at once.
const recount = 10 * time.Second

// count counts the records by state, at most every recount.
func (c *Console) count(ctx context.Context) tally {
	c.mu.Lock()
	defer c.mu.Unlock()
	if time.Since(c.tallied) < recount {
		return c.tally
	}
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	t := tally{States: map[string]int{}}
	eng := c.cfg.Engine
	now := eng.Now()
	for _, st := range []idem.State{idem.StateInProgress, idem.StateUnknown, idem.StateCompleted, idem.StateFailed} {
		n, capped, err := countPages(func(cursor string) (idem.ScanResult, error) {
			return eng.List(ctx, idem.ListParams{States: []idem.State{st}, Limit: 1000, Cursor: cursor})
		}, nil)
		t.States[string(st)], t.Capped = n, t.Capped || capped
		if err != nil {
			t.Error = errorText(err)
			break
		}
	}
	if t.Error == "" {
		n, capped, err := countPages(func(cursor string) (idem.ScanResult, error) { return eng.Scan(ctx, 1000, cursor) }, func(r idem.Record) {
			since := cmp.Or(staleSince(r, now), r.Updated)
			if t.OldestStale.IsZero() || since.Before(t.OldestStale) {
				t.OldestStale = since
			}
		})
		t.Stale, t.Capped = n, t.Capped || capped
		if err != nil {
			t.Error = errorText(err)
		}
	}
	c.tally, c.tallied = t, time.Now()
	return t
}

// staleSince is when r became stale: its lease's end, for a record that was
// running; zero for an UNKNOWN record (its Updated says when it was marked).
func staleSince(r idem.Record, now time.Time) time.Time {
	if r.State == idem.StateInProgress && !r.LeaseExpires.After(now) {
		return r.LeaseExpires
	}
	return time.Time{}
}

// countPages counts the records of a listing, page by page, up to countCap.
func countPages(page func(cursor string) (idem.ScanResult, error), each func(idem.Record)) (n int, capped bool, err error) {
	for cursor := ""; ; {
		res, err := page(cursor)
		if errors.Is(err, context.DeadlineExceeded) {
			return n, true, nil
		}
		if err != nil {
			return n, false, err
		}
		for _, r := range res.Records {
			if each != nil {
				each(r)
			}
		}
		n += len(res.Records)
		if n >= countCap {
			return n, true, nil
		}
		if cursor = res.Cursor; cursor == "" {
			return n, false, nil
		}
	}
}

// overviewData is the overview page's, and its JSON's, content.
type overviewData struct {
	At       time.Time         `json:"at"`
	Outcomes []string          `json:"outcomes"`
	Counts   *telemetry.Counts `json:"counts,omitempty"`
	Records  tally             `json:"records"`
	// OldestStaleAge is how long the oldest stale record has been stale.
	OldestStaleAge string `json:"oldest_stale_age,omitempty"`
}

func (c *Console) overviewOf(ctx context.Context) overviewData {
	d := overviewData{At: time.Now(), Outcomes: outcomes, Records: c.count(ctx)}
	if c.cfg.Counts != nil {
		n := c.cfg.Counts()
		d.Counts = &n
	}
	if !d.Records.OldestStale.IsZero() {
		d.OldestStaleAge = c.ago(d.Records.OldestStale)
	}
	return d
}

func (c *Console) overview(w http.ResponseWriter, r *http.Request) {
	c.render(w, http.StatusOK, "overview", c.overviewOf(r.Context()))
}

func (c *Console) overviewJSON(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(c.overviewOf(r.Context()))
}

// filter is the records page's form.
type filter struct {
	State, Scope, Key, Since, Until, Cursor string
}

// recordsData is the records page's content.
type recordsData struct {
	Filter  filter
	States  []string
	Records []idem.Record
	Next    string // the next page's query; empty on the last
	Error   string
	Now     time.Time
}

// pageSize is how many records a page of the listing shows.
const pageSize = 50

func (c *Console) records(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f := filter{State: q.Get("state"), Scope: q.Get("scope"), Key: q.Get("key"), Since: q.Get("since"), Until: q.Get("until"), Cursor: q.Get("cursor")}
	d := recordsData{Filter: f, States: []string{"", "stale", "in_progress", "unknown", "completed", "failed"}, Now: c.cfg.Engine.Now()}
	res, err := c.list(r.Context(), f)
	switch {
	case errors.Is(err, errBadFilter):
		d.Error = err.Error()
		c.render(w, http.StatusBadRequest, "records", d)
		return
	case err != nil:
		d.Error = errorText(err)
		c.render(w, http.StatusServiceUnavailable, "records", d)
		return
	}
	d.Records = res.Records
	if res.Cursor != "" {
		d.Next = query("state", f.State, "scope", f.Scope, "key", f.Key, "since", f.Since, "until", f.Until, "cursor", res.Cursor)
	}
	c.render(w, http.StatusOK, "records", d)
}

var errBadFilter = errors.New("filter")

// list reads one page of the records f asks for.
func (c *Console) list(ctx context.Context, f filter) (idem.ScanResult, error) {
	eng := c.cfg.Engine
	now := eng.Now()
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", errBadFilter, fmt.Sprintf(format, args...))
	}
	if f.State == "stale" {
		if f.Scope != "" || f.Key != "" || f.Since != "" || f.Until != "" {
			return idem.ScanResult{}, bad("stale records are listed as the reconciler sees them, with no other filter")
		}
		return eng.Scan(ctx, pageSize, f.Cursor)
	}
	p := idem.ListParams{ScopePrefix: f.Scope, KeyPrefix: f.Key, Limit: pageSize, Cursor: f.Cursor}
	if f.State != "" {
		st := idem.State(f.State)
		if !st.Valid() {
			return idem.ScanResult{}, bad("no state %q", f.State)
		}
		p.States = []idem.State{st}
	}
	var err error
	if p.CreatedFrom, err = parseTime(f.Since, now); err != nil {
		return idem.ScanResult{}, bad("since: %v", err)
	}
	if p.CreatedBefore, err = parseTime(f.Until, now); err != nil {
		return idem.ScanResult{}, bad("until: %v", err)
	}
	if !p.CreatedFrom.IsZero() && !p.CreatedBefore.IsZero() && !p.CreatedFrom.Before(p.CreatedBefore) {
		return idem.ScanResult{}, bad("since is not before until")
	}
	res, err := eng.List(ctx, p)
	if errors.Is(err, idem.ErrInvalid) {
		return res, bad("%v", err)
	}
	return res, err
}

// parseTime reads a time as RFC 3339, or as a duration ago ("2h"); "" is
// the zero time.
func parseTime(s string, now time.Time) (time.Time, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return time.Time{}, nil
	}
	if d, err := time.ParseDuration(s); err == nil {
		if d < 0 {
			return time.Time{}, fmt.Errorf("%q: a duration ago is positive", s)
		}
		return now.Add(-d), nil
	}
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		return time.Time{}, fmt.Errorf("%q: want an RFC 3339 time (2026-12-01T10:00:00Z) or a duration ago (90m)", s)
	}
	return t, nil
}

// doneWords say what an action did, on the record page it returns to.
var doneWords = map[string]string{"resolve_completed": "resolved as completed", "resolve_failed": "resolved as failed",
	"release": "the lease was released"}

// recordData is the record page's content.
type recordData struct {
	R            idem.Record
	Now          time.Time
	Stale        bool
	Fingerprint  []part
	Downstream   []part
	Body         string // a preview, as text
	BodySize     int
	BodyType     string
	BodyCut      bool
	Resolvable   bool // UNKNOWN: may be resolved
	Releasable   bool // IN_PROGRESS past its lease: may be released
	Message      string
	ReplayStatus int
}

type part struct{ Name, Value string }

// bodyPreview is how much of a stored body the record page shows.
const bodyPreview = 8 << 10

func (c *Console) record(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	rec, err := c.cfg.Engine.Get(r.Context(), q.Get("scope"), q.Get("key"))
	switch {
	case errors.Is(err, idem.ErrNotFound):
		c.problem(w, http.StatusNotFound, "There is no record of this key in this scope: it may have expired, or been purged.")
		return
	case errors.Is(err, idem.ErrInvalid):
		c.problem(w, http.StatusBadRequest, "This is not a scope and key idem could hold.")
		return
	case err != nil:
		c.problem(w, http.StatusServiceUnavailable, "The store did not answer: "+errorText(err))
		return
	}
	now := c.cfg.Engine.Now()
	d := recordData{R: rec, Now: now, Stale: rec.Stale(now), Message: doneWords[q.Get("done")]}
	names := []string{"version", "method", "path", "query", "body"}
	for i, v := range strings.SplitN(string(rec.Fingerprint), ".", 5) {
		if i < len(names) {
			d.Fingerprint = append(d.Fingerprint, part{names[i], v})
		}
	}
	for _, cp := range rec.Checkpoints {
		d.Downstream = append(d.Downstream, part{cp.Name, rec.DownstreamKey(cp.Name)})
	}
	if res := rec.Response; res != nil {
		d.BodySize, d.BodyType = len(res.Body), res.Header.Get("Content-Type")
		body := res.Body
		if len(body) > bodyPreview {
			body, d.BodyCut = body[:bodyPreview], true
		}
		switch {
		case c.cfg.Mask:
			d.Body = fmt.Sprintf("(masked: %s)", formatSize(len(res.Body)))
		case !utf8.Valid(body) && !d.BodyCut:
			d.Body = fmt.Sprintf("(binary: %s)", formatSize(len(res.Body)))
		default:
			d.Body = strings.ToValidUTF8(string(body), "\uFFFD")
		}
	}
	d.Resolvable = rec.State == idem.StateUnknown
	d.Releasable = rec.State == idem.StateInProgress && !now.Before(rec.LeaseExpires)
	c.render(w, http.StatusOK, "record", d)
}

func (c *Console) audit(w http.ResponseWriter, r *http.Request) {
	c.render(w, http.StatusOK, "audit", c.cfg.Audit.Recent())
}

// action is an action's form, as the record page (or the overview, for a
// purge) sends it and the confirmation page sends it again.
type action struct {
	Name          string // resolve_completed, resolve_failed, release, purge
	Scope, Key    string
	Fence         int64  // the fence of the record the operator looked at
	State         string // and its state
	Status        int
	Headers, Body string
	Before        string // purge: records that expired before this
	// Label says what the action does, in words.
	Label string
	// PurgeBefore is Before, read.
	PurgeBefore time.Time
}

// readAction reads and checks an action's form.
func (c *Console) readAction(r *http.Request) (action, error) {
	if err := r.ParseForm(); err != nil {
		return action{}, errors.New("the form could not be read")
	}
	f := r.PostForm
	a := action{Name: f.Get("action"), Scope: f.Get("scope"), Key: f.Get("key"), State: f.Get("state"),
		Headers: f.Get("headers"), Body: f.Get("body"), Before: f.Get("before")}
	switch a.Name {
	case "resolve_completed":
		var err error
		if a.Status, err = strconv.Atoi(strings.TrimSpace(f.Get("status"))); err != nil || a.Status < 100 || a.Status > 599 {
			return a, errors.New("a completed outcome needs an HTTP status from 100 to 599 to replay")
		}
		if _, err := parseHeaders(a.Headers); err != nil {
			return a, err
		}
		a.Label = fmt.Sprintf("Resolve as completed: retries of this key will replay status %d and the body below.", a.Status)
	case "resolve_failed":
		a.Label = "Resolve as failed: nothing happened; the key is released and the next retry runs the request."
	case "release":
		a.Label = "Release the stale lease: its owner is gone and nothing happened; the next retry runs the request."
	case "purge":
		t, err := parseTime(a.Before, c.cfg.Engine.Now())
		if err != nil || t.IsZero() {
			return a, fmt.Errorf("purge needs a time: %v", cmp.Or(err, errors.New("none given")))
		}
		a.PurgeBefore = t
		a.Label = "Purge the settled records that expired before " + formatTime(t) + ". Records still replayed are never purged."
		return a, nil
	default:
		return a, errors.New("there is no such action")
	}
	var err error
	if a.Fence, err = strconv.ParseInt(f.Get("fence"), 10, 64); err != nil {
		return a, errors.New("the form does not say which record it saw")
	}
	return a, nil
}

// parseHeaders reads "Name: value" lines.
func parseHeaders(s string) (http.Header, error) {
	h := http.Header{}
	for line := range strings.Lines(s) {
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		name, value, ok := strings.Cut(line, ":")
		if !ok || strings.TrimSpace(name) == "" || strings.ContainsAny(strings.TrimSpace(name), " \t") {
			return nil, fmt.Errorf("a header line is Name: value, not %q", line)
		}
		h.Add(strings.TrimSpace(name), strings.TrimSpace(value))
	}
	return h, nil
}

// confirmData is the confirmation page's content.
type confirmData struct {
	A      action
	Record *idem.Record
}

// confirm shows what an action will do, and asks for the token to do it.
// It changes nothing.
func (c *Console) confirm(w http.ResponseWriter, r *http.Request) {
	if c.Mode() != "actions" {
		c.problem(w, http.StatusForbidden, "This console is read-only: it takes no action.")
		return
	}
	a, err := c.readAction(r)
	if err != nil {
		c.problem(w, http.StatusBadRequest, err.Error())
		return
	}
	d := confirmData{A: a}
	if a.Name != "purge" {
		rec, err := c.cfg.Engine.Get(r.Context(), a.Scope, a.Key)
		if err != nil {
			c.problem(w, http.StatusConflict, "The record could not be read: "+errorText(err))
			return
		}
		d.Record = &rec
	}
	c.render(w, http.StatusOK, "confirm", d)
}

// act does an action: the token must be there, the request must come from
// the console's own pages, and the record must be the one the operator saw.
func (c *Console) act(w http.ResponseWriter, r *http.Request) {
	if c.Mode() != "actions" {
		c.problem(w, http.StatusForbidden, "This console is read-only: it takes no action.")
		return
	}
	if !sameOrigin(r) {
		c.problem(w, http.StatusForbidden, "Refused: the action did not come from this console's pages.")
		return
	}
	a, err := c.readAction(r)
	if err != nil {
		c.problem(w, http.StatusBadRequest, err.Error())
		return
	}
	who := strings.TrimSpace(r.PostForm.Get("who"))
	token := r.PostForm.Get("token")
	if subtle.ConstantTimeCompare([]byte(token), []byte(c.cfg.Token)) != 1 {
		c.cfg.Logger.Warn("console: an action was refused: wrong or missing admin token", "action", a.Name, "from", r.RemoteAddr)
		c.problem(w, http.StatusForbidden, "Refused: the admin token is missing or wrong. Nothing was changed.")
		return
	}
	if who == "" || len(who) > 100 {
		c.problem(w, http.StatusBadRequest, "Say who you are (up to 100 characters): the audit log records it.")
		return
	}
	e := Entry{At: time.Now().UTC(), Who: who, From: r.RemoteAddr, Action: a.Name}
	var back string
	if a.Name == "purge" {
		e.Before = "settled records that expired before " + formatTime(a.PurgeBefore)
		n, err := c.cfg.Engine.Prune(r.Context(), idem.PruneOptions{Before: a.PurgeBefore})
		e.After = fmt.Sprintf("%d purged", n)
		if err != nil {
			e.Error = errorText(err)
		}
		back = Prefix + "audit"
	} else {
		e.Scope, e.KeyHash = a.Scope, idem.KeyHash(a.Scope, a.Key)
		e.Before, e.After, err = c.settle(r.Context(), a)
		if err != nil {
			e.Error = err.Error()
		}
		back = Prefix + "record" + query("scope", a.Scope, "key", a.Key, "done", a.Name)
	}
	c.mu.Lock()
	c.tallied = time.Time{} // the counts changed
	c.mu.Unlock()
	c.cfg.Logger.Info("console: action", "action", e.Action, "who", e.Who, "from", e.From, "scope", e.Scope, "key_hash", e.KeyHash,
		"before", e.Before, "after", e.After, "err", e.Error)
	if err := c.cfg.Audit.Write(e); err != nil {
		c.cfg.Logger.Error("console: the audit log could not be written", "action", e.Action, "err", err)
		c.problem(w, http.StatusInternalServerError, "The action ran ("+cmp.Or(e.Error, e.After)+"), but the audit log could not be written: "+err.Error())
		return
	}
	if e.Error != "" {
		c.problem(w, http.StatusConflict, "Nothing was changed: "+e.Error)
		return
	}
	http.Redirect(w, r, back, http.StatusSeeOther)
}

// settle resolves or releases the record a names, through the same
// operation as `idem keys resolve`, if it is still the one the operator saw.
func (c *Console) settle(ctx context.Context, a action) (before, after string, err error) {
	eng := c.cfg.Engine
	rec, err := eng.Get(ctx, a.Scope, a.Key)
	if err != nil {
		return "", "", fmt.Errorf("the record could not be read: %s", errorText(err))
	}
	before = describe(rec)
	if rec.Fence != a.Fence || string(rec.State) != a.State {
		return before, before, errors.New("the record changed since you looked at it; look again")
	}
	res := reconcile.Resolution{Outcome: reconcile.Failed}
	switch a.Name {
	case "resolve_completed", "resolve_failed":
		if rec.State != idem.StateUnknown {
			return before, before, fmt.Errorf("only an UNKNOWN record is resolved here; this one is %s", rec.State)
		}
		if a.Name == "resolve_completed" {
			h, _ := parseHeaders(a.Headers)
			res = reconcile.Resolution{Outcome: reconcile.Completed, Response: &idem.Response{Status: a.Status, Header: h, Body: []byte(a.Body)}}
		}
	case "release":
		if rec.State != idem.StateInProgress {
			return before, before, fmt.Errorf("only a running record's lease is released; this one is %s", rec.State)
		}
	}
	if err := reconcile.Resolve(ctx, eng, rec, res, false); err != nil {
		if errors.Is(err, idem.ErrLeaseLost) {
			err = errors.New("the record changed meanwhile (settled or taken over); look again")
		}
		return before, before, err
	}
	if rec, err = eng.Get(ctx, a.Scope, a.Key); err != nil {
		return before, "settled; reading it back failed: " + errorText(err), nil
	}
	return before, describe(rec), nil
}

// describe sums a record up for the audit log, without its body.
func describe(r idem.Record) string {
	s := fmt.Sprintf("%s, fence %d", r.State, r.Fence)
	if r.Response != nil {
		s += fmt.Sprintf(", status %d, %s body", r.Response.Status, formatSize(len(r.Response.Body)))
	}
	return s
}

// sameOrigin reports whether r comes from a page of this console. A
// browser says where a request comes from in Sec-Fetch-Site, or else in
// Origin; a request with neither (curl) is let through, as the token is
// what guards it.
func sameOrigin(r *http.Request) bool {
	switch r.Header.Get("Sec-Fetch-Site") {
	case "same-origin", "none":
		return true
	case "":
	default:
		return false
	}
	if o := r.Header.Get("Origin"); o != "" {
		u, err := url.Parse(o)
		return err == nil && u.Host == r.Host
	}
	return true
}

// showKey is a key as the console shows it: whole, or masked.
func (c *Console) showKey(k string) string {
	if !c.cfg.Mask {
		return k
	}
	n := min(4, len(k))
	return k[:n] + strings.Repeat("•", 4) + fmt.Sprintf(" (%d chars)", len(k))
}

func (c *Console) ago(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	d := c.cfg.Engine.Now().Sub(t)
	suffix := " ago"
	if d < 0 {
		d, suffix = -d, " from now"
	}
	switch {
	case d < time.Second:
		return "now"
	case d < time.Minute:
		return fmt.Sprintf("%ds%s", int(d.Seconds()), suffix)
	case d < time.Hour:
		return fmt.Sprintf("%dm%s", int(d.Minutes()), suffix)
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%dm%s", int(d.Hours()), int(d.Minutes())%60, suffix)
	}
	return fmt.Sprintf("%dd%s", int(d.Hours()/24), suffix)
}

func formatTime(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format("2006-01-02 15:04:05Z")
}

func formatSize(n int) string {
	switch {
	case n < 1<<10:
		return fmt.Sprintf("%d B", n)
	case n < 1<<20:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
}

// query builds "?k=v&…" from pairs, leaving out empty values.
func query(kv ...string) string {
	v := url.Values{}
	for i := 0; i+1 < len(kv); i += 2 {
		if kv[i+1] != "" {
			v.Set(kv[i], kv[i+1])
		}
	}
	if len(v) == 0 {
		return ""
	}
	return "?" + v.Encode()
}

// errorText is what the console says of a store error: the sentinel's
// words, never a DSN.
func errorText(err error) string {
	for _, s := range []error{idem.ErrUnavailable, idem.ErrLeaseLost, idem.ErrNotFound, idem.ErrInvalid, context.DeadlineExceeded, reconcile.ErrLeaseRunning, reconcile.ErrSettled} {
		if errors.Is(err, s) {
			return s.Error()
		}
	}
	return "the store failed"
}
