package idem_test

import (
	"reflect"
	"strings"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store"
)

func TestFingerprint(t *testing.T) {
	base := idem.Payload{Method: "POST", Path: "/v1/charges", Query: "b=2&a=1&a=0", Body: []byte(`{"amount":100}`)}
	fp := idem.NewFingerprint(base)
	if !strings.HasPrefix(string(fp), "v1.") || len(fp) > store.MaxFingerprintLen {
		t.Fatalf("fingerprint %q: want a v1 prefix and at most %d bytes", fp, store.MaxFingerprintLen)
	}
	if strings.Contains(string(fp), "amount") || strings.Contains(string(fp), "charges") {
		t.Fatalf("fingerprint %q reveals the payload", fp)
	}
	same := base
	same.Query = "a=1&a=0&b=2" // parameters reordered: the same request
	if got := idem.NewFingerprint(same); got != fp {
		t.Fatalf("reordered query changed the fingerprint")
	}
	for _, c := range []struct {
		name   string
		change func(p *idem.Payload)
		diff   []string
	}{
		{"method", func(p *idem.Payload) { p.Method = "PUT" }, []string{"method"}},
		{"path", func(p *idem.Payload) { p.Path = "/v1/refunds" }, []string{"path"}},
		{"value order", func(p *idem.Payload) { p.Query = "b=2&a=0&a=1" }, []string{"query"}},
		{"body", func(p *idem.Payload) { p.Body = []byte(`{"amount":1000}`) }, []string{"body"}},
		{"path and body", func(p *idem.Payload) { p.Path = "/x"; p.Body = nil }, []string{"path", "body"}},
		// The parts are hashed apart, so moving bytes between them is seen.
		{"bytes moved between parts", func(p *idem.Payload) { p.Path = "/v1/charges{"; p.Body = []byte(`"amount":100}`) }, []string{"path", "body"}},
	} {
		p := base
		c.change(&p)
		if got := idem.NewFingerprint(p).Diff(fp); !reflect.DeepEqual(got, c.diff) {
			t.Errorf("%s: Diff = %v, want %v", c.name, got, c.diff)
		}
	}
	if got := fp.Diff(fp); got != nil {
		t.Errorf("Diff with itself = %v", got)
	}
	other := idem.Fingerprint("v2" + strings.TrimPrefix(string(fp), "v1"))
	if got := fp.Diff(other); !reflect.DeepEqual(got, []string{"version"}) {
		t.Errorf("Diff across versions = %v, want [version]", got)
	}
	if got := fp.Diff("not a fingerprint"); !reflect.DeepEqual(got, []string{"version"}) {
		t.Errorf("Diff with garbage = %v, want [version]", got)
	}
}

// TestFingerprintIsStable: stored records hold fingerprints computed by
// earlier releases, so a version's algorithm must never change its output;
// a retry after an upgrade would otherwise be refused as another payload.
func TestFingerprintIsStable(t *testing.T) {
	for _, c := range []struct {
		p    idem.Payload
		want idem.Fingerprint
	}{
		{idem.Payload{Method: "POST", Path: "/v1/charges", Query: "b=2&a=1", Body: []byte(`{"x":1}`)},
			"v1.mu5rG832F9jjm7HytiTGjqM9651I4DZK6t7YNtPQApM.aE6MuWMmGL8OlO1mzZ5vBzMrtdsvFxgdswsdKACbwtk.joW-WMHDcqwp_nv6gNjdy9BKQDLHtRwcAm1nxVsasj8.UEG_H3E98gR4Q1PoL2pKU1kxy2Tx9LSlrq_8tyCRiyI"},
		{idem.Payload{},
			"v1.47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU.47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU.47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU.47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU"},
	} {
		if got := idem.NewFingerprint(c.p); got != c.want {
			t.Errorf("NewFingerprint(%+v) = %s, want %s", c.p, got, c.want)
		}
	}
}
