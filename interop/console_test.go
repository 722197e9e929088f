package interop

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/reconcile"
)

var screenshots = flag.String("screenshots", "", "`directory` to write the console's screenshots to (docs/ for the README)")

// chromium is Debian's, which .ci/run installs.
const chromium = "/usr/bin/chromium"

var adminListening = regexp.MustCompile(`msg="idem proxy listening" addr=(\S+) .*admin=(\S+)`)

const adminToken = "console-test-token"

// consoleWorld is `idem proxy` with its console on, in front of an API that
// answers at once, except on /slow (never in time: the outcome is unknown)
// and /page (a stored body with a script in it).
type consoleWorld struct {
	api, admin string
	audit      string
}

func newConsoleWorld(t *testing.T, store string) *consoleWorld {
	t.Helper()
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		switch r.URL.Path {
		case "/slow":
			select {
			case <-r.Context().Done():
			case <-time.After(10 * time.Second):
			}
		case "/page":
			w.Header().Set("Content-Type", "text/html")
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, `<script>window.owned = true; document.title = "owned"</script><img src=x onerror="window.owned = true">`)
		default:
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, `{"id":"ch_1"}`)
		}
	}))
	t.Cleanup(upstream.Close)
	dir := t.TempDir()
	audit := filepath.Join(dir, "audit.log")
	cmd := exec.Command(idemBin, "proxy", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--upstream", upstream.URL,
		"--store", store, "--journal-dir", filepath.Join(dir, "journal"), "--upstream-timeout", "300ms", "--audit-log", audit)
	cmd.Env = append(os.Environ(), "IDEM_ADMIN_TOKEN="+adminToken)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	addrs := make(chan []string, 1)
	go func() {
		lines := bufio.NewScanner(stderr)
		for lines.Scan() {
			if m := adminListening.FindStringSubmatch(lines.Text()); m != nil {
				addrs <- m[1:]
			}
		}
	}()
	a := wait.Recv(t, addrs, 30*time.Second, "idem proxy to listen")
	return &consoleWorld{api: "http://" + a[0], admin: "http://" + a[1], audit: audit}
}

// send POSTs body to path under key, through the proxy.
func (w *consoleWorld) send(t *testing.T, path, key, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest("POST", w.api+path, strings.NewReader(body))
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Authorization", "Bearer sk_console")
	req.Header.Set("Content-Type", "application/json")
	res, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(b)
}

// browser starts a headless Chromium for the test.
func browser(t *testing.T) context.Context {
	t.Helper()
	if _, err := os.Stat(chromium); err != nil {
		t.Skipf("no %s (.ci/run installs Debian's chromium)", chromium)
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(chromium), chromedp.NoSandbox,
		chromedp.UserDataDir(t.TempDir()), chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true), chromedp.Flag("disable-sync", true), chromedp.Flag("disable-quic", true),
		chromedp.WindowSize(1280, 900))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	alloc, cancelAlloc := chromedp.NewExecAllocator(ctx, opts...)
	t.Cleanup(cancelAlloc)
	bctx, cancelBrowser := chromedp.NewContext(alloc)
	t.Cleanup(cancelBrowser)
	if err := chromedp.Do(bctx); err != nil {
		t.Fatalf("starting chromium: %v", err)
	}
	return bctx
}

// do runs browser steps, failing the test with what was being done.
func do(t *testing.T, ctx context.Context, what string, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	step, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if err := chromedp.Do(step, steps...); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// get runs a browser action and returns its value.
func get[T any](t *testing.T, ctx context.Context, what string, a chromedp.Action[T]) T {
	t.Helper()
	step, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	v, err := chromedp.Run(step, a)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	return v
}

// loaded waits until the page a click led to has loaded and cond (a
// JavaScript expression) holds on it. While the browser navigates, a
// script may be cut off with the page it ran on: that is retried.
func loaded(t *testing.T, ctx context.Context, what, cond string) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		step, cancel := context.WithTimeout(ctx, time.Until(deadline))
		ok, err := chromedp.Run(step, chromedp.Poll[bool](`document.readyState === "complete" && (`+cond+`)`, chromedp.WithPollingTimeout(0)))
		cancel()
		if err == nil && ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("waiting for %s: %v", what, err)
		}
	}
}

// shoot saves a screenshot of the page when -screenshots asks for them.
func shoot(t *testing.T, ctx context.Context, name string) {
	t.Helper()
	if *screenshots == "" {
		return
	}
	png := get(t, ctx, "screenshot "+name, chromedp.FullScreenshot(100))
	if err := os.WriteFile(filepath.Join(*screenshots, name), png, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestConsoleSQLite(t *testing.T) {
	testConsole(t, "sqlite:"+filepath.Join(t.TempDir(), "idem.db"), true)
}

func TestConsolePostgres(t *testing.T) {
	url := os.Getenv("IDEM_TEST_DATABASE_URL")
	if url == "" {
		t.Skip("IDEM_TEST_DATABASE_URL is not set")
	}
	sep := "?"
	if strings.Contains(url, "?") {
		sep = "&"
	}
	testConsole(t, url+sep+"idem_schema=console_"+strconv.FormatInt(time.Now().UnixNano(), 36), false)
}

// testConsole drives the console in a browser: the overview's counters move
// while requests flow; the records filter finds an UNKNOWN record; resolving
// it is refused without the token and done with it, after which a retry
// gets the replay; a stored script is shown as text and never runs; and the
// pages fit a phone's width.
func testConsole(t *testing.T, store string, pictures bool) {
	w := newConsoleWorld(t, store)
	ctx := browser(t)
	id, css := func(s string) chromedp.ID { return chromedp.ID(s) }, func(s string) chromedp.CSS { return chromedp.CSS(s) }

	// The overview's counters move while requests flow.
	do(t, ctx, "loading the overview", chromedp.Navigate(w.admin+"/console/"), chromedp.WaitVisible(id("records-stale")))
	before := get(t, ctx, "reading the executed counter", chromedp.Text(id("total-executed")))
	n, err := strconv.Atoi(strings.TrimSpace(before))
	if err != nil {
		t.Fatalf("the executed counter reads %q", before)
	}
	for i := range 5 {
		if code, body := w.send(t, "/v1/charges", fmt.Sprintf("flow-%d", i), `{"amount":100}`); code != http.StatusCreated {
			t.Fatalf("a request through the proxy: %d %s", code, body)
		}
	}
	get(t, ctx, "waiting for the executed counter and its rate to move without a reload",
		chromedp.Poll[bool](fmt.Sprintf(`Number(document.getElementById("total-executed").textContent) >= %d && document.getElementById("rate-executed").textContent !== "-"`, n+5),
			chromedp.WithPollingTimeout(15*time.Second)))

	// A request whose upstream never answers in time leaves an UNKNOWN record.
	const body = `{"amount":2500}`
	if code, _ := w.send(t, "/slow", "pay-unknown", body); code < 500 {
		t.Fatalf("the slow request answered %d, want a 5xx", code)
	}
	if code, text := w.send(t, "/slow", "pay-unknown", body); code != http.StatusConflict || !strings.Contains(text, "operation-uncertain") {
		t.Fatalf("a retry of the unknown request: %d %s; want 409 operation-uncertain", code, text)
	}
	if code, _ := w.send(t, "/page", "page-1", `{}`); code != http.StatusCreated {
		t.Fatalf("the page request answered %d", code)
	}
	do(t, ctx, "reloading the overview", chromedp.Navigate(w.admin+"/console/"), chromedp.WaitVisible(id("records-stale")))
	get(t, ctx, "waiting for the unknown record to be counted",
		chromedp.Poll[bool](`document.getElementById("records-unknown").textContent === "1"`, chromedp.WithPollingTimeout(15*time.Second)))
	if pictures {
		shoot(t, ctx, "console-overview.png")
	}

	// Filter the records to the UNKNOWN ones and open it.
	do(t, ctx, "filtering the records", chromedp.Navigate(w.admin+"/console/records"), chromedp.WaitVisible(id("state")),
		chromedp.SetValue(id("state"), "unknown"), chromedp.SetValue(id("key"), "pay-"),
		chromedp.Click(css("form.filter button")))
	loaded(t, ctx, "the filtered listing", `location.search.includes("state=unknown")`)
	do(t, ctx, "finding the record", chromedp.WaitVisible(`//a[text()="pay-unknown"]`))
	if rows := get(t, ctx, "counting the rows", chromedp.Evaluate[int](`document.querySelectorAll("table.records tbody tr").length`)); rows != 1 {
		t.Errorf("the filtered listing has %d rows, want 1", rows)
	}
	if pictures {
		shoot(t, ctx, "console-records.png")
	}
	do(t, ctx, "opening the record", chromedp.Click(`//a[text()="pay-unknown"]`), chromedp.WaitVisible(id("record-state")))
	if state := get(t, ctx, "reading the state", chromedp.Text(id("record-state"))); !strings.Contains(state, "unknown") {
		t.Fatalf("the record's state reads %q, want unknown", state)
	}
	if pictures {
		shoot(t, ctx, "console-record.png")
	}
	recordURL := get(t, ctx, "reading the record's address", chromedp.Location())

	// Its owner may still store its outcome for the reconciler's grace: the
	// page says from when it can be resolved, and offers nothing before.
	wait := get(t, ctx, "reading when it can be resolved", chromedp.Text(id("resolve-wait")))
	if n := get(t, ctx, "looking for the resolve form", chromedp.Evaluate[int](`document.querySelectorAll("#status").length`)); n != 0 {
		t.Fatalf("an UNKNOWN record is offered for resolving within its owner's grace (%s)", wait)
	}
	at := regexp.MustCompile(`\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC`).FindString(wait)
	from, err := time.Parse("2006-01-02 15:04:05 MST", at)
	if err != nil || time.Until(from) > reconcile.DefaultGrace+5*time.Second {
		t.Fatalf("the page says %q; want the time the grace ends, within %v", wait, reconcile.DefaultGrace)
	}
	time.Sleep(time.Until(from) + time.Second) // the grace itself: what is waited for is the time
	do(t, ctx, "the record, its grace over", chromedp.Navigate(recordURL), chromedp.WaitVisible(id("status")))

	// Resolving without the right token is refused, and changes nothing.
	resolve := func(token string) {
		do(t, ctx, "asking to resolve", chromedp.SetValue(id("status"), "201"), chromedp.SetValue(id("body"), `{"id":"ch_resolved"}`),
			chromedp.Click(`//button[text()="Resolve as completed…"]`), chromedp.WaitVisible(id("confirm")),
			chromedp.SendKeys(id("who"), "Ana on call"), chromedp.SendKeys(id("token"), token), chromedp.Click(id("confirm")))
	}
	resolve("not-the-token")
	do(t, ctx, "waiting for the refusal", chromedp.WaitVisible(css(`p[role="alert"]`)))
	if refused := get(t, ctx, "reading the refusal", chromedp.Text(css(`p[role="alert"]`))); !strings.Contains(refused, "admin token is missing or wrong") {
		t.Errorf("a wrong token: the page says %q", refused)
	}
	if code, _ := w.send(t, "/slow", "pay-unknown", body); code != http.StatusConflict {
		t.Fatalf("after a refused resolve a retry answers %d, want 409 still", code)
	}

	// With the token it is done, and the retry gets the replay.
	do(t, ctx, "back to the record", chromedp.Navigate(recordURL), chromedp.WaitVisible(id("record-state")))
	resolve(adminToken)
	do(t, ctx, "waiting for the resolved record", chromedp.WaitVisible(css("p.done")))
	if state := get(t, ctx, "reading the state", chromedp.Text(id("record-state"))); !strings.Contains(state, "completed") {
		t.Errorf("after resolve the record's state reads %q, want completed", state)
	}
	if code, text := w.send(t, "/slow", "pay-unknown", body); code != http.StatusCreated || text != `{"id":"ch_resolved"}` {
		t.Errorf("a retry after resolve: %d %s; want the replay 201 {\"id\":\"ch_resolved\"}", code, text)
	}
	audit, err := os.ReadFile(w.audit)
	if err != nil || !strings.Contains(string(audit), `"who":"Ana on call"`) || !strings.Contains(string(audit), `"after":"completed, fence 1, status 201`) {
		t.Errorf("audit log = %s, %v; want Ana's resolve", audit, err)
	}
	do(t, ctx, "the audit page", chromedp.Navigate(w.admin+"/console/audit"), chromedp.WaitVisible(css("table.records")))
	if audited := get(t, ctx, "reading the audit page", chromedp.Text(css("table.records tbody"))); !strings.Contains(audited, "Ana on call") || !strings.Contains(audited, "resolve_completed") {
		t.Errorf("the audit page shows %q", audited)
	}

	// A stored script is text: it is shown, and it never runs.
	do(t, ctx, "opening the record with a script in its body", chromedp.Navigate(w.admin+"/console/records?key=page-"),
		chromedp.Click(`//a[text()="page-1"]`), chromedp.WaitVisible(id("response-body")))
	shown := get(t, ctx, "reading the body", chromedp.Text(id("response-body")))
	title := get(t, ctx, "reading the title", chromedp.Title())
	owned := get(t, ctx, "looking for the script's effects",
		chromedp.Evaluate[bool](`window.owned === true || document.querySelectorAll("main img, #response-body script").length > 0`))
	if owned || title == "owned" || !strings.Contains(shown, "<script>window.owned = true") {
		t.Errorf("a stored script: ran %v, title %q, shown as %q; want it shown as text and never run", owned, title, shown)
	}

	// On a phone's width no page needs scrolling sideways (wide tables
	// scroll in their own box).
	do(t, ctx, "a phone's screen", chromedp.EmulateViewport(390, 844))
	for _, page := range []string{"/console/", "/console/records", "/console/audit", recordURL[len(w.admin):]} {
		do(t, ctx, "a phone's width on "+page, chromedp.Navigate(w.admin+page), chromedp.WaitVisible(css("main")))
		if wide := get(t, ctx, "measuring "+page, chromedp.Evaluate[bool](`document.documentElement.scrollWidth > window.innerWidth + 1`)); wide {
			culprits := get(t, ctx, "finding what is wide", chromedp.Evaluate[string](`[...document.querySelectorAll("body *")].filter(e => !e.closest(".scroll") && e.getBoundingClientRect().right > window.innerWidth + 1).slice(0, 5).map(e => e.tagName + "." + e.className + "#" + e.id + " " + Math.round(e.getBoundingClientRect().right)).join(", ")`))
			t.Errorf("%s is wider than a phone's screen (%d px wide): %s", page, 390, culprits)
		}
	}
	if pictures {
		do(t, ctx, "the records on a phone", chromedp.Navigate(w.admin+"/console/"), chromedp.WaitVisible(id("records-stale")))
		shoot(t, ctx, "console-phone.png")
	}
}
