package cli

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/internal/proxy"
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
  scope_headers: [X-Api-Key]
  canonical_json: true
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
	if cfg.Engine.Lease != 20*time.Second || cfg.Store != "memory:" {
		t.Errorf("lease %v, store %q: env wins over the file", cfg.Engine.Lease, cfg.Store)
	}
	if cfg.Engine.Retention != 72*time.Hour || cfg.Upstream != "http://127.0.0.1:9000" || !slices.Equal(cfg.Defaults.ScopeHeaders, []string{"X-Api-Key"}) {
		t.Errorf("file values lost: %+v", cfg)
	}
	if !cfg.Defaults.RequireKey {
		t.Errorf("--require-key not applied")
	}
	if cfg.Engine.StoreTimeout != idem.DefaultStoreTimeout || cfg.Defaults.MaxRequestBody != httpidem.DefaultMaxRequestBody {
		t.Errorf("defaults not taken from their constants: %+v", cfg)
	}
	r := cfg.Routes[0]
	if len(cfg.Routes) != 1 || r.Match != "POST /v1/charges" || !r.RequireKey || !r.TakeoverSafe || r.Wait != 2*time.Second || r.ExcludeFields[0] != "client_ts" {
		t.Errorf("route = %+v", r)
	}
	if !r.CanonicalJSON || !slices.Equal(r.ScopeHeaders, []string{"X-Api-Key"}) || !slices.Equal(r.Methods, httpidem.DefaultMethods()) {
		t.Errorf("the route did not start from the file's defaults: %+v", r)
	}
}

func TestConfigErrors(t *testing.T) {
	dir := t.TempDir()
	unknown := filepath.Join(dir, "unknown.yaml")
	os.WriteFile(unknown, []byte("upstream: http://x\nlisten_addr: oops\n"), 0o600)
	unknownInRoute := filepath.Join(dir, "route.yaml")
	os.WriteFile(unknownInRoute, []byte("upstream: http://x\nroutes:\n  - match: /a\n    wiat: 2s\n"), 0o600)
	for name, c := range map[string]struct {
		args []string
		env  map[string]string
		want string
	}{
		"bad flag duration":      {[]string{"--lease", "soon"}, nil, "--lease"},
		"bad env duration":       {nil, map[string]string{"IDEM_RETENTION": "forever"}, "IDEM_RETENTION"},
		"bad bool":               {nil, map[string]string{"IDEM_REQUIRE_KEY": "perhaps"}, "IDEM_REQUIRE_KEY"},
		"bad key format":         {[]string{"--key-format", "ulid"}, nil, "any or uuid"},
		"unknown yaml key":       {[]string{"--config", unknown}, nil, "line 2: listen_addr is not a setting"},
		"unknown key in a route": {[]string{"--config", unknownInRoute}, nil, "line 4: wiat is not a setting"},
		"missing file":           {[]string{"--config", filepath.Join(dir, "nope.yaml")}, nil, "nope.yaml"},
		"stray argument":         {[]string{"extra"}, nil, "extra"},
		"bad log format":         {[]string{"--log-format", "xml"}, nil, "xml"},
	} {
		_, _, err := loadProxyConfig(c.args, envOf(c.env), io.Discard)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err = %v, want it to mention %q", name, err, c.want)
		}
	}
}

// TestEveryOptionIsReachable: every option of the engine's and the
// middleware's configuration that is data can be set by a YAML key, an
// IDEM_* variable and a flag, and each of them changes it. (A route's lease
// and retention are the engine's flags, and per route in the file.)
func TestEveryOptionIsReachable(t *testing.T) {
	settings := map[string]setting{}
	for _, s := range proxySettings() {
		settings[strings.TrimPrefix(s.yaml, "defaults.")] = s
		if settingHelp[strings.TrimPrefix(s.yaml, "defaults.")] == "" {
			t.Errorf("setting %s has no help line", s.yaml)
		}
	}
	for _, typ := range []reflect.Type{reflect.TypeFor[idem.Config](), reflect.TypeFor[httpidem.Config]()} {
		for i := range typ.NumField() {
			f := typ.Field(i)
			name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
			switch {
			case name == "-":
				if k := f.Type.Kind(); k != reflect.Func && k != reflect.Interface && k != reflect.Pointer {
					t.Errorf("%s.%s is data, yet has no YAML name", typ, f.Name)
				}
				continue
			case name == "":
				t.Errorf("%s.%s has no YAML name", typ, f.Name)
				continue
			}
			s, ok := settings[name]
			if !ok {
				t.Errorf("%s.%s (%s) has no flag or variable", typ, f.Name, name)
				continue
			}
			value := map[reflect.Kind]string{reflect.String: "/tmp/x", reflect.Bool: "true", reflect.Int64: "12345",
				reflect.Int: "12345", reflect.Slice: "A,B"}[f.Type.Kind()]
			if f.Type == reflect.TypeFor[time.Duration]() {
				value = "7s"
			}
			if f.Type == reflect.TypeFor[httpidem.KeyFormat]() {
				value = "uuid"
			}
			base := proxy.DefaultConfig()
			for how, args := range map[string][]string{"flag": {"--" + s.flag + "=" + value}, "env": nil} {
				env := map[string]string{}
				if how == "env" {
					env[s.env] = value
				}
				got, _, err := loadProxyConfig(args, envOf(env), io.Discard)
				if err != nil {
					t.Errorf("%s by %s: %v", name, how, err)
					continue
				}
				if reflect.DeepEqual(s.field(&got).Interface(), s.field(&base).Interface()) {
					t.Errorf("%s by %s %q changed nothing", name, how, value)
				}
			}
			path := filepath.Join(t.TempDir(), "c.yaml")
			prefix, indent := "", ""
			if strings.HasPrefix(s.yaml, "defaults.") {
				prefix, indent = "defaults:\n", "  "
			}
			yamlValue := value
			if f.Type.Kind() == reflect.Slice {
				yamlValue = "[A, B]"
			}
			os.WriteFile(path, []byte(prefix+indent+name+": "+yamlValue+"\n"), 0o600)
			got, _, err := loadProxyConfig([]string{"--config", path}, envOf(nil), io.Discard)
			if err != nil {
				t.Errorf("%s in YAML: %v", name, err)
			} else if reflect.DeepEqual(s.field(&got).Interface(), s.field(&base).Interface()) {
				t.Errorf("%s in YAML changed nothing", name)
			}
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
