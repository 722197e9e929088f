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
// asked for read-only. Its pages show stored outcomes to whoever reaches
// them, so it answers only connections from loopback (an SSH tunnel,
// kubectl port-forward), unless told otherwise (Config.Remote): an admin
// listener on every interface, for a platform's health probes, does not
// publish it.
package console

import (
	"cmp"
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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
	// Remote serves the console to connections from addresses other than
	// loopback. Its pages need no token.
	Remote bool
	// Mask hides keys (only their first characters are shown), stored
	// bodies, header values and checkpoint data, from pages and links; the
	// listing then has no key filter.
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

	seal cipher.AEAD // seals record references when keys are masked

	mu      sync.Mutex // held while counting
	tally   tally
	tallied time.Time
	changed atomic.Bool // an action ran: count again
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
	secret := make([]byte, 32)
	rand.Read(secret)
	block, _ := aes.NewCipher(secret)
	c.seal, _ = cipher.NewGCM(block)
	var err error
	c.page, err = template.New("").Funcs(template.FuncMap{
		"time":  formatTime,
		"ago":   c.ago,
		"key":   c.showKey,
		"ref":   c.ref,
		"size":  formatSize,
		"count": func(v float64) string { return strconv.FormatFloat(v, 'f', 0, 64) },
		"list":  func(s ...string) []string { return s },
		"link":  c.link,
	}).ParseFS(assets, "assets/*.html")
	if err != nil {
		return nil, err
	}
	for _, f := range []string{"console.js", "console.css"} {
		c.mux.HandleFunc("GET /console/assets/"+f, func(w http.ResponseWriter, r *http.Request) {
			http.ServeFileFS(w, r, assets, "assets/"+f)
		})
	}
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
	if !localHost(r.Host) {
		http.Error(w, "The console answers only to an IP address or localhost (the Host header names "+
			"something else: a DNS rebinding, or a name the console does not know).", http.StatusMisdirectedRequest)
		return
	}
	if !c.cfg.Remote && !loopback(r.RemoteAddr) {
		http.Error(w, "The console answers only connections from this machine (loopback): reach it through an SSH tunnel "+
			"or kubectl port-forward, or set console_remote to serve it to the network (its pages show stored outcomes, "+
			"and need no token).", http.StatusForbidden)
		return
	}
	if c.Mode() == "off" && !strings.HasPrefix(r.URL.Path, "/console/assets/") {
		c.render(w, http.StatusForbidden, "off", nil)
		return
	}
	c.mux.ServeHTTP(w, r)
}

// loopback reports whether a connection's remote address is on loopback.
func loopback(remote string) bool {
	host, _, err := net.SplitHostPort(remote)
	if err != nil {
		host = remote
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// localHost reports whether host (a Host header) is an IP address or
// localhost: a page of another site that rebinds its name to the console's
// address still sends its own name, and is refused.
func localHost(host string) bool {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	return net.ParseIP(host) != nil || strings.EqualFold(host, "localhost")
}

// view is what every page gets.
type view struct {
	Title, Nav string
	Mode       string
	AuditPath  string
	Masked     bool
	Data       any
}

// titles are the pages' titles, and navAs the menu entry a page belongs to
// when it is not one.
var (
	titles = map[string]string{"overview": "Overview", "records": "Records", "record": "Record", "audit": "Audit log",
		"confirm": "Confirm", "problem": "Refused", "off": "Console off"}
	navAs = map[string]string{"record": "records", "confirm": "records"}
)

func (c *Console) render(w http.ResponseWriter, status int, name string, data any) {
	v := view{Title: titles[name], Nav: cmp.Or(navAs[name], name), Mode: c.Mode(), AuditPath: c.cfg.Audit.Path(), Masked: c.cfg.Mask, Data: data}
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
	httpidem.ObservedRejected, httpidem.ObservedClientGone, httpidem.ObservedMisconfigured}

// tally is the records counted by state, and the stale ones.
type tally struct {
	States      map[string]int `json:"states"`
	Stale       int            `json:"stale"`
	OldestStale time.Time      `json:"oldest_stale,omitzero"`
	// Capped is true when a count stopped at countCap records or after
	// countTime: the numbers by state are floors. (UNKNOWN and stale
	// records are counted by the reconciler's scan, which reads only them.)
	Capped bool   `json:"capped"`
	Error  string `json:"error,omitempty"`
}

// countCap and countTime bound each count, so the overview stays cheap on
// a large store: a count stops between two pages past either.
const (
	countCap  = 10000
	countTime = 3 * time.Second
)

// countPageTime bounds each page a count reads: the count holds every
// viewer's overview, and a store that does not answer (or one still being
// opened) must fail it, not hold it.
const countPageTime = 5 * time.Second

// recount is how long the records' counts are kept: listing costs the
// store reads (on DynamoDB, read capacity), so an open overview recounts
// at most this often; an action recounts at once.
const recount = 10 * time.Second

// count counts the records by state, at most every recount: one listing of
// every record for the states, and the reconciler's scan for the stale
// ones (on PostgreSQL, SQLite and Redis it reads an index of them only).
func (c *Console) count(ctx context.Context) tally {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.changed.Swap(false) && time.Since(c.tallied) < recount {
		return c.tally
	}
	// The counts serve every viewer: a viewer who goes away does not cut
	// them short (and a store call cut short would count as a failure);
	// each page is bounded instead.
	ctx = context.WithoutCancel(ctx)
	t := tally{States: map[string]int{}}
	eng := c.cfg.Engine
	now := eng.Now()
	_, capped, err := countPages(func(cursor string) (idem.ScanResult, error) {
		ctx, cancel := context.WithTimeout(ctx, countPageTime)
		defer cancel()
		return eng.List(ctx, idem.ListParams{Limit: 1000, Cursor: cursor})
	}, func(r idem.Record) { t.States[string(r.State)]++ })
	t.Capped = capped
	if err != nil {
		t.Error = errorText(err)
		c.tally, c.tallied = t, time.Now()
		return t
	}
	unknown := 0
	n, capped, err := countPages(func(cursor string) (idem.ScanResult, error) {
		ctx, cancel := context.WithTimeout(ctx, countPageTime)
		defer cancel()
		return eng.Scan(ctx, 1000, cursor)
	}, func(r idem.Record) {
		if r.State == idem.StateUnknown {
			unknown++
		}
		since := cmp.Or(staleSince(r, now), r.Updated)
		if t.OldestStale.IsZero() || since.Before(t.OldestStale) {
			t.OldestStale = since
		}
	})
	t.Stale, t.Capped = n, t.Capped || capped
	t.States[string(idem.StateUnknown)] = max(t.States[string(idem.StateUnknown)], unknown)
	if err != nil {
		t.Error = errorText(err)
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

// countPages counts the records of a listing, page by page, until countCap
// records or countTime, whichever comes first.
func countPages(page func(cursor string) (idem.ScanResult, error), each func(idem.Record)) (n int, capped bool, err error) {
	stop := time.Now().Add(countTime)
	for cursor := ""; ; {
		res, err := page(cursor)
		if err != nil {
			return n, false, err
		}
		for _, r := range res.Records {
			each(r)
		}
		n += len(res.Records)
		if cursor = res.Cursor; cursor == "" {
			return n, false, nil
		}
		if n >= countCap || time.Now().After(stop) {
			return n, true, nil
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
	f := filter{State: q.Get("state"), Scope: q.Get("scope"), Key: q.Get("key"), Since: q.Get("since"), Until: q.Get("until")}
	d := recordsData{Filter: f, States: []string{"", "stale", "in_progress", "unknown", "completed", "failed"}, Now: c.cfg.Engine.Now()}
	var err error
	f.Cursor, err = c.cursorOf(q.Get("cursor"))
	var res idem.ScanResult
	if err == nil {
		res, err = c.list(r.Context(), f)
	}
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
		d.Next = query("state", f.State, "scope", f.Scope, "key", f.Key, "since", f.Since, "until", f.Until, "cursor", c.sealed(res.Cursor))
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
	if c.cfg.Mask && f.Key != "" {
		// A key prefix answered one character at a time would give keys away.
		return idem.ScanResult{}, bad("keys are masked here: find a record by its key with idem keys show")
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
	if p.CreatedFrom, err = ParseTime(f.Since, now); err != nil {
		return idem.ScanResult{}, bad("since: %v", err)
	}
	if p.CreatedBefore, err = ParseTime(f.Until, now); err != nil {
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

// ParseTime reads a time as operators type it, in the console and in
// `idem keys`: RFC 3339, or a duration ago ("2h"); "" is the zero time.
func ParseTime(s string, now time.Time) (time.Time, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339, s); err == nil {
		return t, nil
	}
	if d, err := time.ParseDuration(s); err == nil && d >= 0 {
		return now.Add(-d), nil
	}
	return time.Time{}, fmt.Errorf("%q: want an RFC 3339 time such as 2026-11-01T00:00:00Z or a duration ago such as 72h", s)
}

// doneWords say what an action did, on the record page it returns to.
var doneWords = map[string]string{"resolve_completed": "resolved as completed", "resolve_failed": "resolved as failed",
	"release": "the lease was released"}

// recordData is the record page's content.
type recordData struct {
	R           idem.Record
	Now         time.Time
	Stale       bool
	Fingerprint []part
	Downstream  []part
	Checkpoints []checkpoint
	Headers     []part // the stored response's
	Body        string // a preview, as text
	BodySize    int
	BodyType    string
	BodyCut     bool
	Resolvable  bool      // UNKNOWN and abandoned: may be resolved
	Releasable  bool      // IN_PROGRESS and abandoned: may be released
	ResolveFrom time.Time // UNKNOWN, not abandoned yet: when it may be resolved
	Message     string
}

type part struct{ Name, Value string }

type checkpoint struct {
	Name string
	At   time.Time
	Data string
}

// bodyPreview is how much of a stored body the record page shows.
const bodyPreview = 8 << 10

func (c *Console) record(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	scope, key, ok := c.recordOf(q)
	if !ok {
		c.problem(w, http.StatusBadRequest, "This link does not name a record (or names it for a console that has restarted since): open the record from the list.")
		return
	}
	rec, err := c.cfg.Engine.Get(r.Context(), scope, key)
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
		data := string(cp.Data)
		if c.cfg.Mask {
			data = fmt.Sprintf("(masked: %s)", formatSize(len(cp.Data)))
		}
		d.Checkpoints = append(d.Checkpoints, checkpoint{cp.Name, cp.At, data})
	}
	if res := rec.Response; res != nil {
		d.BodySize, d.BodyType = len(res.Body), res.Header.Get("Content-Type")
		for name, vs := range res.Header {
			for _, v := range vs {
				if c.cfg.Mask {
					v = "(masked)"
				}
				d.Headers = append(d.Headers, part{name, v})
			}
		}
		slices.SortStableFunc(d.Headers, func(a, b part) int { return strings.Compare(a.Name, b.Name) })
		body := res.Body
		if len(body) > bodyPreview {
			body, d.BodyCut = body[:bodyPreview], true
			for i := 0; i < utf8.UTFMax && !utf8.Valid(body); i++ {
				body = body[:len(body)-1] // a character cut in two
			}
		}
		switch {
		case c.cfg.Mask:
			d.Body, d.BodyCut, d.BodyType = fmt.Sprintf("(masked: %s)", formatSize(len(res.Body))), false, ""
		case !utf8.Valid(body):
			d.Body, d.BodyCut = fmt.Sprintf("(binary: %s)", formatSize(len(res.Body))), false
		default:
			d.Body = string(body)
		}
	}
	abandoned := reconcile.Abandoned(rec, now)
	d.Resolvable = rec.State == idem.StateUnknown && abandoned
	d.Releasable = rec.State == idem.StateInProgress && abandoned
	if rec.State == idem.StateUnknown && !abandoned {
		d.ResolveFrom = reconcile.AbandonedAt(rec)
	}
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
	a := action{Name: f.Get("action"), State: f.Get("state"), Headers: f.Get("headers"), Body: f.Get("body"), Before: f.Get("before")}
	switch a.Name {
	case "resolve_completed":
		var err error
		if a.Status, err = strconv.Atoi(strings.TrimSpace(f.Get("status"))); err != nil {
			return a, errors.New("a completed outcome needs an HTTP status to replay, a number from 200 to 999")
		}
		if err := finalStatus(a.Status); err != nil {
			return a, err
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
		t, err := ParseTime(a.Before, c.cfg.Engine.Now())
		if err != nil || t.IsZero() {
			return a, fmt.Errorf("purge needs a time: %v", cmp.Or(err, errors.New("none given")))
		}
		if t.After(c.cfg.Engine.Now()) {
			return a, errors.New("purge takes a time in the past: records that expire later are still replayed")
		}
		// The time confirmed is the time purged: a duration ago is read
		// once, on the confirmation page.
		a.PurgeBefore, a.Before = t, t.Format(time.RFC3339Nano)
		a.Label = "Purge the settled records that expired before " + formatTime(t) + ". Records still replayed are never purged."
		return a, nil
	default:
		return a, errors.New("there is no such action")
	}
	var ok bool
	if a.Scope, a.Key, ok = c.recordOf(f); !ok {
		return a, errors.New("the form does not name a record (or names it for a console that has restarted since): open the record again")
	}
	var err error
	if a.Fence, err = strconv.ParseInt(f.Get("fence"), 10, 64); err != nil {
		return a, errors.New("the form does not say which record it saw")
	}
	return a, nil
}

// finalStatus says, on the form, what the store would refuse when the
// action is done (store.FinishParams.Validate, whose rule and words these
// are): a completed outcome replays a final status. A 1xx is an interim
// answer, which net/http follows with an empty 200. The store stays the
// judge: its refusal, should the two ever differ, is shown as well.
func finalStatus(st int) error {
	if st < 200 && st != http.StatusSwitchingProtocols || st > 999 {
		return fmt.Errorf("response status %d is not a final HTTP status (200 to 999; a 1xx is an interim answer, which a replay would follow with an empty 200)", st)
	}
	return nil
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
	a, ok := c.checkAction(w, r)
	if !ok {
		return
	}
	d := confirmData{A: a}
	if a.Name != "purge" {
		rec, err := c.cfg.Engine.Get(r.Context(), a.Scope, a.Key)
		if err != nil {
			c.problem(w, http.StatusConflict, "The record could not be read: "+errorText(err))
			return
		}
		if rec.Fence != a.Fence || string(rec.State) != a.State {
			c.problem(w, http.StatusConflict, "The record changed since you looked at it: open it again.")
			return
		}
		d.Record = &rec
	}
	c.render(w, http.StatusOK, "confirm", d)
}

// checkAction reads an action's form, once the console takes actions and
// the request comes from its own pages.
func (c *Console) checkAction(w http.ResponseWriter, r *http.Request) (action, bool) {
	if c.Mode() != "actions" {
		c.problem(w, http.StatusForbidden, "This console is read-only: it takes no action.")
		return action{}, false
	}
	if !sameOrigin(r) {
		c.problem(w, http.StatusForbidden, "Refused: the action did not come from this console's pages.")
		return action{}, false
	}
	a, err := c.readAction(r)
	if err != nil {
		c.problem(w, http.StatusBadRequest, err.Error())
		return action{}, false
	}
	return a, true
}

// act does an action: the token must be there, the request must come from
// the console's own pages, and the record must be the one the operator saw.
func (c *Console) act(w http.ResponseWriter, r *http.Request) {
	a, ok := c.checkAction(w, r)
	if !ok {
		return
	}
	who := strings.TrimSpace(r.PostForm.Get("who"))
	// Digests of equal length: the comparison says nothing of the token's length.
	got, want := sha256.Sum256([]byte(r.PostForm.Get("token"))), sha256.Sum256([]byte(c.cfg.Token))
	if subtle.ConstantTimeCompare(got[:], want[:]) != 1 {
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
	var unanswered bool // the store did not answer: the action may have been done
	if a.Name == "purge" {
		e.Before = "settled records that expired before " + formatTime(a.PurgeBefore)
		n, err := c.cfg.Engine.Prune(r.Context(), idem.PruneOptions{Before: a.PurgeBefore})
		e.After = fmt.Sprintf("%d purged", n)
		if err != nil {
			e.Error = "the purge stopped: " + errorText(err)
		}
		back = Prefix + "audit"
	} else {
		var err error
		e.Scope, e.KeyHash = a.Scope, idem.KeyHash(a.Scope, a.Key)
		e.Before, e.After, err = c.settle(r.Context(), a)
		if err != nil {
			e.Error, unanswered = err.Error(), errors.Is(err, idem.ErrUnavailable)
		}
		back = Prefix + "record" + c.link(a.Scope, a.Key) + "&done=" + a.Name
	}
	c.changed.Store(true)
	c.cfg.Logger.Info("console: action", "action", e.Action, "who", e.Who, "from", e.From, "key_hash", e.KeyHash,
		"before", e.Before, "after", e.After, "err", e.Error)
	if err := c.cfg.Audit.Write(e); err != nil {
		c.cfg.Logger.Error("console: the audit log could not be written", "action", e.Action, "err", err)
		c.problem(w, http.StatusInternalServerError, "The action ran ("+cmp.Or(e.Error, e.After)+"), but the audit log could not be written: "+err.Error())
		return
	}
	switch {
	case e.Error != "" && a.Name == "purge":
		c.problem(w, http.StatusServiceUnavailable, fmt.Sprintf("%s, after %s.", e.Error, e.After))
		return
	case unanswered:
		c.problem(w, http.StatusServiceUnavailable, "The store did not answer ("+e.Error+"): the action may have been done. The record, read again: "+e.After+". Look at it before acting again.")
		return
	case e.Error != "":
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
	switch err := reconcile.Resolve(ctx, eng, rec, res, false); {
	case errors.Is(err, idem.ErrLeaseLost):
		return before, before, errors.New("the record changed meanwhile (settled or taken over); look again")
	case errors.Is(err, reconcile.ErrLeaseRunning), errors.Is(err, reconcile.ErrSettled):
		return before, before, err // reconcile's own words: the state, or from when it may be settled
	case errors.Is(err, idem.ErrUnavailable):
		// Its write may have landed with the answer lost: say what the
		// record is now, not that nothing changed.
		after := "not known: reading it back failed"
		if now, gerr := eng.Get(ctx, a.Scope, a.Key); gerr == nil {
			after = describe(now)
		}
		return before, after, idem.ErrUnavailable
	case errors.Is(err, idem.ErrInvalid):
		// The store refused the outcome given (a status it does not
		// replay): its words say what to change.
		return before, before, errors.New(strings.TrimPrefix(err.Error(), idem.ErrInvalid.Error()+": "))
	case err != nil:
		return before, before, errors.New(errorText(err))
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

// ref names a record in a form: its scope and key, opaque; when keys are
// masked, sealed for this process, so that no key is in a page's source.
func (c *Console) ref(scope, key string) string {
	plain := scope + "\x00" + key
	if !c.cfg.Mask {
		return base64.RawURLEncoding.EncodeToString([]byte(plain))
	}
	return c.sealed(plain)
}

// sealed is plain as it may go into a page when keys are masked: sealed
// for this process (a store's cursor holds the key it resumes after).
// Unmasked, it is plain.
func (c *Console) sealed(plain string) string {
	if !c.cfg.Mask || plain == "" {
		return plain
	}
	nonce := make([]byte, c.seal.NonceSize())
	rand.Read(nonce)
	return base64.RawURLEncoding.EncodeToString(c.seal.Seal(nonce, nonce, []byte(plain), nil))
}

// unseal reads what sealed made of a text, when keys are masked.
func (c *Console) unseal(s string) (string, bool) {
	b, err := base64.RawURLEncoding.DecodeString(s)
	n := c.seal.NonceSize()
	if err != nil || len(b) < n {
		return "", false
	}
	if b, err = c.seal.Open(nil, b[:n], b[n:], nil); err != nil {
		return "", false
	}
	return string(b), true
}

// cursorOf reads a listing's cursor from a page link (see sealed).
func (c *Console) cursorOf(s string) (string, error) {
	if !c.cfg.Mask || s == "" {
		return s, nil
	}
	plain, ok := c.unseal(s)
	if !ok {
		return "", fmt.Errorf("%w: the page link is not this console's (it may have restarted): list again", errBadFilter)
	}
	return plain, nil
}

// link is the query that opens a record's page: its scope and key, or,
// when keys are masked, its sealed ref, so that no key is in a link, the
// browser's history or an access log.
func (c *Console) link(scope, key string) string {
	if c.cfg.Mask {
		return query("ref", c.ref(scope, key))
	}
	return query("scope", scope, "key", key)
}

// recordOf reads which record a query or form names: a ref, or (unless
// keys are masked) a scope and a key.
func (c *Console) recordOf(v url.Values) (scope, key string, ok bool) {
	ref := v.Get("ref")
	if ref == "" {
		return v.Get("scope"), v.Get("key"), !c.cfg.Mask && v.Has("key")
	}
	var plain string
	if c.cfg.Mask {
		if plain, ok = c.unseal(ref); !ok {
			return "", "", false
		}
	} else {
		b, err := base64.RawURLEncoding.DecodeString(ref)
		if err != nil {
			return "", "", false
		}
		plain = string(b)
	}
	scope, key, ok = strings.Cut(plain, "\x00")
	return scope, key, ok
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
