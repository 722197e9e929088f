package proxy_test

import (
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem/internal/proxy"
)

// TestValidateRefusesNegativeLimits: a negative timeout or header limit is
// refused, naming its setting. (A negative upstream timeout cut every
// response at once, so successful requests became UNKNOWN; the server's
// negative timeouts meant none at all.)
func TestValidateRefusesNegativeLimits(t *testing.T) {
	for name, set := range map[string]func(*proxy.Config){
		"upstream_timeout":    func(c *proxy.Config) { c.UpstreamTimeout = -time.Second },
		"shutdown_timeout":    func(c *proxy.Config) { c.ShutdownTimeout = -time.Second },
		"read_header_timeout": func(c *proxy.Config) { c.ReadHeaderTimeout = -time.Second },
		"read_timeout":        func(c *proxy.Config) { c.ReadTimeout = -time.Second },
		"write_timeout":       func(c *proxy.Config) { c.WriteTimeout = -time.Second },
		"idle_timeout":        func(c *proxy.Config) { c.IdleTimeout = -time.Second },
		"max_header_bytes":    func(c *proxy.Config) { c.MaxHeaderBytes = -1 },
	} {
		cfg := proxy.DefaultConfig()
		cfg.Upstream = "http://127.0.0.1:9000"
		set(&cfg)
		if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("%s negative: %v; want an error naming it", name, err)
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
