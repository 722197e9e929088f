package cli

import (
	"cmp"
	"context"
	"io"
	"maps"
	"net"
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
	"github.com/idemhq/idem/internal/testkit"
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
	cfg, _, err := loadProxyConfig([]string{"--listen", "127.0.0.1:3333", "--require-key"}, env, io.Discard, io.Discard)
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

// TestConfigErrors: a wrong configuration, whichever face gives it, is a
// usage error (exit status 2) that names the setting and, in a file, its
// line; it never starts anything.
func TestConfigErrors(t *testing.T) {
	dir := t.TempDir()
	file := func(name, content string) string {
		path := filepath.Join(dir, name)
		os.WriteFile(path, []byte(content), 0o600)
		return path
	}
	for name, c := range map[string]struct {
		args []string
		env  map[string]string
		want string
	}{
		"bad flag duration":      {[]string{"--lease", "soon"}, nil, `--lease: "soon" is not a duration`},
		"bad env duration":       {nil, map[string]string{"IDEM_RETENTION": "forever"}, "$IDEM_RETENTION"},
		"bad bool":               {nil, map[string]string{"IDEM_REQUIRE_KEY": "perhaps"}, "$IDEM_REQUIRE_KEY"},
		"bad key format":         {[]string{"--key-format", "ulid"}, nil, "any or uuid"},
		"bad size":               {[]string{"--max-request-body", "2 potatoes"}, nil, "not a size such as"},
		"unknown yaml key":       {[]string{"--config", file("unknown.yaml", "upstream: http://x\nlisten_addr: oops\n")}, nil, "line 2: listen_addr is not a setting"},
		"unknown key in a route": {[]string{"--config", file("route.yaml", "upstream: http://x\nroutes:\n  - match: /a\n    wiat: 2s\n")}, nil, "line 4: wiat is not a setting of a route"},
		"bad yaml duration":      {[]string{"--config", file("lease.yaml", "upstream: http://x\nlease: soon\n")}, nil, `line 2: lease: "soon" is not a duration`},
		"bad yaml key format":    {[]string{"--config", file("format.yaml", "upstream: http://x\nkey_format: ulid\n")}, nil, "line 2: key_format"},
		"yaml list for a value":  {[]string{"--config", file("list.yaml", "upstream: http://x\nlease: [1s]\n")}, nil, "line 2: lease takes a single value"},
		"yaml that is not yaml":  {[]string{"--config", file("broken.yaml", "upstream: [\n")}, nil, "line"},
		"missing file":           {[]string{"--config", filepath.Join(dir, "nope.yaml")}, nil, "nope.yaml"},
		"stray argument":         {[]string{"extra"}, nil, `unexpected argument "extra"`},
		"unknown flag":           {[]string{"--listn", ":1"}, nil, "unknown flag --listn"},
		"bad log format":         {[]string{"--log-format", "xml"}, nil, "xml"},
		"bad route pattern":      {[]string{"--config", file("pattern.yaml", "upstream: http://x\nroutes:\n  - match: POST\n")}, nil, "route"},
		"no upstream":            {nil, nil, "no upstream"},
		"bad listen":             {[]string{"--listen", "not-an-address"}, nil, `listen "not-an-address"`},
		"bad admin listen":       {nil, map[string]string{"IDEM_ADMIN_LISTEN": "9090"}, `admin_listen "9090"`},
	} {
		var stderr strings.Builder
		env := map[string]string{"IDEM_UPSTREAM": "http://127.0.0.1:9000"}
		if name == "no upstream" || slices.Contains(c.args, "--config") {
			env = map[string]string{}
		}
		maps.Copy(env, c.env)
		code := Main(context.Background(), append([]string{"proxy", "--store", "memory:"}, c.args...), envOf(env), io.Discard, &stderr)
		if code != 2 || !strings.Contains(stderr.String(), c.want) || strings.Contains(stderr.String(), "proxy.Config") {
			t.Errorf("%s: exit %d, %q; want exit 2 and a message saying %q", name, code, stderr.String(), c.want)
		}
	}
}

// TestSizesAreReadable: sizes are given in bytes or with a unit, and help
// shows them with one.
func TestSizesAreReadable(t *testing.T) {
	path := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(path, []byte("upstream: http://x\ndefaults:\n  max_request_body: 2MiB\n"), 0o600)
	cfg, _, err := loadProxyConfig([]string{"--config", path, "--max-response-body", "512KiB", "--max-header-bytes", "16000"}, envOf(nil), io.Discard, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Defaults.MaxRequestBody != 2<<20 || cfg.Defaults.MaxResponseBody != 512<<10 || cfg.MaxHeaderBytes != 16000 {
		t.Fatalf("sizes: %d %d %d", cfg.Defaults.MaxRequestBody, cfg.Defaults.MaxResponseBody, cfg.MaxHeaderBytes)
	}
	for in, want := range map[string]int64{"1048576": 1 << 20, "1MiB": 1 << 20, "1 MB": 1e6, "3kib": 3 << 10, "7B": 7} {
		if got, err := parseSize(in); err != nil || got != want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "MiB", "1.5MiB", "9999999999999GiB"} {
		if _, err := parseSize(bad); err == nil {
			t.Errorf("parseSize(%q) accepted it", bad)
		}
	}
	if formatSize(2<<20) != "2MiB" || formatSize(1000) != "1000" {
		t.Errorf("formatSize: %s %s", formatSize(2<<20), formatSize(1000))
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
			value = cmp.Or(map[string]string{"upstream": "http://upstream.test:9000", "log_format": "json"}[name], value)
			// A configuration must name an upstream to be valid.
			needed := map[string]string{"IDEM_UPSTREAM": "http://127.0.0.1:9000"}
			if name == "upstream" {
				needed = nil
			}
			base := proxy.DefaultConfig()
			for how, args := range map[string][]string{"flag": {"--" + s.flag + "=" + value}, "env": nil} {
				env := maps.Clone(needed)
				if env == nil {
					env = map[string]string{}
				}
				if how == "env" {
					env[s.env] = value
				}
				got, _, err := loadProxyConfig(args, envOf(env), io.Discard, io.Discard)
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
			got, _, err := loadProxyConfig([]string{"--config", path}, envOf(needed), io.Discard, io.Discard)
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

// TestPortInUseNamesTheSetting: an address already taken is named with the
// setting that chose it (the demo has three listeners; the error said
// "bind: address already in use" and nothing of which).
func TestPortInUseNamesTheSetting(t *testing.T) {
	held, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	addr := held.Addr().String()
	dir := t.TempDir()
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"proxy", "--store", "memory:", "--upstream", "http://127.0.0.1:9", "--listen", addr}, "listen (--listen, $IDEM_LISTEN)"},
		{[]string{"proxy", "--store", "memory:", "--upstream", "http://127.0.0.1:9", "--listen", "127.0.0.1:0", "--admin-listen", addr}, "admin_listen (--admin-listen"},
		{[]string{"demo", "--store", "sqlite:" + filepath.Join(dir, "demo.db"), "--listen", "127.0.0.1:0", "--admin-listen", "", "--acquirer-listen", addr}, "--acquirer-listen " + addr},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		stderr := new(testkit.SyncBuffer) // the proxy's health check may log as it fails
		code := Main(ctx, c.args, envOf(nil), io.Discard, stderr)
		cancel()
		if code == 0 || !strings.Contains(stderr.String(), c.want) || !strings.Contains(stderr.String(), "address already in use") {
			t.Errorf("%s with %s taken: exit %d, %q; want it named as %q", c.args[0], addr, code, stderr.String(), c.want)
		}
	}
}
