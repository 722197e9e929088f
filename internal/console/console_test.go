package console_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"html"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/internal/console"
	"github.com/idemhq/idem/internal/telemetry"
	"github.com/idemhq/idem/reconcile"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/store/storetest"
)

const token = "s3cret-token"

var quiet = slog.New(slog.DiscardHandler)

// client bounds every request a test makes: a test fails, it never hangs.
var client = &http.Client{Timeout: 10 * time.Second}

// world is a console on an engine with a clock of its own.
type world struct {
	eng   *idem.Engine
	clock *storetest.Clock
	srv   *httptest.Server
	audit string
}

func newWorld(t *testing.T, cfg console.Config) *world {
	t.Helper()
	clock := storetest.NewClock(time.Now().UTC().Truncate(time.Second))
	eng, err := idem.New(idem.Config{Store: memstore.New(), Clock: clock, Lease: 30 * time.Second, CacheSize: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close(context.Background()) })
	w := &world{eng: eng, clock: clock, audit: filepath.Join(t.TempDir(), "audit.log")}
	if cfg.Audit == nil {
		if cfg.Audit, err = console.OpenAudit(w.audit, true); err != nil {
			t.Fatal(err)
		}
	}
	cfg.Engine, cfg.Logger = eng, quiet
	c, err := console.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	w.srv = httptest.NewServer(c)
	t.Cleanup(w.srv.Close)
	return w
}

// unknown makes an UNKNOWN record of key.
func (w *world) unknown(t *testing.T, key string) idem.Record {
	t.Helper()
	ctx := context.Background()
	out, err := w.eng.Begin(ctx, idem.BeginParams{Key: key, Fingerprint: idem.NewFingerprint(idem.Payload{Method: "POST", Path: "/charges", Body: []byte(key)})})
	if err != nil || out.Decision != idem.Execute {
		t.Fatalf("Begin(%s) = %v, %v", key, out.Decision, err)
	}
	if err := w.eng.MarkUnknown(ctx, out.Lease); err != nil {
		t.Fatal(err)
	}
	w.clock.Advance(reconcile.DefaultGrace) // its owner's grace has passed: an operator may resolve it
	return w.get(t, key)
}

// completed makes a COMPLETED record of key with body.
func (w *world) completed(t *testing.T, key, body string) {
	t.Helper()
	ctx := context.Background()
	out, err := w.eng.Begin(ctx, idem.BeginParams{Key: key, Fingerprint: idem.NewFingerprint(idem.Payload{Method: "POST", Path: "/charges"})})
	if err != nil || out.Decision != idem.Execute {
		t.Fatalf("Begin(%s) = %v, %v", key, out.Decision, err)
	}
	resp := &idem.Response{Status: 201, Header: http.Header{"Content-Type": {"text/html"}}, Body: []byte(body)}
	if err := w.eng.Complete(ctx, out.Lease, resp); err != nil {
		t.Fatal(err)
	}
}

func (w *world) get(t *testing.T, key string) idem.Record {
	t.Helper()
	r, err := w.eng.Get(context.Background(), "", key)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// page GETs path and returns the status and the body.
func (w *world) page(t *testing.T, path string) (int, string) {
	t.Helper()
	res, err := client.Get(w.srv.URL + path)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(b)
}

// post sends a form as the console's own page does, and returns the status
// and the body (redirects not followed).
func (w *world) post(t *testing.T, path string, form url.Values, header http.Header) (int, string) {
	t.Helper()
	req, _ := http.NewRequest("POST", w.srv.URL+path, strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", w.srv.URL)
	req.Header.Set("Sec-Fetch-Site", "same-origin")
	for k, v := range header {
		req.Header[k] = v
	}
	noRedirect := &http.Client{Timeout: client.Timeout, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	res, err := noRedirect.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(b)
}

func resolveForm(r idem.Record, action string) url.Values {
	return url.Values{"action": {action}, "scope": {r.Scope}, "key": {r.Key}, "fence": {strconv.FormatInt(r.Fence, 10)},
		"state": {string(r.State)}, "status": {"201"}, "headers": {"Content-Type: application/json"}, "body": {`{"id":"ch_1"}`},
		"who": {"ana"}, "token": {token}}
}

func TestOffWithoutTokenUnlessReadOnly(t *testing.T) {
	w := newWorld(t, console.Config{})
	if code, body := w.page(t, "/console/"); code != http.StatusForbidden || !strings.Contains(body, "console is off") {
		t.Errorf("no token: GET /console/ = %d, want 403 saying the console is off:\n%s", code, body)
	}
	w.completed(t, "k1", "hello")
	ro := newWorld(t, console.Config{ReadOnly: true})
	ro.completed(t, "k1", "hello")
	if code, body := ro.page(t, "/console/records"); code != http.StatusOK || !strings.Contains(body, "k1") {
		t.Errorf("read-only: GET /console/records = %d, want 200 listing k1:\n%s", code, body)
	}
	ro.unknown(t, "u1")
	form := resolveForm(ro.get(t, "u1"), "resolve_failed")
	if code, _ := ro.post(t, "/console/act", form, nil); code != http.StatusForbidden {
		t.Errorf("read-only: an action = %d, want 403", code)
	}
	if got := ro.get(t, "u1").State; got != idem.StateUnknown {
		t.Errorf("read-only: the record is %s after a refused action, want unknown", got)
	}
}

// TestStoredScriptIsText: a stored body is shown as text, and the page's
// policy lets no inline script run even if it were not.
func TestStoredScriptIsText(t *testing.T) {
	w := newWorld(t, console.Config{Token: token})
	w.completed(t, "xss", `<script>document.title="owned"</script><img src=x onerror=alert(1)>`)
	res, err := client.Get(w.srv.URL + "/console/record?key=xss")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	body := string(b)
	if strings.Contains(body, "<script>document") || strings.Contains(body, "<img src=x") {
		t.Errorf("the stored body is in the page as HTML:\n%s", body)
	}
	if !strings.Contains(body, "&lt;script&gt;document.title=&#34;owned&#34;&lt;/script&gt;") {
		t.Errorf("the stored body is not shown as text:\n%s", body)
	}
	if csp := res.Header.Get("Content-Security-Policy"); !strings.Contains(csp, "script-src 'self'") || strings.Contains(csp, "unsafe-inline") {
		t.Errorf("Content-Security-Policy = %q, want scripts from the console only", csp)
	}
}

func TestActionsNeedTheToken(t *testing.T) {
	w := newWorld(t, console.Config{Token: token})
	rec := w.unknown(t, "u1")
	for name, tok := range map[string]string{"missing": "", "wrong": "s3cret-tokem"} {
		form := resolveForm(rec, "resolve_completed")
		form.Set("token", tok)
		if code, body := w.post(t, "/console/act", form, nil); code != http.StatusForbidden || !strings.Contains(body, "Nothing was changed") {
			t.Errorf("%s token: %d, want 403 saying nothing changed:\n%s", name, code, body)
		}
	}
	if got := w.get(t, "u1"); got.State != idem.StateUnknown {
		t.Fatalf("after refused actions the record is %s, want unknown", got.State)
	}
	// A request another site makes the browser send is refused, token or not.
	if code, _ := w.post(t, "/console/act", resolveForm(rec, "resolve_failed"), http.Header{"Sec-Fetch-Site": {"cross-site"}}); code != http.StatusForbidden {
		t.Errorf("a cross-site action = %d, want 403", code)
	}
	if code, _ := w.post(t, "/console/act", resolveForm(rec, "resolve_failed"), http.Header{"Origin": {"http://evil.example"}, "Sec-Fetch-Site": {""}}); code != http.StatusForbidden {
		t.Errorf("an action from another origin = %d, want 403", code)
	}
	// Nothing changes on GET.
	if code, _ := w.page(t, "/console/act?"+resolveForm(rec, "resolve_failed").Encode()); code != http.StatusMethodNotAllowed {
		t.Errorf("GET /console/act = %d, want 405", code)
	}
	if got := w.get(t, "u1"); got.State != idem.StateUnknown {
		t.Fatalf("after refused actions the record is %s, want unknown", got.State)
	}
	if entries := w.entries(t); len(entries) != 0 {
		t.Errorf("refused actions were audited as done: %+v", entries)
	}
}

func (w *world) entries(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile(w.audit)
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	if len(bytes.TrimSpace(b)) == 0 { // OpenAudit creates the file
		return nil
	}
	return strings.Split(strings.TrimSpace(string(b)), "\n")
}

// TestResolveCompleted: the confirmation page changes nothing; the action
// with the token settles the record, which then replays the given outcome,
// and the audit log says who did what, before and after.
func TestResolveCompleted(t *testing.T) {
	w := newWorld(t, console.Config{Token: token})
	rec := w.unknown(t, "u1")
	if _, js := w.page(t, "/console/api/overview"); !strings.Contains(js, `"unknown":1`) {
		t.Fatalf("overview before = %s, want one unknown record", js)
	}
	form := resolveForm(rec, "resolve_completed")
	form.Del("token")
	code, body := w.post(t, "/console/confirm", form, nil)
	if code != http.StatusOK || !strings.Contains(body, "Resolve as completed") || !strings.Contains(body, `name="token"`) {
		t.Fatalf("confirm = %d, want the confirmation page asking for the token:\n%s", code, body)
	}
	if got := w.get(t, "u1"); got.State != idem.StateUnknown {
		t.Fatalf("the confirmation page changed the record to %s", got.State)
	}
	code, _ = w.post(t, "/console/act", resolveForm(rec, "resolve_completed"), nil)
	if code != http.StatusSeeOther {
		t.Fatalf("act = %d, want 303 to the record", code)
	}
	got := w.get(t, "u1")
	if got.State != idem.StateCompleted || got.Response == nil || got.Response.Status != 201 || string(got.Response.Body) != `{"id":"ch_1"}` ||
		got.Response.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("after resolve the record is %+v, want completed with 201 and the body", got)
	}
	if _, js := w.page(t, "/console/api/overview"); !strings.Contains(js, `"unknown":0`) || !strings.Contains(js, `"completed":1`) {
		t.Errorf("overview after the action = %s, want it counted again: no unknown, one completed", js)
	}
	out, err := w.eng.Begin(context.Background(), idem.BeginParams{Key: "u1", Fingerprint: rec.Fingerprint})
	if err != nil || out.Decision != idem.Replay {
		t.Errorf("a retry after resolve: %v, %v; want a replay", out.Decision, err)
	}
	entries := w.entries(t)
	if len(entries) != 1 {
		t.Fatalf("audit log holds %d entries, want 1: %q", len(entries), entries)
	}
	e := entries[0]
	for _, want := range []string{`"who":"ana"`, `"action":"resolve_completed"`, `"before":"unknown, fence 1"`, `"after":"completed, fence 1, status 201, 13 B body"`, `"key_hash":"` + idem.KeyHash("", "u1") + `"`} {
		if !strings.Contains(e, want) {
			t.Errorf("audit entry lacks %s: %s", want, e)
		}
	}
	if strings.Contains(e, `"u1"`) || strings.Contains(e, token) {
		t.Errorf("the audit entry holds the key or the token: %s", e)
	}
	if _, body := w.page(t, "/console/audit"); !strings.Contains(body, "resolve_completed") || !strings.Contains(body, "ana") {
		t.Errorf("the audit page does not show the action:\n%s", body)
	}
	// The log survives a restart of the console.
	a, err := console.OpenAudit(w.audit, true)
	if err != nil || len(a.Recent()) != 1 || a.Recent()[0].Who != "ana" {
		t.Errorf("reopened audit log: %+v, %v", a.Recent(), err)
	}
}

// TestResolvedStatusIsReplayedAsResolved: the console offered "an HTTP
// status from 100 to 599" and said "retries of this key will replay status
// N"; a 1xx resolution was stored, but a retry got 200 (net/http sends a
// 1xx as an interim answer and then a 200). A status that is not final is
// refused on the form, in the store's words, and nothing changes; a final
// one is replayed as it was given.
func TestResolvedStatusIsReplayedAsResolved(t *testing.T) {
	w := newWorld(t, console.Config{Token: token})
	rec := w.unknown(t, "u1")
	for _, status := range []string{"102", "199", "1000"} {
		for _, path := range []string{"/console/confirm", "/console/act"} {
			form := resolveForm(rec, "resolve_completed")
			form.Set("status", status)
			form.Set("body", "")
			code, body := w.post(t, path, form, nil)
			if want := "response status " + status + " is not a final HTTP status (200 to 999"; code != http.StatusBadRequest || !strings.Contains(html.UnescapeString(body), want) {
				t.Errorf("%s with status %s: %d; want 400 saying %q\n%s", path, status, code, want, body)
			}
		}
	}
	if got := w.get(t, "u1"); got.State != idem.StateUnknown {
		t.Fatalf("after refused resolutions the record is %s, want unknown", got.State)
	}
	if entries := w.entries(t); len(entries) != 0 {
		t.Errorf("refused resolutions were audited: %q", entries)
	}
	form := resolveForm(rec, "resolve_completed")
	form.Set("status", "202")
	if code, body := w.post(t, "/console/act", form, nil); code != http.StatusSeeOther {
		t.Fatalf("a resolution with status 202: %d; want 303\n%s", code, body)
	}
	mw, err := httpidem.New(httpidem.Config{Engine: w.eng})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw.Wrap(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		t.Error("the handler ran on a resolved key")
	})))
	defer srv.Close()
	req, _ := http.NewRequest("POST", srv.URL+"/charges", strings.NewReader("u1"))
	req.Header.Set("Idempotency-Key", "u1")
	res, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != 202 || string(b) != `{"id":"ch_1"}` || res.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("a retry of a key resolved as completed with status 202 got %d %q (replayed %q); the console promised 202 and the body", res.StatusCode, b, res.Header.Get("Idempotent-Replayed"))
	}
}

// pickyStore refuses every completed outcome, as a store refuses one it
// cannot replay.
type pickyStore struct{ idem.Store }

func (s pickyStore) Finish(ctx context.Context, p store.FinishParams) error {
	if p.State == idem.StateCompleted {
		return fmt.Errorf("%w: response status %d is not one this store replays", idem.ErrInvalid, p.Response.Status)
	}
	return s.Store.Finish(ctx, p)
}

// TestStoreRefusalIsShownInItsWords: an outcome the store refuses is shown
// to the operator in the store's words, which say what to change. (The
// console said "Nothing was changed: idem: invalid input".)
func TestStoreRefusalIsShownInItsWords(t *testing.T) {
	clock := storetest.NewClock(time.Now().UTC().Truncate(time.Second))
	eng, err := idem.New(idem.Config{Store: pickyStore{memstore.New()}, Clock: clock, Lease: 30 * time.Second, CacheSize: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close(context.Background()) })
	audit := filepath.Join(t.TempDir(), "audit.log")
	a, err := console.OpenAudit(audit, true)
	if err != nil {
		t.Fatal(err)
	}
	c, err := console.New(console.Config{Engine: eng, Token: token, Audit: a, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(c)
	defer srv.Close()
	w := &world{eng: eng, clock: clock, srv: srv, audit: audit}
	rec := w.unknown(t, "u1")
	code, body := w.post(t, "/console/act", resolveForm(rec, "resolve_completed"), nil)
	if want := "Nothing was changed: response status 201 is not one this store replays"; code != http.StatusConflict || !strings.Contains(html.UnescapeString(body), want) {
		t.Fatalf("a resolution the store refuses: %d; want 409 saying %q\n%s", code, want, body)
	}
	if got := w.get(t, "u1"); got.State != idem.StateUnknown {
		t.Fatalf("after a refused resolution the record is %s, want unknown", got.State)
	}
}

// TestActionOnAChangedRecordRefused: an operator confirms what they saw;
// if the record moved on meanwhile, nothing is done.
func TestActionOnAChangedRecordRefused(t *testing.T) {
	w := newWorld(t, console.Config{Token: token})
	rec := w.unknown(t, "u1")
	form := resolveForm(rec, "resolve_failed")
	form.Set("fence", "7")
	if code, body := w.post(t, "/console/act", form, nil); code != http.StatusConflict || !strings.Contains(body, "changed since you looked") {
		t.Errorf("act on a changed record = %d, want 409:\n%s", code, body)
	}
	if got := w.get(t, "u1"); got.State != idem.StateUnknown {
		t.Errorf("the record is %s, want unknown", got.State)
	}
	if e := w.entries(t); len(e) != 1 || !strings.Contains(e[0], `"error":"the record changed`) {
		t.Errorf("audit = %q, want the refused attempt with its error", e)
	}
}

func TestReleaseStaleLease(t *testing.T) {
	w := newWorld(t, console.Config{Token: token})
	out, err := w.eng.Begin(context.Background(), idem.BeginParams{Key: "run", Fingerprint: "v1.a.b.c.d"})
	if err != nil || out.Decision != idem.Execute {
		t.Fatal(out.Decision, err)
	}
	rec := w.get(t, "run")
	if code, body := w.post(t, "/console/act", resolveForm(rec, "release"), nil); code != http.StatusConflict || !strings.Contains(body, "lease") {
		t.Errorf("release of a running lease = %d, want 409:\n%s", code, body)
	}
	if _, body := w.page(t, "/console/record?key=run"); strings.Contains(body, "Release…") {
		t.Errorf("a running lease is offered for release:\n%s", body)
	}
	w.clock.Advance(time.Minute) // the lease has ended, not the owner's grace
	if _, body := w.page(t, "/console/record?key=run"); strings.Contains(body, "Release…") {
		t.Errorf("a lease just ended is offered for release, within its owner's grace:\n%s", body)
	}
	if code, _ := w.post(t, "/console/act", resolveForm(rec, "release"), nil); code != http.StatusConflict {
		t.Errorf("release within the owner's grace = %d, want 409", code)
	}
	w.clock.Advance(reconcile.DefaultGrace)
	if _, body := w.page(t, "/console/record?key=run"); !strings.Contains(body, "Release…") {
		t.Errorf("a stale lease is not offered for release:\n%s", body)
	}
	if code, _ := w.post(t, "/console/act", resolveForm(rec, "release"), nil); code != http.StatusSeeOther {
		t.Fatalf("release of a stale lease = %d, want 303", code)
	}
	if got := w.get(t, "run"); got.State != idem.StateFailed {
		t.Errorf("after release the record is %s, want failed (released)", got.State)
	}
}

func TestRecordsFilter(t *testing.T) {
	w := newWorld(t, console.Config{Token: token})
	w.completed(t, "order-1", "a")
	w.completed(t, "order-2", "b")
	w.unknown(t, "refund-1")
	_, body := w.page(t, "/console/records?state=completed&key=order-")
	if !strings.Contains(body, ">order-1<") || !strings.Contains(body, ">order-2<") || strings.Contains(body, "refund-1") {
		t.Errorf("completed order-*: want order-1 and order-2 only:\n%s", body)
	}
	_, body = w.page(t, "/console/records?state=stale")
	if !strings.Contains(body, "refund-1") || strings.Contains(body, "order-1") {
		t.Errorf("stale: want refund-1 only:\n%s", body)
	}
	if code, body := w.page(t, "/console/records?since=yesterday"); code != http.StatusBadRequest || !strings.Contains(body, "RFC 3339") {
		t.Errorf("a bad time = %d, want 400 saying what a time is:\n%s", code, body)
	}
	if code, _ := w.page(t, "/console/records?state=done"); code != http.StatusBadRequest {
		t.Errorf("a bad state = %d, want 400", code)
	}
}

// TestMask: with keys masked, no page holds a key, a body, a checkpoint's
// data or a header's value, not even in a link or a form; the record is
// still opened and settled through a reference only this process reads.
func TestMask(t *testing.T) {
	w := newWorld(t, console.Config{Token: token, Mask: true})
	const key = "card-4242-secret"
	ctx := context.Background()
	out, err := w.eng.Begin(ctx, idem.BeginParams{Key: key, Fingerprint: "v1.a.b.c.d"})
	if err != nil {
		t.Fatal(err)
	}
	if err := w.eng.Checkpoint(ctx, out.Lease, "authorize", []byte("pay_secret_42")); err != nil {
		t.Fatal(err)
	}
	if err := w.eng.MarkUnknown(ctx, out.Lease); err != nil {
		t.Fatal(err)
	}
	w.clock.Advance(reconcile.DefaultGrace) // its owner's grace has passed: an operator may resolve it
	w.completed(t, "other-4242", "pan=4242424242424242")
	_, list := w.page(t, "/console/records")
	link := regexp.MustCompile(`href="(/console/record\?ref=[^"]+)"`).FindAllStringSubmatch(list, -1)
	if len(link) != 2 {
		t.Fatalf("the listing has %d record links, want 2:\n%s", len(link), list)
	}
	var pages []string
	for _, l := range link {
		code, page := w.page(t, html.UnescapeString(l[1]))
		if code != http.StatusOK {
			t.Fatalf("opening %s: %d\n%s", l[1], code, page)
		}
		pages = append(pages, page)
	}
	for _, body := range append(pages, list) {
		for _, secret := range []string{key, "other-4242", "4242424242424242", "pay_secret_42", "text/html"} {
			if strings.Contains(body, secret) {
				t.Errorf("a masked page holds %q:\n%s", secret, body)
			}
		}
	}
	if !strings.Contains(strings.Join(pages, ""), "(masked: 20 B)") {
		t.Errorf("the masked body is not said to be masked")
	}
	if code, _ := w.page(t, "/console/record?key="+key); code != http.StatusBadRequest {
		t.Errorf("a masked console opened a record by its key: %d", code)
	}
	// Settle the unknown one through the form's reference.
	var unknownPage string
	for _, p := range pages {
		if strings.Contains(p, "Resolve as failed") {
			unknownPage = p
		}
	}
	ref := regexp.MustCompile(`name="ref" value="([^"]+)"`).FindStringSubmatch(unknownPage)
	if ref == nil {
		t.Fatalf("no record reference in the form:\n%s", unknownPage)
	}
	form := url.Values{"action": {"resolve_failed"}, "ref": {html.UnescapeString(ref[1])}, "fence": {"1"}, "state": {"unknown"}, "who": {"ana"}, "token": {token}}
	if code, body := w.post(t, "/console/act", form, nil); code != http.StatusSeeOther {
		t.Fatalf("resolve by reference = %d\n%s", code, body)
	}
	if got := w.get(t, key); got.State != idem.StateFailed {
		t.Errorf("the record is %s, want failed", got.State)
	}
}

// TestRebindingRefused: a page of another site that points its own name at
// the console's address sends that name; the console answers only to an
// address or localhost.
func TestRebindingRefused(t *testing.T) {
	w := newWorld(t, console.Config{Token: token})
	req, _ := http.NewRequest("GET", w.srv.URL+"/console/records", nil)
	req.Host = "attacker.example:8091"
	res, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusMisdirectedRequest {
		t.Errorf("Host attacker.example: %d, want 421", res.StatusCode)
	}
	req.Host = "localhost:8091"
	if res, err = client.Do(req); err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusOK {
		t.Errorf("Host localhost: %d; want 200", res.StatusCode)
	}
}

// TestConfirmRefusedCrossSite: another site cannot open a filled-in
// confirmation page for the operator to sign.
func TestConfirmRefusedCrossSite(t *testing.T) {
	w := newWorld(t, console.Config{Token: token})
	rec := w.unknown(t, "u1")
	if code, _ := w.post(t, "/console/confirm", resolveForm(rec, "resolve_completed"), http.Header{"Sec-Fetch-Site": {"cross-site"}}); code != http.StatusForbidden {
		t.Errorf("a cross-site confirmation page = %d, want 403", code)
	}
	form := resolveForm(rec, "resolve_failed")
	form.Set("fence", "9")
	if code, _ := w.post(t, "/console/confirm", form, nil); code != http.StatusConflict {
		t.Errorf("confirming a record that changed = %d, want 409", code)
	}
}

func TestOverview(t *testing.T) {
	n := 0.0
	w := newWorld(t, console.Config{Token: token, Counts: func() telemetry.Counts {
		n++
		return telemetry.Counts{Requests: map[string]float64{"executed": n, "replayed": 1234567}, StoreCalls: 2 * n,
			Reconciled: map[string]float64{"completed": 3}, LastPass: map[string]float64{"stale": 1}}
	}})
	w.completed(t, "a", "x")
	w.unknown(t, "b")
	code, body := w.page(t, "/console/")
	if code != http.StatusOK || !strings.Contains(body, `id="total-executed" data-total="executed">1<`) || !strings.Contains(body, `id="records-unknown">1<`) ||
		!strings.Contains(body, `id="reconciled-completed">3<`) || !strings.Contains(body, `id="pass-stale">1<`) ||
		!strings.Contains(body, `data-total="replayed">1234567<`) {
		t.Errorf("overview = %d, want executed 1 and one unknown record:\n%s", code, body)
	}
	_, js := w.page(t, "/console/api/overview")
	if !strings.Contains(js, `"executed":2`) || !strings.Contains(js, `"stale":1`) || !strings.Contains(js, `"completed":1`) {
		t.Errorf("overview JSON = %s", js)
	}
}

func TestPurge(t *testing.T) {
	w := newWorld(t, console.Config{Token: token})
	w.completed(t, "old", "x")
	w.clock.Advance(idem.DefaultRetention + time.Hour)
	// The time confirmed is the time purged: a duration ago is read once.
	_, page := w.post(t, "/console/confirm", url.Values{"action": {"purge"}, "before": {"1m"}}, nil)
	want := w.clock.Now().Add(-time.Minute).UTC().Format(time.RFC3339Nano)
	if !strings.Contains(page, `name="before" value="`+want+`"`) {
		t.Fatalf("the confirmation page does not carry the time it shows (%s):\n%s", want, page)
	}
	if code, _ := w.post(t, "/console/confirm", url.Values{"action": {"purge"}, "before": {"2099-01-01T00:00:00Z"}}, nil); code != http.StatusBadRequest {
		t.Errorf("a purge in the future = %d, want 400", code)
	}
	form := url.Values{"action": {"purge"}, "before": {want}, "who": {"ana"}, "token": {token}}
	if code, _ := w.post(t, "/console/act", form, nil); code != http.StatusSeeOther {
		t.Fatalf("purge = %d, want 303", code)
	}
	if e := w.entries(t); len(e) != 1 || !strings.Contains(e[0], `"after":"1 purged"`) {
		t.Errorf("audit = %q, want 1 purged", e)
	}
}

// TestCountsOnALargeStore: past its bound the count of every record is a
// floor, said so, but the UNKNOWN records are all counted.
func TestCountsOnALargeStore(t *testing.T) {
	w := newWorld(t, console.Config{Token: token})
	ctx := context.Background()
	for i := range 10050 {
		out, err := w.eng.Begin(ctx, idem.BeginParams{Key: fmt.Sprintf("a-%05d", i), Fingerprint: "v1.a.b.c.d"})
		if err != nil {
			t.Fatal(err)
		}
		if err := w.eng.Complete(ctx, out.Lease, &idem.Response{Status: 201}); err != nil {
			t.Fatal(err)
		}
	}
	for _, k := range []string{"zz-1", "zz-2", "zz-3"} {
		w.unknown(t, k)
	}
	_, js := w.page(t, "/console/api/overview")
	if !strings.Contains(js, `"capped":true`) || !strings.Contains(js, `"unknown":3`) || !strings.Contains(js, `"stale":3`) {
		t.Errorf("overview of 10,053 records = %s; want capped, with the 3 unknown ones counted", js)
	}
}

// TestResolveWaitsForTheOwnersGrace: a record a client's retry has just
// turned UNKNOWN (its lease a second over) is not offered for resolving,
// and an action on it is refused, for the reconciler's grace: its owner may
// still store the true outcome. (It was resolved at once, and the next
// retry ran the request again.)
func TestResolveWaitsForTheOwnersGrace(t *testing.T) {
	w := newWorld(t, console.Config{Token: token})
	ctx := context.Background()
	fp := idem.Fingerprint("v1.a.b.c.d")
	out, err := w.eng.Begin(ctx, idem.BeginParams{Key: "run", Fingerprint: fp})
	if err != nil || out.Decision != idem.Execute {
		t.Fatal(out.Decision, err)
	}
	w.clock.Advance(31 * time.Second)
	if o, _ := w.eng.Begin(ctx, idem.BeginParams{Key: "run", Fingerprint: fp}); o.Decision != idem.Uncertain { // a client's retry
		t.Fatal(o.Decision)
	}
	if _, page := w.page(t, "/console/record?key=run"); strings.Contains(page, `value="resolve_failed"`) || !strings.Contains(page, `id="resolve-wait"`) {
		t.Fatalf("the record page offers to resolve a record within its owner's grace, or does not say when it can:\n%s", page)
	}
	if code, _ := w.post(t, "/console/act", resolveForm(w.get(t, "run"), "resolve_failed"), nil); code != http.StatusConflict {
		t.Fatalf("resolve_failed a second after the lease ended: %d; want 409", code)
	}
	if err := w.eng.Complete(ctx, out.Lease, &idem.Response{Status: 201, Body: []byte("done")}); err != nil {
		t.Fatalf("the owner's late outcome: %v", err)
	}
}

// lossyStore applies a Finish and then says the store did not answer.
type lossyStore struct{ idem.Store }

func (s lossyStore) Finish(ctx context.Context, p store.FinishParams) error {
	if err := s.Store.Finish(ctx, p); err != nil {
		return err
	}
	return fmt.Errorf("%w: the answer was lost", idem.ErrUnavailable)
}

// TestLostAnswerIsNotNothingChanged: an action whose write landed but whose
// answer was lost is not reported (nor audited) as "nothing was changed":
// the console reads the record again and says what it is now.
func TestLostAnswerIsNotNothingChanged(t *testing.T) {
	ctx := context.Background()
	clock := storetest.NewClock(time.Now().UTC().Truncate(time.Second))
	mem := memstore.New()
	eng, err := idem.New(idem.Config{Store: lossyStore{mem}, Clock: clock, Lease: 30 * time.Second, CacheSize: -1})
	if err != nil {
		t.Fatal(err)
	}
	audit := filepath.Join(t.TempDir(), "audit.log")
	a, err := console.OpenAudit(audit, true)
	if err != nil {
		t.Fatal(err)
	}
	c, err := console.New(console.Config{Engine: eng, Token: token, Audit: a, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(c)
	defer srv.Close()
	w := &world{eng: eng, clock: clock, srv: srv, audit: audit}
	out, err := eng.Begin(ctx, idem.BeginParams{Key: "u", Fingerprint: "v1.a.b.c.d"})
	if err != nil {
		t.Fatal(err)
	}
	if err := mem.Finish(ctx, store.FinishParams{Key: "u", Token: out.Lease.Token, Now: clock.Now(), State: idem.StateUnknown}); err != nil {
		t.Fatal(err)
	}
	clock.Advance(reconcile.DefaultGrace)
	code, body := w.post(t, "/console/act", resolveForm(w.get(t, "u"), "resolve_failed"), nil)
	if got := w.get(t, "u"); got.State != idem.StateFailed {
		t.Fatalf("the record is %s; the test needs the write to have landed", got.State)
	}
	if code != http.StatusServiceUnavailable || strings.Contains(body, "Nothing was changed") || !strings.Contains(body, "failed, fence 1") {
		t.Fatalf("%d %s; want a 503 that says the action may have been done, and the record as it is now", code, body)
	}
	if entries := w.entries(t); len(entries) != 1 || !strings.Contains(entries[0], `"after":"failed, fence 1"`) {
		t.Fatalf("audit %q; want the record as it is after the action", entries)
	}
}

// TestMaskedPagingAndFilter: with keys masked, the listing's next-page link
// holds no key (a store's cursor names the key it resumes after; it was in
// the link, whole) and still pages, and the key filter, which answered one
// prefix at a time, is refused.
func TestMaskedPagingAndFilter(t *testing.T) {
	w := newWorld(t, console.Config{Token: token, Mask: true})
	for i := range 51 {
		w.completed(t, fmt.Sprintf("card-4242-secret-%02d", i), "x")
	}
	_, list := w.page(t, "/console/records")
	next := regexp.MustCompile(`href="(/console/records\?[^"]+)" rel="next"`).FindStringSubmatch(list)
	if next == nil {
		t.Fatalf("no next page link in:\n%s", list)
	}
	link := html.UnescapeString(next[1])
	u, _ := url.Parse(link)
	raw, _ := base64.RawURLEncoding.DecodeString(u.Query().Get("cursor"))
	if strings.Contains(link, "secret") || strings.Contains(string(raw), "secret") {
		t.Fatalf("the next-page link holds a key: %s (%q)", link, raw)
	}
	code, page2 := w.page(t, link)
	if code != http.StatusOK || !strings.Contains(page2, "1 record(s) on this page") {
		t.Fatalf("the next page: %d\n%s", code, page2)
	}
	if code, _ := w.page(t, "/console/records?key=card-4242-secret-5"); code != http.StatusBadRequest {
		t.Fatalf("a key filter on a masked console: %d; want 400", code)
	}
	if _, list := w.page(t, "/console/records"); strings.Contains(list, `name="key"`) {
		t.Fatal("a masked console offers a key filter")
	}
}

// hangingStore is a store whose listing never answers: a server that
// stopped answering after it was opened.
type hangingStore struct{ idem.Store }

func (s hangingStore) List(ctx context.Context, p store.ListParams) (idem.ScanResult, error) {
	<-ctx.Done()
	return idem.ScanResult{}, fmt.Errorf("%w: %w", idem.ErrUnavailable, ctx.Err())
}

// TestOverviewAnswersWhileTheStoreHangs: the overview's count is bounded,
// so an operator who opens the console while the store does not answer
// gets the page, with the count's error, and no other viewer waits behind
// it for ever. Sequence: a store whose listing never answers; the overview
// (JSON) is asked for; it answers within 10 s (each page of the count is
// bounded at a few seconds), saying the count failed. (The count listed the
// records with no deadline, holding every viewer's overview.)
func TestOverviewAnswersWhileTheStoreHangs(t *testing.T) {
	t.Parallel()
	eng, err := idem.New(idem.Config{Store: hangingStore{memstore.New()}})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close(context.Background())
	c, err := console.New(console.Config{Engine: eng, ReadOnly: true, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(c)
	defer srv.Close()
	res, err := client.Get(srv.URL + "/console/api/overview")
	if err != nil {
		t.Fatalf("the overview while the store hangs: %v", err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	if res.StatusCode != http.StatusOK || !strings.Contains(string(b), `"error":`) {
		t.Fatalf("the overview while the store hangs: %d %s; want it, with the count's error", res.StatusCode, b)
	}
}

// TestConsoleAnswersLoopbackOnly: an admin listener on every interface (the
// Kubernetes example's, for its health probes) served the console's pages,
// stored payment responses included, to anyone who could reach the pod,
// token or not (the token guards actions only). The console answers only
// connections from loopback unless it is told to serve the network.
func TestConsoleAnswersLoopbackOnly(t *testing.T) {
	t.Parallel()
	eng, err := idem.New(idem.Config{Store: memstore.New()})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close(context.Background())
	for _, c := range []struct {
		remote bool
		from   string
		want   int
	}{
		{false, "10.1.2.3:40000", http.StatusForbidden},
		{false, "127.0.0.1:40000", http.StatusOK},
		{false, "[::1]:40000", http.StatusOK},
		{true, "10.1.2.3:40000", http.StatusOK},
	} {
		con, err := console.New(console.Config{Engine: eng, ReadOnly: true, Remote: c.remote, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		r := httptest.NewRequest("GET", "http://10.1.2.3:9090/console/", nil)
		r.RemoteAddr = c.from
		w := httptest.NewRecorder()
		con.ServeHTTP(w, r)
		if w.Code != c.want {
			t.Errorf("remote %v, a connection from %s: %d; want %d", c.remote, c.from, w.Code, c.want)
		}
	}
}
