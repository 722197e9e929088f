package httpidem_test

import (
	"context"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/store/memstore"
)

// fingerprintOf sends one request under key and returns the fingerprint its
// record was stored with.
func fingerprintOf(t *testing.T, cfg httpidem.Config, path, key, body string) idem.Fingerprint {
	t.Helper()
	if cfg.Engine == nil {
		cfg.Engine = newEngine(t, memstore.New())
	}
	srv := serve(t, cfg, &app{handler: charge})
	if r := send(t, srv, "POST", path, key, body); r.status != 201 {
		t.Fatalf("%s: %d %s", path, r.status, r.body)
	}
	rec, err := cfg.Engine.Get(context.Background(), "", key)
	if err != nil {
		t.Fatal(err)
	}
	return rec.Fingerprint
}

// TestFingerprintsOfOrdinaryRequestsAreStable pins the fingerprints of
// ordinary requests: a JSON body canonicalised, with fields selected, and a
// path with escapes but no escaped slash. A record made before an upgrade
// is still the same request after it (a retry in flight across the upgrade
// replays instead of getting 422): a change to what such requests hash to
// must come with a new idem.FingerprintVersion.
func TestFingerprintsOfOrdinaryRequestsAreStable(t *testing.T) {
	for _, c := range []struct {
		name string
		cfg  httpidem.Config
		path string
		body string
		want idem.Fingerprint
	}{
		{"as sent", httpidem.Config{}, "/v1/charges", `{"amount":100}`,
			"v1.mu5rG832F9jjm7HytiTGjqM9651I4DZK6t7YNtPQApM.aE6MuWMmGL8OlO1mzZ5vBzMrtdsvFxgdswsdKACbwtk.47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU.TUu-Wcaq0iRCzeGZpqil8DRAX814-1qBwk7ySd4cRfE"},
		{"canonical JSON", httpidem.Config{CanonicalJSON: true}, "/v1/charges",
			`{"currency":"eur", "amount":1e2, "card":{"number":"4242","Exp":"12/30"}, "Note":"a"}`,
			"v1.mu5rG832F9jjm7HytiTGjqM9651I4DZK6t7YNtPQApM.aE6MuWMmGL8OlO1mzZ5vBzMrtdsvFxgdswsdKACbwtk.47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU.O1pTks4nb7mQynUuEKx6WXFBG9ZXMcQsqQSLU494ND0"},
		{"fields selected", httpidem.Config{IncludeFields: []string{"amount", "card.number"}, ExcludeFields: []string{"card.exp"}}, "/v1/charges",
			`{"currency":"eur", "amount":100, "card":{"number":"4242","exp":"12/30"}}`,
			"v1.mu5rG832F9jjm7HytiTGjqM9651I4DZK6t7YNtPQApM.aE6MuWMmGL8OlO1mzZ5vBzMrtdsvFxgdswsdKACbwtk.47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU.Xs0X9YMT1oDjngI-cXIpOSHQrhSDWaZ-CquCyweImFk"},
		{"escaped path", httpidem.Config{}, "/v1/charges/ch%201/refund%3Fnow", `x`,
			"v1.mu5rG832F9jjm7HytiTGjqM9651I4DZK6t7YNtPQApM.Pwuh4X55lsmzDVXiu86ct0X6ZBu_USuVx9PGeNXnOW0.47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU.LXEWQrcmsEQBYnyp-6wy9chTD7GQPMTbAiWHF5IaSIE"},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := fingerprintOf(t, c.cfg, c.path, "k", c.body); got != c.want {
				t.Errorf("fingerprint of %s %s = %q, want %q", c.path, c.body, got, c.want)
			}
		})
	}
}
