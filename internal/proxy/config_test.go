package proxy_test

import (
	"math"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem/internal/proxy"
)

// TestValidateRefusesNegativeLimits: a negative timeout, duration or size
// is refused, naming its setting (the engine's and the body limits were
// reported as the route "/", or without their names), and so is a header
// limit that net/http's arithmetic wraps round. (A negative upstream
// timeout cut every response at once, so successful requests became
// UNKNOWN; the server's negative timeouts meant none at all; a header limit
// near the largest int refused every request with 431.)
func TestValidateRefusesNegativeLimits(t *testing.T) {
	for _, c := range []struct {
		name string
		set  func(*proxy.Config)
	}{
		{"upstream_timeout", func(c *proxy.Config) { c.UpstreamTimeout = -time.Second }},
		{"shutdown_timeout", func(c *proxy.Config) { c.ShutdownTimeout = -time.Second }},
		{"read_header_timeout", func(c *proxy.Config) { c.ReadHeaderTimeout = -time.Second }},
		{"read_timeout", func(c *proxy.Config) { c.ReadTimeout = -time.Second }},
		{"write_timeout", func(c *proxy.Config) { c.WriteTimeout = -time.Second }},
		{"idle_timeout", func(c *proxy.Config) { c.IdleTimeout = -time.Second }},
		{"max_header_bytes", func(c *proxy.Config) { c.MaxHeaderBytes = -1 }},
		{"max_header_bytes", func(c *proxy.Config) { c.MaxHeaderBytes = math.MaxInt }},
		{"lease", func(c *proxy.Config) { c.Engine.Lease = -time.Second }},
		{"retention", func(c *proxy.Config) { c.Engine.Retention = -time.Second }},
		{"poll", func(c *proxy.Config) { c.Engine.Poll = -time.Second }},
		{"store_timeout", func(c *proxy.Config) { c.Engine.StoreTimeout = -time.Second }},
		{"max_request_body", func(c *proxy.Config) { c.Defaults.MaxRequestBody = -1 }},
		{"max_response_body", func(c *proxy.Config) { c.Defaults.MaxResponseBody = -1 }},
	} {
		cfg := proxy.DefaultConfig()
		cfg.Upstream = "http://127.0.0.1:9000"
		c.set(&cfg)
		if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), c.name) {
			t.Errorf("%s: %v; want an error naming it", c.name, err)
		}
	}
	cfg := proxy.DefaultConfig()
	cfg.Upstream = "http://127.0.0.1:9000"
	if err := cfg.Validate(); err != nil {
		t.Errorf("defaults: %v", err)
	}
}

// TestUpstreamWithUserInfoIsRefused: the proxy never sent an upstream URL's
// user-info (it was dropped silently), and logged its password.
func TestUpstreamWithUserInfoIsRefused(t *testing.T) {
	cfg := proxy.DefaultConfig()
	cfg.Upstream = "http://svc:hunter2@127.0.0.1:9000"
	err := cfg.Validate()
	if err == nil || strings.Contains(err.Error(), "hunter2") || !strings.Contains(err.Error(), "user") {
		t.Errorf("upstream with user-info: %v; want it refused, without its password", err)
	}
}

// TestUpstreamWithASlashInItsPasswordIsRefused: the check that refuses an
// upstream URL with user-info (and never shows its password) was passed by
// a password with an unencoded / at its start: url.Parse reads "svc:" as
// host:port, so the proxy accepted it, sent every request to host "svc"
// under the path "/hunter2@127.0.0.1:9000/…", and logged the password whole
// in its start-up line. An @ in the path of an upstream without a port is
// no user-info, and one with a port takes it encoded (%40).
func TestUpstreamWithASlashInItsPasswordIsRefused(t *testing.T) {
	for _, upstream := range []string{"http://svc:/hunter2@127.0.0.1:9000", "http://svc:2024/hunter2@127.0.0.1:9000",
		"https://svc:?hunter2@127.0.0.1:9000", "http://api.example:8080/users/@hunter2"} {
		cfg := proxy.DefaultConfig()
		cfg.Upstream = upstream
		if err := cfg.Validate(); err == nil || strings.Contains(err.Error(), "hunter2") || !strings.Contains(err.Error(), "user information") {
			t.Errorf("upstream %s: %v; want it refused (user-info), without its password", upstream, err)
		}
	}
	for _, upstream := range []string{"http://api.example/users/@me", "http://api.example:8080/users/%40me", "http://[::1]:8080/users/@me"} {
		cfg := proxy.DefaultConfig()
		cfg.Upstream = upstream
		if err := cfg.Validate(); err != nil {
			t.Errorf("upstream %s: %v; want it accepted", upstream, err)
		}
	}
}
