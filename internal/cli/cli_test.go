package cli

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func envOf(m map[string]string) Env { return func(k string) string { return m[k] } }

func TestConfigPrecedence(t *testing.T) {
	path := filepath.Join(t.TempDir(), "idem.yaml")
	yaml := `
listen: 127.0.0.1:1111
upstream: http://127.0.0.1:9000
store: sqlite:from-file.db
lease: 10s
retention: 72h
defaults:
  scope_header: X-Api-Key
routes:
  - match: POST /v1/charges
    require_key: true
    takeover_safe: true
    wait: 2s
    exclude_fields: [client_ts]
`
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	env := envOf(map[string]string{"IDEM_CONFIG": path, "IDEM_LISTEN": "127.0.0.1:2222", "IDEM_LEASE": "20s", "IDEM_STORE": "memory:"})
	cfg, _, err := loadProxyConfig([]string{"--listen", "127.0.0.1:3333", "--require-key"}, env, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Listen != "127.0.0.1:3333" {
		t.Errorf("listen = %q: the flag wins over env and file", cfg.Listen)
	}
	if cfg.Lease != 20*time.Second || cfg.Store != "memory:" {
		t.Errorf("lease %v, store %q: env wins over the file", cfg.Lease, cfg.Store)
	}
	if cfg.Retention != 72*time.Hour || cfg.Upstream != "http://127.0.0.1:9000" || cfg.Defaults.ScopeHeader != "X-Api-Key" {
		t.Errorf("file values lost: %+v", cfg)
	}
	if cfg.Defaults.RequireKey == nil || !*cfg.Defaults.RequireKey {
		t.Errorf("--require-key not applied")
	}
	r := cfg.Routes[0]
	if len(cfg.Routes) != 1 || r.Match != "POST /v1/charges" || !*r.RequireKey || !*r.TakeoverSafe || r.Wait != 2*time.Second || r.ExcludeFields[0] != "client_ts" {
		t.Errorf("route = %+v", r)
	}
}

func TestConfigErrors(t *testing.T) {
	dir := t.TempDir()
	unknown := filepath.Join(dir, "unknown.yaml")
	os.WriteFile(unknown, []byte("upstream: http://x\nlisten_addr: oops\n"), 0o600)
	for name, c := range map[string]struct {
		args []string
		env  map[string]string
		want string
	}{
		"bad flag duration": {[]string{"--lease", "soon"}, nil, "--lease"},
		"bad env duration":  {nil, map[string]string{"IDEM_RETENTION": "forever"}, "IDEM_RETENTION"},
		"bad bool":          {nil, map[string]string{"IDEM_REQUIRE_KEY": "perhaps"}, "IDEM_REQUIRE_KEY"},
		"unknown yaml key":  {[]string{"--config", unknown}, nil, "listen_addr"},
		"missing file":      {[]string{"--config", filepath.Join(dir, "nope.yaml")}, nil, "nope.yaml"},
		"stray argument":    {[]string{"extra"}, nil, "extra"},
		"bad log format":    {[]string{"--log-format", "xml"}, nil, "xml"},
	} {
		_, _, err := loadProxyConfig(c.args, envOf(c.env), io.Discard)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err = %v, want it to mention %q", name, err, c.want)
		}
	}
}

func TestMainUsage(t *testing.T) {
	var out, errOut strings.Builder
	if code := Main(context.Background(), nil, envOf(nil), &out, &errOut); code != 2 || !strings.Contains(errOut.String(), "Usage") {
		t.Errorf("no args: %d %q", code, errOut.String())
	}
	if code := Main(context.Background(), []string{"frobnicate"}, envOf(nil), &out, &errOut); code != 2 || !strings.Contains(errOut.String(), "frobnicate") {
		t.Errorf("unknown command: %d", code)
	}
	errOut.Reset()
	if code := Main(context.Background(), []string{"proxy"}, envOf(nil), &out, &errOut); code != 2 || !strings.Contains(errOut.String(), "no upstream") {
		t.Errorf("proxy without upstream: %d %q", code, errOut.String())
	}
}
