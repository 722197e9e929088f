package proxy_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/internal/faultnet"
	"github.com/idemhq/idem/internal/proxy"
)

// TestLostUpstreamReplyIsNeverResent: when the upstream's reply to a keyed
// request is lost on a reused connection, net/http's transport would send a
// bodyless request with an Idempotency-Key again by itself (it takes the key
// as a promise that resending is safe). The upstream ran it; the proxy must
// not run it a second time, whatever the method and body. The reply is lost
// for real, by a TCP proxy between idem and the upstream.
func TestLostUpstreamReplyIsNeverResent(t *testing.T) {
	for _, tc := range []struct{ method, body string }{
		{"POST", ""}, {"POST", `{"amount":100}`}, {"PUT", ""}, {"PATCH", ""}, {"DELETE", ""}, {"GET", ""},
	} {
		t.Run(tc.method+map[bool]string{true: "-bodyless", false: "-body"}[tc.body == ""], func(t *testing.T) {
			up := &counter{fn: func(w http.ResponseWriter, r *http.Request, n int) {
				// What the upstream sees is what the client sent.
				if len(r.TransferEncoding) > 0 || r.ContentLength != int64(len(tc.body)) || r.Header.Get("Idempotency-Key") == "" {
					t.Errorf("upstream got transfer-encoding %v, content-length %d, key %q", r.TransferEncoding, r.ContentLength, r.Header.Get("Idempotency-Key"))
				}
				w.WriteHeader(201)
				w.Write([]byte("ran"))
			}}
			upstream := httptest.NewServer(up)
			defer upstream.Close()
			faults, err := faultnet.Listen(strings.TrimPrefix(upstream.URL, "http://"))
			if err != nil {
				t.Fatal(err)
			}
			defer faults.Close()
			cfg := proxy.Config{Upstream: "http://" + faults.Addr(),
				Defaults: proxy.Route{Config: httpidem.Config{Methods: []string{"POST", "PUT", "PATCH", "DELETE", "GET"}}}}
			srv := start(t, cfg, sqliteEngine(t), nil)

			send := func(key string) int {
				req, _ := http.NewRequest(tc.method, srv.URL+"/v1/captures/ch_1", strings.NewReader(tc.body))
				req.Header.Set("Idempotency-Key", key)
				resp, err := srv.Client().Do(req)
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				return resp.StatusCode
			}
			// A first request leaves a kept-alive connection to the upstream,
			// which the next request reuses.
			if status := send("warm-up"); status != 201 {
				t.Fatalf("warm-up: %d", status)
			}
			faults.DropNextReply()
			status := send("capture-1")
			if n := up.count("capture-1"); n != 1 {
				t.Fatalf("the upstream ran the request %d times after its reply was lost (client got %d); want once", n, status)
			}
			if status != http.StatusBadGateway {
				t.Fatalf("client got %d, want 502 (the upstream gave no answer)", status)
			}
			if got := faults.Stats().RepliesDropped; got != 1 {
				t.Fatalf("replies dropped: %d", got)
			}
			// The retry is told the outcome is uncertain, not run again.
			if status := send("capture-1"); status != http.StatusConflict || up.count("capture-1") != 1 {
				t.Fatalf("retry: %d, upstream runs %d; want 409 and 1", status, up.count("capture-1"))
			}
		})
	}
}
