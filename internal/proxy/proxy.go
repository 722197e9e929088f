// Package proxy is `idem proxy`: a reverse proxy that puts the idempotency
// contract in front of an API written in any language.
//
// Each request is matched to a route (a net/http ServeMux pattern such as
// "POST /v1/charges"); the route's rules configure the httpidem middleware in
// front of the upstream. What the upstream did decides what is stored:
//
//   - the request could not be sent (connection refused before any byte was
//     written): nothing happened, the key is released, a retry runs;
//   - it was sent but no response came back (reset, timeout), or the
//     response stopped mid-body (cut, or nothing for upstream_timeout): the
//     outcome is unknown, and a retry gets 409 operation-uncertain instead
//     of a second execution;
//   - the upstream answered 429 or 503: released (stored, unless
//     explicit_release);
//   - any other answer is stored and replayed: kept whole, with or without
//     a Content-Length, up to the size limit; a stream (text/event-stream)
//     goes through as it comes and is not kept (its retry gets 409
//     response-not-replayable).
//
// A request to the upstream is never sent twice by the transport itself
// (see neverResent). The proxy starts whether or not its store answers,
// reports the store's health on /readyz ([Health]), and bounds its client
// connections ([Timeouts]).
package proxy

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/http/httputil"
	"net/url"
	"path"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/internal/redact"
	"github.com/idemhq/idem/internal/storeopen"
	"github.com/idemhq/idem/store/memstore"
)

// Defaults for [Config].
const (
	DefaultListen          = "127.0.0.1:8080"
	DefaultScopeHeader     = "Authorization"
	DefaultUpstreamTimeout = 60 * time.Second
	// DefaultShutdownTimeout is above DefaultUpstreamTimeout, so that a
	// graceful stop lets a request waiting on its upstream for as long as
	// it may finish and store its outcome, rather than cut it (its record
	// then UNKNOWN, for the reconciler). Under Kubernetes, whose default
	// grace period is 30 s, set terminationGracePeriodSeconds above it.
	DefaultShutdownTimeout = 75 * time.Second
	// DefaultJournalDir is where outcomes wait while the store is away,
	// relative to the working directory.
	DefaultJournalDir = "idem-journal"
)

// Defaults for [Timeouts].
const (
	DefaultReadHeaderTimeout = 10 * time.Second
	DefaultReadTimeout       = 30 * time.Second
	DefaultWriteTimeout      = 90 * time.Second
	DefaultIdleTimeout       = 60 * time.Second
	DefaultMaxHeaderBytes    = 64 << 10
)

// Timeouts bound what a client connection may hold: a client that sends its
// request slowly (slowloris), or keeps an idle connection open, is cut off.
type Timeouts struct {
	// ReadHeaderTimeout bounds the reading of a request's headers. Defaults
	// to [DefaultReadHeaderTimeout].
	ReadHeaderTimeout time.Duration `yaml:"read_header_timeout"`
	// ReadTimeout bounds the reading of a whole request, body included; a
	// body not all there by then is refused (400) before anything runs.
	// Defaults to [DefaultReadTimeout].
	ReadTimeout time.Duration `yaml:"read_timeout"`
	// WriteTimeout bounds the time from the end of a request's headers to
	// the end of its response; keep it above upstream_timeout plus wait.
	// (An answer cut off by it is still stored, and the retry replays it.)
	// Defaults to [DefaultWriteTimeout].
	WriteTimeout time.Duration `yaml:"write_timeout"`
	// IdleTimeout closes a kept-alive connection that sends no new request
	// for this long. Defaults to [DefaultIdleTimeout].
	IdleTimeout time.Duration `yaml:"idle_timeout"`
	// MaxHeaderBytes bounds the size of a request's headers. Defaults to
	// [DefaultMaxHeaderBytes].
	MaxHeaderBytes int `yaml:"max_header_bytes"`
}

// Server returns an http.Server for h with these limits.
func (t Timeouts) Server(h http.Handler, log *slog.Logger) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: cmp.Or(t.ReadHeaderTimeout, DefaultReadHeaderTimeout),
		ReadTimeout:       cmp.Or(t.ReadTimeout, DefaultReadTimeout),
		WriteTimeout:      cmp.Or(t.WriteTimeout, DefaultWriteTimeout),
		IdleTimeout:       cmp.Or(t.IdleTimeout, DefaultIdleTimeout),
		MaxHeaderBytes:    cmp.Or(t.MaxHeaderBytes, DefaultMaxHeaderBytes),
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
}

// Config is the proxy's configuration. Flags, IDEM_* environment variables
// and the YAML file all fill this one struct, made of the library's own
// configurations: the engine's and, for every route, the middleware's.
type Config struct {
	// Listen is the proxied address. Defaults to [DefaultListen].
	Listen string `yaml:"listen"`
	// Upstream is the API behind the proxy, e.g. http://127.0.0.1:9000. Required.
	Upstream string `yaml:"upstream"`
	// Store is the store DSN. Defaults to storeopen.Default (sqlite:idem.db).
	Store string `yaml:"store"`
	// AdminListen serves /healthz, /readyz, /metrics and the console
	// (/console/) on an address of its own, so they never shadow an
	// upstream path. An address without a host (":8091") is on loopback;
	// say 0.0.0.0:8091 for every interface. Defaults to off.
	AdminListen string `yaml:"admin_listen"`
	// AdminToken is the token every console action must carry. Without it
	// the console is off, unless ConsoleReadOnly.
	AdminToken string `yaml:"admin_token"`
	// ConsoleReadOnly serves the console with no action at all, token or not.
	ConsoleReadOnly bool `yaml:"console_read_only"`
	// ConsoleMask hides keys and stored bodies in the console.
	ConsoleMask bool `yaml:"console_mask"`
	// ConsoleRemote serves the console to connections from addresses other
	// than loopback (its pages need no token). Defaults to loopback only.
	ConsoleRemote bool `yaml:"console_remote"`
	// AuditLog is the file the console's actions are appended to. Defaults
	// to none: the audit log is kept in memory only.
	AuditLog string `yaml:"audit_log"`
	// UpstreamTimeout bounds each stall in sending a request to the
	// upstream (a steady upload may last longer), then the wait for its
	// response headers, then for each part of its body; past it the
	// outcome is unknown.
	// Defaults to [DefaultUpstreamTimeout].
	UpstreamTimeout time.Duration `yaml:"upstream_timeout"`
	// ShutdownTimeout is the one deadline of a graceful stop (SIGTERM or
	// SIGINT; a second signal ends the process at once): /readyz says not
	// ready at once, in-flight requests finish and store their outcome,
	// then what waits in the journal is stored, all within it. Keep it
	// above UpstreamTimeout, or a request still waiting on the upstream is
	// cut (its outcome unknown until reconciled); under Kubernetes, keep
	// terminationGracePeriodSeconds above it. Defaults to
	// [DefaultShutdownTimeout].
	ShutdownTimeout time.Duration `yaml:"shutdown_timeout"`
	// LogFormat is how log lines are written: text or json. Defaults to text.
	LogFormat string `yaml:"log_format"`
	// AccessLog logs a line for every request: method, path, status,
	// duration, what idem did with it and its key hash. A request whose
	// answer was cut (the upstream's body broke off) gets its line too, a
	// warning with cut=true and the status sent so far (0: none).
	AccessLog bool `yaml:"access_log"`
	// Engine is the engine's configuration (lease, retention, store
	// timeout, journal directory…); its Store and Notifier are the proxy's
	// to make. JournalDir defaults to [DefaultJournalDir] ("none": in
	// memory only).
	Engine idem.Config `yaml:",inline"`
	// Timeouts bound client connections.
	Timeouts `yaml:",inline"`
	// Defaults are the rules for requests that match no route, and the
	// rules every route starts from.
	Defaults Route `yaml:"defaults"`
	// Routes are matched like net/http ServeMux patterns, most specific
	// first; each route's rules start from Defaults.
	Routes []Route `yaml:"routes"`
}

// Route applies the middleware's configuration to requests matching a
// pattern.
type Route struct {
	// Match is a ServeMux pattern: "POST /v1/charges", "/v1/orders/{id}".
	Match string `yaml:"match"`
	// Bypass passes requests through with no idempotency at all.
	Bypass bool `yaml:"bypass"`
	// Config is the middleware's configuration; its Engine, Logger and
	// Observe are the proxy's to set.
	httpidem.Config `yaml:",inline"`
}

// DefaultConfig returns the configuration the proxy starts from: every
// default, taken from the constants that define it, so that a file, the
// environment and flags change only what they name.
func DefaultConfig() Config {
	return Config{
		Listen:          DefaultListen,
		Store:           storeopen.Default,
		LogFormat:       "text",
		UpstreamTimeout: DefaultUpstreamTimeout,
		ShutdownTimeout: DefaultShutdownTimeout,
		Engine: idem.Config{Lease: idem.DefaultLease, Retention: idem.DefaultRetention, Poll: idem.DefaultPoll,
			StoreTimeout: idem.DefaultStoreTimeout, JournalDir: DefaultJournalDir, PruneInterval: idem.DefaultPruneInterval},
		Timeouts: Timeouts{ReadHeaderTimeout: DefaultReadHeaderTimeout, ReadTimeout: DefaultReadTimeout,
			WriteTimeout: DefaultWriteTimeout, IdleTimeout: DefaultIdleTimeout, MaxHeaderBytes: DefaultMaxHeaderBytes},
		Defaults: Route{Config: httpidem.Config{Methods: httpidem.DefaultMethods(), ScopeHeaders: []string{DefaultScopeHeader},
			MaxRequestBody: httpidem.DefaultMaxRequestBody, MaxResponseBody: httpidem.DefaultMaxResponseBody, Wait: httpidem.DefaultWait}},
	}
}

// JournalDir is the engine's journal directory: Engine.JournalDir, with
// "none" meaning no directory.
func (cfg Config) JournalDir() string {
	if cfg.Engine.JournalDir == "none" {
		return ""
	}
	return cfg.Engine.JournalDir
}

// Hooks connect the proxy to telemetry; every field is optional.
type Hooks struct {
	// Observe is told what became of each covered request (httpidem.Config.Observe).
	Observe func(*http.Request, string)
	// Wrap wraps the whole proxied handler (a span per request, say).
	Wrap func(http.Handler) http.Handler
	// Metrics is served at /metrics on the admin listener.
	Metrics http.Handler
	// Console is served at /console/ on the admin listener; Mode says what
	// it allows (actions, read-only or off), for the start-up line.
	Console interface {
		http.Handler
		Mode() string
	}
}

// middleware makes the route's middleware.
func (r Route) middleware(eng *idem.Engine, log *slog.Logger, observe func(*http.Request, string)) (*httpidem.Middleware, error) {
	cfg := r.Config
	cfg.Engine, cfg.Logger, cfg.Observe = eng, log, observe
	if len(cfg.ScopeHeaders) == 1 && strings.EqualFold(cfg.ScopeHeaders[0], "none") {
		cfg.ScopeHeaders = nil // one scope for everybody, as asked
	}
	return httpidem.New(cfg)
}

// bypassed marks the answer to a keyed request on a bypassed route: its key
// was not honoured (see httpidem.HeaderIgnored).
func bypassed(up http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if httpidem.HasKey(r.Header) {
			w = httpidem.Ignored(w, "this route bypasses idempotency: the request ran without it")
		}
		up.ServeHTTP(w, r)
	})
}

// PinRetentions returns cfg with each route's retention written out (the
// engine's, where the route names none) and the engine's retention raised
// to the longest of them. The engine's retention is what an outcome settled
// without a route is kept for (by the console, a reconciler in the
// process): below a route's, such an outcome of that route would be
// replayed for less than the route promises, and a retry within its
// promise would run again.
func (cfg Config) PinRetentions() Config {
	keep := cmp.Or(cfg.Engine.Retention, idem.DefaultRetention)
	longest := keep
	pin := func(r *Route) {
		r.Retention = cmp.Or(r.Retention, keep)
		longest = max(longest, r.Retention)
	}
	pin(&cfg.Defaults)
	cfg.Routes = slices.Clone(cfg.Routes)
	for i := range cfg.Routes {
		pin(&cfg.Routes[i])
	}
	cfg.Engine.Retention = longest
	return cfg
}

// Waits reports whether any route lets duplicates wait for the first
// request, which is when cross-instance wake-ups are worth their cost.
func (cfg Config) Waits() bool {
	if cfg.Defaults.Wait >= 0 {
		return true
	}
	for _, r := range cfg.Routes {
		if r.Wait >= 0 && !r.Bypass {
			return true
		}
	}
	return false
}

// Logger returns a logger writing to w in cfg.LogFormat.
func (cfg Config) Logger(w io.Writer) (*slog.Logger, error) {
	switch cfg.LogFormat {
	case "", "text":
		return slog.New(slog.NewTextHandler(w, nil)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, nil)), nil
	}
	return nil, fmt.Errorf("log format %q: want text or json", cfg.LogFormat)
}

// Validate checks everything that can be checked without opening the
// store or listening: the upstream, the log format, the engine's settings
// and every route's.
func (cfg Config) Validate() error {
	if _, err := cfg.Logger(io.Discard); err != nil {
		return err
	}
	if err := cfg.checkLimits(); err != nil {
		return err
	}
	for _, a := range []struct{ name, addr string }{{"listen", cfg.Listen}, {"admin_listen", cfg.AdminListen}} {
		if a.addr == "" && a.name == "admin_listen" {
			continue // no admin listener
		}
		if _, _, err := net.SplitHostPort(a.addr); err != nil {
			return fmt.Errorf("%w: %s %q: want host:port or :port, as in 127.0.0.1:8080", idem.ErrInvalid, a.name, a.addr)
		}
	}
	engCfg := cfg.Engine
	engCfg.Store, engCfg.JournalDir = memstore.New(), ""
	eng, err := idem.New(engCfg)
	if err != nil {
		return err
	}
	defer eng.Close(context.Background())
	_, err = Handler(cfg, eng, slog.New(slog.DiscardHandler), Hooks{})
	return err
}

// MaxHeaderBytesLimit is the largest max_header_bytes accepted: net/http
// adds 4 KiB to it, and a value near the largest int wrapped round and
// refused every request.
const MaxHeaderBytesLimit = 1 << 30

// checkLimits refuses a negative timeout or size, naming the setting: each
// would mean something other than what it says (a negative upstream timeout
// cuts every response at once, so each request's outcome becomes unknown;
// the server's mean no limit at all). 0 means the default. (The engine's
// durations are checked, and named, by idem.New; a route's limits with the
// route.)
func (cfg Config) checkLimits() error {
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"upstream_timeout", cfg.UpstreamTimeout}, {"shutdown_timeout", cfg.ShutdownTimeout},
		{"read_header_timeout", cfg.ReadHeaderTimeout}, {"read_timeout", cfg.ReadTimeout},
		{"write_timeout", cfg.WriteTimeout}, {"idle_timeout", cfg.IdleTimeout}} {
		if d.v < 0 {
			return fmt.Errorf("%s %v: want a positive duration (0 for the default)", d.name, d.v)
		}
	}
	for _, s := range []struct {
		name string
		v    int64
	}{{"max_header_bytes", int64(cfg.MaxHeaderBytes)}, {"max_request_body", cfg.Defaults.MaxRequestBody},
		{"max_response_body", cfg.Defaults.MaxResponseBody}} {
		if s.v < 0 {
			return fmt.Errorf("%s %d: want a positive size (0 for the default)", s.name, s.v)
		}
	}
	if cfg.MaxHeaderBytes > MaxHeaderBytesLimit {
		return fmt.Errorf("max_header_bytes %d: want at most %d (1 GiB)", cfg.MaxHeaderBytes, MaxHeaderBytesLimit)
	}
	return nil
}

func (cfg Config) upstreamURL() (*url.URL, error) {
	if cfg.Upstream == "" {
		return nil, errors.New("no upstream: set --upstream, IDEM_UPSTREAM or upstream: in the config file")
	}
	target, err := url.Parse(cfg.Upstream)
	if err != nil || (target.Scheme != "http" && target.Scheme != "https") || target.Host == "" {
		return nil, fmt.Errorf("upstream %s: want an http:// or https:// URL", redact.URL(cfg.Upstream))
	}
	if target.User != nil {
		// It would be dropped: requests go upstream with their own
		// credentials, never the proxy's.
		return nil, fmt.Errorf("upstream %s: want a URL without user information (user@ or user:password@): the proxy does not send it", redact.URL(cfg.Upstream))
	}
	if redact.HiddenUserInfo(cfg.Upstream) {
		// A password with an unencoded / at its start: url.Parse reads
		// "user:" as the host and port, and the rest as the path.
		return nil, fmt.Errorf("upstream %s: want a URL without user information (user@ or user:password@), and it reads as one whose password has an unencoded / ? or # (an @ after a host with a port, which is part of the path, is written %%40)", redact.URL(cfg.Upstream))
	}
	return target, nil
}

// Handler builds the proxying handler: routes, middleware and upstream.
func Handler(cfg Config, eng *idem.Engine, log *slog.Logger, hooks Hooks) (http.Handler, error) {
	target, err := cfg.upstreamURL()
	if err != nil {
		return nil, err
	}
	up := upstream(target, cmp.Or(cfg.UpstreamTimeout, DefaultUpstreamTimeout), log)
	observe := hooks.Observe
	if cfg.AccessLog {
		observe = func(r *http.Request, observed string) {
			if e, ok := r.Context().Value(accessKey{}).(*accessEntry); ok {
				e.observed, e.keyHash = observed, httpidem.KeyHashOf(r)
			}
			if hooks.Observe != nil {
				hooks.Observe(r, observed)
			}
		}
	}
	mux := http.NewServeMux()
	hasRoot := false
	var root http.Handler // the route of "/": the defaults, unless a route is "/"
	add := func(pattern string, rules Route) (err error) {
		defer func() { // ServeMux panics on a bad or conflicting pattern
			if p := recover(); p != nil {
				err = fmt.Errorf("route %q: %v", pattern, p)
			}
		}()
		var h http.Handler = bypassed(up)
		if !rules.Bypass {
			mw, err := rules.middleware(eng, log, observe)
			if err != nil {
				return fmt.Errorf("route %q: %w", pattern, err)
			}
			h = mw.Wrap(keptWhole(up))
		}
		r := &route{h}
		mux.Handle(pattern, r)
		if pattern == "/" {
			root = r
		}
		return nil
	}
	for _, rt := range cfg.Routes {
		if rt.Match == "" {
			return nil, errors.New("a route has no match pattern")
		}
		hasRoot = hasRoot || rt.Match == "/"
		if err := add(rt.Match, rt); err != nil {
			return nil, err
		}
	}
	if !hasRoot {
		if err := add("/", cfg.Defaults); err != nil {
			return nil, err
		}
	}
	var h http.Handler = routes(mux, root)
	if cfg.AccessLog {
		h = accessLog(h, log)
	}
	if hooks.Wrap != nil {
		h = hooks.Wrap(h)
	}
	return h, nil
}

// route is the handler of a route in the mux, told apart from what the mux
// makes by itself (a redirect, a 404 or a 405).
type route struct{ http.Handler }

// badPath answers a request whose path reads as different routes.
var badPath = &httpidem.Problem{Type: "about:blank", Title: "Bad Request", Status: http.StatusBadRequest,
	Detail: "the path reads as different routes depending on how it is cleaned or decoded (. or .. segments, %2F, %2E): send it in its plain form"}

// routes serves each request with the handler of its route in mux, and
// passes the request on unchanged: the mux never answers by itself. (Served
// by a ServeMux, a path that is not clean, with // or dot segments, was
// answered with a redirect to the cleaned path, and /tree, when the route is
// /tree/, with a redirect to /tree/: a POST the API serves never reached
// it.)
//
// The route is chosen on the cleaned path, as the mux would after its
// redirect; the request goes upstream with the path as sent. /tree takes
// the route of /tree/, where the mux would have sent it. A path that reads
// as different routes by how it is cleaned or decoded (/v1/charges/../webhooks/
// is /v1/webhooks/ cleaned, and within /v1/charges/ to an API that does not
// clean it; /v1%2Fcharges is one segment to the mux, /v1/charges decoded)
// is refused with 400 rather than served under one of them, so that no
// spelling of a path takes a request out of its route's protection.
func routes(mux *http.ServeMux, root http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodConnect { // not cleaned by the mux either
			h, _ := mux.Handler(r)
			if _, ok := h.(*route); !ok {
				h = root
			}
			h.ServeHTTP(w, r)
			return
		}
		escaped := r.URL.EscapedPath()
		var h http.Handler
		for i, p := range readings(escaped, r.URL.Path) {
			got := routeOf(mux, r, p, root)
			if i == 0 {
				h = got
			} else if got != h {
				badPath.Write(w)
				return
			}
		}
		h.ServeHTTP(w, r)
	})
}

// readings are the paths a request's path may be read as, escaped: as the
// mux reads it (segments split on the escaped path), and decoded (%2F a
// separator); each cleaned, as the mux and most servers do, and with its
// dot segments taken literally, as a server that does not clean reads it.
// A plain path has one reading.
func readings(escaped, decoded string) []string {
	if escaped == decoded && cleanPath(escaped) == escaped && !strings.Contains(escaped, "%") {
		return []string{escaped}
	}
	enc := (&url.URL{Path: decoded}).EscapedPath() // %2F made a separator
	return []string{cleanPath(escaped), cleanPath(literalDots(escaped)), cleanPath(enc), cleanPath(literalDots(enc))}
}

// literalDots escapes the dot segments of an escaped path (. and ..), so
// that cleaning leaves them where they are.
func literalDots(p string) string {
	segs := strings.Split(p, "/")
	for i, s := range segs {
		switch s {
		case ".":
			segs[i] = "%2E"
		case "..":
			segs[i] = "%2E%2E"
		}
	}
	return strings.Join(segs, "/")
}

// cleanPath is the path the mux matches: p with a leading /, cleaned, its
// trailing / kept (net/http's cleanPath).
func cleanPath(p string) string {
	if p == "" {
		return "/"
	}
	if p[0] != '/' {
		p = "/" + p
	}
	np := path.Clean(p)
	if p[len(p)-1] == '/' && np != "/" {
		np += "/"
	}
	return np
}

// routeOf is the route of r with its path read as p (escaped and clean):
// the handler the mux has for it, that of p/ where the mux would redirect
// to it, or root.
func routeOf(mux *http.ServeMux, r *http.Request, p string, root http.Handler) http.Handler {
	for _, p := range []string{p, p + "/"} {
		u := *r.URL
		u.RawPath = p
		dec, err := url.PathUnescape(p)
		if err != nil {
			return root
		}
		u.Path = dec
		c := *r // shallow: the mux reads the method, the host and the URL
		c.URL = &u
		h, pattern := mux.Handler(&c)
		if rt, ok := h.(*route); ok {
			return rt
		}
		if pattern == "" || strings.HasSuffix(p, "/") {
			break // not found or not allowed: no route of its own
		}
	}
	return root
}

type accessKey struct{}

// accessEntry is what the access log learns of a request from the
// middleware.
type accessEntry struct{ observed, keyHash string }

// accessLog logs a line for every request once it is answered, or once
// its answer is cut: the handler aborted (the reverse proxy panics with
// http.ErrAbortHandler when the upstream's body breaks off), and the line
// says "cut", with the status sent so far (0: none). The panic goes on
// unrecovered, its stack whole, to net/http.
func accessLog(next http.Handler, log *slog.Logger) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		e := &accessEntry{}
		rec := &recorder{ResponseWriter: w}
		cut := true
		defer func() {
			status := rec.status
			if !cut {
				status = cmp.Or(status, http.StatusOK)
			}
			attrs := []any{"method", r.Method, "path", r.URL.Path, "status", status,
				"bytes", rec.bytes, "duration", time.Since(start), "remote", r.RemoteAddr}
			if cut {
				attrs = append(attrs, "cut", true)
			}
			if e.observed != "" {
				attrs = append(attrs, "idem", e.observed)
			}
			if e.keyHash != "" {
				attrs = append(attrs, "key_hash", e.keyHash)
			}
			if cut {
				log.Warn("request", attrs...)
			} else {
				log.Info("request", attrs...)
			}
		}()
		next.ServeHTTP(rec, r.WithContext(context.WithValue(r.Context(), accessKey{}, e)))
		cut = false
	})
}

// recorder notes the status and size of a response; Unwrap lets
// http.ResponseController reach the writer's Flush and deadlines.
type recorder struct {
	http.ResponseWriter
	status int
	bytes  int64
}

func (r *recorder) WriteHeader(status int) {
	if r.status == 0 && (status >= 200 || status == http.StatusSwitchingProtocols) { // not a 1xx before the answer
		r.status = status
	}
	r.ResponseWriter.WriteHeader(status)
}

func (r *recorder) Write(b []byte) (int, error) {
	if r.status == 0 {
		r.status = http.StatusOK
	}
	n, err := r.ResponseWriter.Write(b)
	r.bytes += int64(n)
	return n, err
}

func (r *recorder) Unwrap() http.ResponseWriter { return r.ResponseWriter }

// attempt is what the reverse proxy knows of one request to the upstream,
// in its context under attemptKey.
type attempt struct {
	sent     atomic.Bool // its headers were written: the upstream may have acted
	timedOut atomic.Bool // sending it stalled for the timeout
	answered atomic.Bool // its response has come: sending it is no longer bounded here
	// cancel ends it; its response's body calls it when the upstream stops
	// sending the body (see stallingBody).
	cancel context.CancelFunc
	// sending fires when sending the request has stalled for the timeout:
	// its headers not written, or no part of its body taken (see
	// sendingBody).
	sending *time.Timer
}

// sendingBody is a request's body on its way to the upstream: each part
// the transport takes restarts the attempt's timer, and the time it waits
// for the client's bytes does not count, so the timer fires only when the
// upstream stops taking the body (a frozen process whose kernel accepted
// the connection), not on a long, steady upload.
type sendingBody struct {
	io.ReadCloser
	a       *attempt
	timeout time.Duration
}

func (b *sendingBody) Read(p []byte) (int, error) {
	b.a.sending.Stop()
	n, err := b.ReadCloser.Read(p)
	if !b.a.answered.Load() {
		b.a.sending.Reset(b.timeout)
	}
	return n, err
}

type attemptKey struct{}

// stallingBody is an upstream response's body that gives up, cancelling
// its request, when no byte of it comes for timeout: an upstream that
// stalls mid-body would otherwise hold the key in progress for as long as
// it keeps the connection open. (The transport bounds only the wait for
// the headers.)
type stallingBody struct {
	io.ReadCloser
	timeout time.Duration
	timer   *time.Timer
}

func (b *stallingBody) Read(p []byte) (int, error) {
	b.timer.Reset(b.timeout)
	n, err := b.ReadCloser.Read(p)
	b.timer.Stop()
	return n, err
}

func (b *stallingBody) Close() error {
	b.timer.Stop()
	return b.ReadCloser.Close()
}

// streamsOnly passes a flush through only for a stream (text/event-stream):
// the reverse proxy flushes every response of unknown length as it comes,
// which would make it a stream, neither kept nor replayed; any other
// response is kept whole (up to the size limit), then sent.
type streamsOnly struct{ http.ResponseWriter }

// FlushError flushes a stream, whatever the case of its media type (RFC
// 9110, 8.3.1) or its parameters, as the reverse proxy itself tells one.
func (w streamsOnly) FlushError() error {
	if mt, _, _ := mime.ParseMediaType(w.Header().Get("Content-Type")); mt != "text/event-stream" {
		return nil
	}
	return http.NewResponseController(w.ResponseWriter).Flush()
}

func (w streamsOnly) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// keptWhole is up, for the middleware: a response is kept whole unless it
// is a stream (see streamsOnly).
func keptWhole(up http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { up.ServeHTTP(streamsOnly{w}, r) })
}

// upstream is a reverse proxy that tells the middleware whether a failed
// request reached the upstream at all.
func upstream(target *url.URL, timeout time.Duration, log *slog.Logger) http.Handler {
	transport := http.DefaultTransport.(*http.Transport).Clone()
	transport.ResponseHeaderTimeout = timeout
	transport.MaxIdleConnsPerHost = 256
	// HTTP/1.1 only: its transport's resend rules are the ones neverResent
	// defeats (HTTP/2's transport resends a bodyless request on a stream
	// error of its own).
	transport.Protocols = new(http.Protocols)
	transport.Protocols.SetHTTP1(true)
	return &httputil.ReverseProxy{
		Transport:  transport,
		BufferPool: buffers,
		// Its own lines (an upstream's body cut off mid-copy) go through
		// the proxy's logger, in its format, not the standard log package.
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn),
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			// What the load balancer in front said of the original request
			// reaches the API as without the sidecar (Rewrite drops it):
			// X-Forwarded-For with the sidecar's peer appended, as a
			// ReverseProxy with a Director does; the client's scheme and
			// host, and Forwarded, as they came.
			pr.Out.Header["X-Forwarded-For"] = pr.In.Header["X-Forwarded-For"]
			pr.SetXForwarded()
			for _, name := range []string{"X-Forwarded-Host", "X-Forwarded-Proto", "Forwarded"} {
				if v, ok := pr.In.Header[name]; ok {
					pr.Out.Header[name] = v
				}
			}
			pr.Out.Host = pr.In.Host
			neverResent(pr.Out)
			a := new(attempt)
			ctx, cancel := context.WithCancel(pr.Out.Context()) // ended with the request's, by stallingBody, or by a stalled send
			a.cancel = cancel
			// Sending the request is bounded as waiting for its answer is
			// (the transport's timeout starts once the body is written): an
			// upstream that does not take it would hold it, and its key, for
			// as long as the connection stays open.
			a.sending = time.AfterFunc(timeout, func() {
				if !a.answered.Load() {
					a.timedOut.Store(true)
					cancel()
				}
			})
			if pr.Out.Body != nil && pr.Out.Body != http.NoBody {
				pr.Out.Body = &sendingBody{ReadCloser: pr.Out.Body, a: a, timeout: timeout}
			}
			ctx = context.WithValue(ctx, attemptKey{}, a)
			ctx = httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
				WroteHeaders: func() { a.sent.Store(true) },
				WroteRequest: func(httptrace.WroteRequestInfo) { a.sending.Stop() },
			})
			pr.Out = pr.Out.WithContext(ctx)
		},
		ModifyResponse: func(res *http.Response) error {
			a, ok := res.Request.Context().Value(attemptKey{}).(*attempt)
			if ok {
				a.answered.Store(true)
				a.sending.Stop()
			}
			if res.StatusCode == http.StatusSwitchingProtocols {
				return nil // a tunnel (a WebSocket): its body is the connection, idle as long as it likes
			}
			if ok {
				res.Body = &stallingBody{ReadCloser: res.Body, timeout: timeout, timer: time.AfterFunc(timeout, a.cancel)}
			}
			return nil
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			a, _ := r.Context().Value(attemptKey{}).(*attempt)
			if a != nil {
				a.sending.Stop() // the attempt is over (the answer's way, ModifyResponse, stops it too)
			}
			status := http.StatusBadGateway
			if errors.Is(err, context.DeadlineExceeded) || isTimeout(err) || (a != nil && a.timedOut.Load()) {
				status = http.StatusGatewayTimeout
			}
			log := log.With("method", r.Method, "path", r.URL.Path)
			hash := httpidem.KeyHashOf(r)
			if hash != "" {
				log = log.With("key_hash", hash)
			}
			problem := &httpidem.Problem{Type: httpidem.ProblemUpstreamFailed, Title: "Upstream failed", Status: status,
				Detail: "the upstream did not answer"}
			// Covered: run under a lease. A keyed request run by fail-open
			// has a key hash but no lease, and no record to say what
			// became of it.
			_, covered := httpidem.LeaseFrom(r.Context())
			switch {
			case a != nil && a.sent.Load() && covered:
				httpidem.OutcomeUnknown(r)
				problem.Detail = "the upstream took the request and did not answer: its outcome is unknown until reconciled, and a retry with the same key says so"
				log.Warn("upstream took the request but gave no response: outcome unknown until reconciled", "err", err)
			case a != nil && a.sent.Load():
				if !safeMethod(r.Method) { // no key covered it: nothing makes a retry safe
					problem = &httpidem.Problem{Type: httpidem.ProblemUpstreamUncertain, Title: "Upstream outcome unknown", Status: status,
						Detail: "the upstream took the request and did not answer: it may have run, and idempotency did not cover it, so a retry would run it again"}
				}
				log.Warn("upstream took a request idempotency did not cover and gave no response: it may have run", "err", err)
			case covered:
				httpidem.NothingHappened(r)
				problem.Detail = "the upstream could not be reached: the request was not sent, and a retry with the same key runs it"
				log.Warn("upstream unreachable: request not sent, key released for its retry", "err", err)
			default:
				log.Warn("upstream unreachable: request not sent", "err", err)
			}
			problem.Write(w)
		},
	}
}

// safeMethod reports whether a request of method changes nothing on the
// server (RFC 9110, 9.2.1): one is sent again whatever became of it.
func safeMethod(method string) bool {
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	return false
}

// buffers are the reverse proxy's copy buffers, reused across requests.
var buffers = &bufferPool{sync.Pool{New: func() any { return new([32 << 10]byte) }}}

type bufferPool struct{ p sync.Pool }

func (b *bufferPool) Get() []byte  { return b.p.Get().(*[32 << 10]byte)[:] }
func (b *bufferPool) Put(x []byte) { b.p.Put((*[32 << 10]byte)(x[:32<<10])) }

// neverResent makes sure net/http's transport never sends out a second
// time by itself. It resends a request whose reused connection broke before
// the answer came, when it takes the request to be replayable: a safe method
// or an Idempotency-Key (or X-Idempotency-Key) header, without a body or
// with GetBody. The upstream may well have run it, and the second run would
// go unseen by the middleware: a double execution. So the key headers travel
// under a lower-case name (the same field on the wire: HTTP field names are
// case-insensitive, but the transport's check is not), and a bodyless
// request gets an empty body that is not http.NoBody (the transport probes
// it for GET, HEAD, DELETE and OPTIONS and sends no body at all).
func neverResent(out *http.Request) {
	for _, name := range []string{httpidem.HeaderKey, httpidem.HeaderXKey} {
		if v, ok := out.Header[name]; ok {
			delete(out.Header, name)
			out.Header[strings.ToLower(name)] = v
		}
	}
	switch out.Method {
	case "", http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		if out.Body == nil || out.Body == http.NoBody {
			out.Body, out.ContentLength, out.GetBody = emptyBody{}, 0, nil
		}
	}
}

// emptyBody is a request body with nothing in it that the transport does not
// recognise as none.
type emptyBody struct{}

func (emptyBody) Read([]byte) (int, error) { return 0, io.EOF }
func (emptyBody) Close() error             { return nil }

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// Admin serves /healthz (the process is up), /readyz (the store answers
// and the process is not shutting down, and what health knows of the store) and, when they are not nil, /metrics and the
// console under /console/.
func Admin(health *Health, metrics, console http.Handler) http.Handler {
	mux := http.NewServeMux()
	if metrics != nil {
		mux.Handle("GET /metrics", metrics)
	}
	if console != nil {
		mux.Handle("/console/", console)
		mux.Handle("GET /console", http.RedirectHandler("/console/", http.StatusMovedPermanently))
	}
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		var st HealthStatus
		if health.Stopping() {
			st = health.Status() // at once: no store call while shutting down
		} else {
			ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
			st = health.Check(ctx)
			cancel()
		}
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		if !st.Ready() {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		io.WriteString(w, st.String())
	})
	return mux
}

// LoopbackByDefault puts an address without a host (":8091") on loopback,
// where an admin listener belongs unless asked otherwise.
func LoopbackByDefault(addr string) string {
	if host, port, err := net.SplitHostPort(addr); err == nil && host == "" {
		return net.JoinHostPort("127.0.0.1", port)
	}
	return addr
}

// Stop is a graceful shutdown's one deadline: it starts when the shutdown
// begins (the first signal), and each step of the shutdown gets what the
// steps before it left of it: the servers' drain of the requests in flight,
// then the engine's close (the requests still running settle, the journal
// lands). The zero value lasts [DefaultShutdownTimeout].
type Stop struct {
	// Timeout is how long the whole shutdown may take. Defaults to
	// [DefaultShutdownTimeout].
	Timeout time.Duration

	once   sync.Once
	ctx    context.Context
	cancel context.CancelFunc
}

// Begin starts the deadline, the first time it is called, and returns a
// context that ends at it.
func (s *Stop) Begin() context.Context {
	s.once.Do(func() {
		s.ctx, s.cancel = context.WithTimeout(context.Background(), cmp.Or(s.Timeout, DefaultShutdownTimeout))
	})
	return s.ctx
}

// Release releases the deadline's timer, once the shutdown is over.
func (s *Stop) Release() {
	s.Begin()
	s.cancel()
}

// ErrCutShort is what a shutdown returns when its deadline came with
// connections still open, which it then closed: a request still running,
// or a stream. Whether an outcome was at stake is the engine's to say
// ([idem.Engine.Close] counts the requests still running).
var ErrCutShort = errors.New("the shutdown timeout ran out with connections still open: they were closed")

// Failure returns err without [ErrCutShort]: what went wrong, besides a
// shutdown whose deadline closed connections still open.
func Failure(err error) error {
	if err == ErrCutShort {
		return nil
	}
	if joined, ok := err.(interface{ Unwrap() []error }); ok {
		var rest []error
		for _, e := range joined.Unwrap() {
			if f := Failure(e); f != nil {
				rest = append(rest, f)
			}
		}
		return errors.Join(rest...)
	}
	return err
}

// The order in which [Servers] stop: a tier stops accepting only once the
// tiers before it have drained.
const (
	tierFront   = iota // what clients call: the proxied API, the demo's API
	tierBackend        // what the front calls (the demo's simulated acquirer)
	tierAdmin          // probes, metrics and the console: last, so probes see the unready state throughout
	tiers
)

// Servers runs HTTP servers with the same limits, and shuts them down in
// order: `idem proxy` and `idem demo` serve through it. The zero value uses
// the default Timeouts and slog.Default().
type Servers struct {
	Timeouts Timeouts
	Log      *slog.Logger
	// OnStop, when set, is called once as the shutdown begins, before any
	// server stops accepting: it makes /readyz say not ready
	// ([Health.SetStopping]).
	OnStop func()

	servers  [tiers][]*http.Server
	errs     chan error
	stopped  sync.Once
	shutdown error // what the shutdown met
}

// Listen serves h on addr in the background and returns the address it
// listens on (addr may have port 0). The servers it starts are the ones
// clients call: at shutdown they stop accepting together, first, and drain.
func (s *Servers) Listen(addr string, h http.Handler) (string, error) {
	return s.listen(tierFront, addr, h)
}

// ListenBackend is [Servers.Listen] for a server the front ones call (the
// demo's simulated acquirer): it keeps serving until they have drained.
func (s *Servers) ListenBackend(addr string, h http.Handler) (string, error) {
	return s.listen(tierBackend, addr, h)
}

// ListenAdmin is [Servers.Listen] for the admin listener (/healthz,
// /readyz, /metrics, the console): it stops last, so that probes see the
// process unready while the others drain.
func (s *Servers) ListenAdmin(addr string, h http.Handler) (string, error) {
	return s.listen(tierAdmin, addr, h)
}

func (s *Servers) listen(tier int, addr string, h http.Handler) (string, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return "", err
	}
	if s.errs == nil {
		s.errs = make(chan error, 8)
	}
	srv := s.Timeouts.Server(h, cmp.Or(s.Log, slog.Default()))
	s.servers[tier] = append(s.servers[tier], srv)
	go func() {
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			s.errs <- err
		}
	}()
	return ln.Addr().String(), nil
}

// Run waits until ctx ends or a server fails, then begins stop and shuts
// every server down within it, letting requests in flight finish (their
// outcomes are stored); it returns the failure, or what the shutdown met
// ([ErrCutShort] when its deadline came first).
func (s *Servers) Run(ctx context.Context, stop *Stop) error {
	var failed error
	select {
	case failed = <-s.errs:
	case <-ctx.Done():
	}
	return errors.Join(failed, s.Shutdown(stop.Begin()))
}

// Shutdown calls OnStop, then shuts the servers down tier by tier (see
// [Servers.Listen]): the servers of a tier stop accepting together, and
// their requests in flight finish, until ctx ends. It returns [ErrCutShort]
// (and logs it) when ctx ended with connections still open. Only the first
// call shuts down; later ones return what it met.
func (s *Servers) Shutdown(ctx context.Context) error {
	s.stopped.Do(func() {
		if s.OnStop != nil {
			s.OnStop()
		}
		s.shutdown = s.shutTiers(ctx)
	})
	return s.shutdown
}

// shutTiers is Shutdown's work, done once.
func (s *Servers) shutTiers(ctx context.Context) error {
	var (
		mu   sync.Mutex
		errs []error
		cut  bool // once, whichever servers it cut
	)
	for _, tier := range s.servers {
		var wg sync.WaitGroup
		for _, srv := range tier {
			wg.Go(func() {
				err := srv.Shutdown(ctx)
				mu.Lock()
				defer mu.Unlock()
				switch {
				case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled):
					cut = true
				case err != nil:
					errs = append(errs, err)
				}
			})
		}
		wg.Wait()
	}
	if cut {
		cmp.Or(s.Log, slog.Default()).Warn(ErrCutShort.Error())
		errs = append(errs, ErrCutShort)
	}
	return errors.Join(errs...)
}

// Serve runs the proxy (and the admin listener, when configured) until ctx
// is cancelled, then shuts down gracefully within stop (nil: a deadline of
// cfg.ShutdownTimeout of its own): /readyz says not ready at once, the
// proxied listener stops accepting and its in-flight requests finish and
// store their outcome, then the admin listener stops. It returns
// [ErrCutShort] when the deadline came first. ready, when not nil, receives
// the proxied address once listening. The engine is the caller's to close,
// within what is left of stop.
func Serve(ctx context.Context, stop *Stop, cfg Config, eng *idem.Engine, health *Health, log *slog.Logger, hooks Hooks, ready func(addr, admin string)) error {
	h, err := Handler(cfg, eng, log, hooks)
	if err != nil {
		return err
	}
	if stop == nil {
		stop = &Stop{Timeout: cfg.ShutdownTimeout}
		defer stop.Release()
	}
	servers := &Servers{Timeouts: cfg.Timeouts, Log: log}
	addr, err := servers.Listen(cmp.Or(cfg.Listen, DefaultListen), h)
	if err != nil {
		return fmt.Errorf("listen (--listen, $IDEM_LISTEN): %w", err)
	}
	adminAddr := ""
	if cfg.AdminListen != "" {
		if adminAddr, err = servers.ListenAdmin(LoopbackByDefault(cfg.AdminListen), Admin(health, hooks.Metrics, hooks.Console)); err != nil {
			done, cancel := context.WithCancel(context.Background())
			cancel()
			servers.Shutdown(done)
			return fmt.Errorf("admin_listen (--admin-listen, $IDEM_ADMIN_LISTEN): %w", err)
		}
	}
	attrs := []any{"addr", addr, "upstream", redact.URL(cfg.Upstream)}
	if health != nil {
		attrs = append(attrs, "store", health.Status().Store)
	}
	if adminAddr != "" {
		attrs = append(attrs, "admin", adminAddr)
		if hooks.Console != nil {
			attrs = append(attrs, "console", hooks.Console.Mode())
		}
	}
	log.Info("idem proxy listening", attrs...)
	if ready != nil {
		ready(addr, adminAddr)
	}
	// One deadline from the stop: /readyz says not ready at once (OnStop,
	// before a word is said of it), the proxied listener stops accepting and
	// its requests in flight finish, the admin listener goes last; what is
	// left is the caller's, to close the engine.
	servers.OnStop = func() {
		health.SetStopping()
		log.Info("shutting down: /readyz says not ready, in-flight requests finish", "within", cmp.Or(stop.Timeout, DefaultShutdownTimeout))
	}
	return servers.Run(ctx, stop)
}
