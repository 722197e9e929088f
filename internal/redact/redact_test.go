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
