package redact_test

import (
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/idemhq/idem/internal/redact"
)

func TestURL(t *testing.T) {
	for in, want := range map[string]string{
		"postgres://idem:hunter2@db:5432/pay?sslmode=disable":       "postgres://idem:xxxxx@db:5432/pay?sslmode=disable",
		"postgres://idem@db/pay?password=hunter2&sslmode=require":   "postgres://idem@db/pay?password=xxxxx&sslmode=require",
		"https://api.example/resolve?api_key=hunter2&tenant=a#frag": "https://api.example/resolve?api_key=xxxxx&tenant=a",
		"http://alice:hunter2@127.0.0.1:9000/v1/charges":            "http://alice:xxxxx@127.0.0.1:9000/v1/charges",
		"postgres://idem:hunter2/x@db/pay":                          "postgres://…",
		"idem:hunter2@db/pay":                                       "idem://…",
		"%zz:hunter2":                                               "(not a URL)",
		"redis://db:6379/0":                                         "redis://db:6379/0",
		// An HTTP API's key as the user name, the way Stripe's are sent;
		// a database's user name is no secret.
		"https://sk_live_hunter2@api.example/idem/resolve": "https://xxxxx@api.example/idem/resolve",
		"postgres://idem@db/pay":                           "postgres://idem@db/pay",
	} {
		if got := redact.URL(in); got != want {
			t.Errorf("URL(%q) = %q; want %q", in, got, want)
		}
		if got := redact.URL(in); strings.Contains(got, "hunter2") {
			t.Errorf("URL(%q) = %q shows the secret", in, got)
		}
	}
}

func TestErr(t *testing.T) {
	_, err := http.Get("http://alice:hunter2@127.0.0.1:1/x?token=hunter2")
	if err == nil {
		t.Fatal("no error from a port nothing listens on")
	}
	if got := redact.Err(err); strings.Contains(got.Error(), "hunter2") || !errors.Is(got, errors.Unwrap(err)) {
		t.Fatalf("Err(%v) = %v; want the cause alone", err, got)
	}
}

// TestPasswordReadAsAPortIsMasked: a password with an unencoded / (or ? or
// #) whose start reads as a port (empty, or digits: "/…", "2024/…") makes
// url.Parse take "user:" as host:port and the rest of the password, up to
// the @, as the path (or the query). URL showed it whole: the store's DSN in
// every message, and the upstream in the proxy's start-up line. Such a URL
// is shown by its scheme alone, and HiddenUserInfo says so, for the checks
// that refuse it. An @ in the path of a URL without a port is no user-info,
// and an encoded one (%40) never is.
func TestPasswordReadAsAPortIsMasked(t *testing.T) {
	for _, s := range []string{
		"postgres://app:/hunter2@db:5432/payments",
		"postgres://app:2024/hunter2@db:5432/payments",
		"dynamodb://AKIAEXAMPLE:8/hunter2@127.0.0.1:8000?table=idem_records",
		"http://svc:/hunter2@127.0.0.1:9000",
		"redis://:/hunter2@127.0.0.1:6379/0",
		"postgres://app:?hunter2@db/payments",
		"postgres://app:12#hunter2@db/payments",
		"postgres://app:12/x?hunter2@db/payments",
		"postgres://a/pp:hunter2@db/payments", // a / in the user name
	} {
		if got := redact.URL(s); strings.Contains(got, "hunter2") {
			t.Errorf("URL(%s) = %s: the password is shown", s, got)
		}
		if !redact.HiddenUserInfo(s) {
			t.Errorf("HiddenUserInfo(%s) = false; want true", s)
		}
	}
	for s, want := range map[string]string{
		"http://api.example/users/@me":           "http://api.example/users/@me",
		"http://api.example:8080/users/%40me":    "http://api.example:8080/users/%40me",
		"http://svc:hunter2@api.example/a/@b":    "http://svc:xxxxx@api.example/a/@b",
		"postgres://app:hunter2@db:5432/x?a=b@c": "postgres://app:xxxxx@db:5432/x?a=b@c",
		"https://[::1]:8443/users/@me":           "https://[::1]:8443/users/@me",
	} {
		if redact.HiddenUserInfo(s) {
			t.Errorf("HiddenUserInfo(%s) = true; want false", s)
		}
		if got := redact.URL(s); got != want {
			t.Errorf("URL(%s) = %s; want %s", s, got, want)
		}
	}
}
