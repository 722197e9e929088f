package cli

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/internal/proxy"
)

// writeFile writes content to a file named name in a temporary directory,
// and returns its path.
func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestRulesFromFlagsAndEnvReachRoutes: every route starts from the
// defaults as the environment and flags leave them, not as the file wrote
// them; what a route says itself still wins.
func TestRulesFromFlagsAndEnvReachRoutes(t *testing.T) {
	path := writeFile(t, "idem.yaml", `upstream: http://127.0.0.1:9000
defaults:
  max_request_body: 2MiB
routes:
  - match: POST /v1/charges
    canonical_json: true
  - match: POST /v1/refunds
    scope_headers: [X-Tenant]
    fail_open: false
`)
	cfg, _, err := loadProxyConfig([]string{"--config", path, "--require-key", "--scope-header", "X-Api-Key"},
		envOf(map[string]string{"IDEM_FAIL_OPEN": "true", "IDEM_KEY_FORMAT": "uuid"}), io.Discard, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	charges, refunds := cfg.Routes[0], cfg.Routes[1]
	if !charges.RequireKey || !slices.Equal(charges.ScopeHeaders, []string{"X-Api-Key"}) || !charges.FailOpen ||
		charges.KeyFormat != httpidem.KeyUUID || !charges.CanonicalJSON || charges.MaxRequestBody != 2<<20 {
		t.Errorf("route %s: require_key=%v scope=%v fail_open=%v key_format=%v canonical=%v max_request_body=%d; want the flags' and variables' rules over the file's defaults",
			charges.Match, charges.RequireKey, charges.ScopeHeaders, charges.FailOpen, charges.KeyFormat, charges.CanonicalJSON, charges.MaxRequestBody)
	}
	if !refunds.RequireKey || !slices.Equal(refunds.ScopeHeaders, []string{"X-Tenant"}) || refunds.FailOpen {
		t.Errorf("route %s: require_key=%v scope=%v fail_open=%v; want what the route says to win over flags and variables",
			refunds.Match, refunds.RequireKey, refunds.ScopeHeaders, refunds.FailOpen)
	}
}

// TestHelpShowsNoSecret: --help shows the defaults of flags, never a DSN's
// password or a resolver URL's from the environment; the environment still
// applies when the flag is not given.
func TestHelpShowsNoSecret(t *testing.T) {
	env := envOf(map[string]string{"IDEM_STORE": "postgres://idem:hunter2@db:5432/pay",
		"IDEM_RESOLVER_URL": "https://ops:resolverpw@api/idem/resolve", "IDEM_RETENTION": "72h"})
	for _, args := range [][]string{{"keys", "ls", "--help"}, {"keys", "resolve", "--help"}, {"reconcile", "--help"}} {
		var out bytes.Buffer
		Main(context.Background(), args, env, &out, io.Discard)
		for _, s := range []string{"hunter2", "resolverpw"} {
			if strings.Contains(out.String(), s) {
				t.Errorf("%v prints %q: %s", args, s, grepLine(out.String(), s))
			}
		}
	}
}

func grepLine(s, w string) string {
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, w) {
			return l
		}
	}
	return ""
}

// TestEmptyListsAreRefused: a list left empty would turn a protection off
// (one scope for every caller, every header stored, no journal) and faces
// read it differently; the flags and the file refuse it and say to write
// none. (A variable set to "" cannot be told from one unset: it is unset.)
func TestEmptyListsAreRefused(t *testing.T) {
	for name, c := range map[string]struct {
		args []string
		env  map[string]string
	}{
		"flag":              {[]string{"--scope-header="}, nil},
		"env commas":        {nil, map[string]string{"IDEM_SCOPE_HEADERS": " , "}},
		"yaml []":           {[]string{"--config", writeFile(t, "a.yaml", "upstream: http://x\ndefaults:\n  scope_headers: []\n")}, nil},
		"yaml null":         {[]string{"--config", writeFile(t, "b.yaml", "upstream: http://x\ndefaults:\n  scope_headers:\n")}, nil},
		"yaml route []":     {[]string{"--config", writeFile(t, "c.yaml", "upstream: http://x\nroutes:\n  - match: /a\n    scope_headers: []\n")}, nil},
		"yaml store_header": {[]string{"--config", writeFile(t, "d.yaml", "upstream: http://x\ndefaults:\n  store_headers: []\n")}, nil},
		"yaml journal":      {[]string{"--config", writeFile(t, "e.yaml", "upstream: http://x\njournal_dir: \"\"\n")}, nil},
		"flag journal":      {[]string{"--journal-dir="}, nil},
		"flag methods":      {[]string{"--method="}, nil},
	} {
		env := map[string]string{"IDEM_UPSTREAM": "http://127.0.0.1:9000"}
		for k, v := range c.env {
			env[k] = v
		}
		cfg, _, err := loadProxyConfig(c.args, envOf(env), io.Discard, io.Discard)
		want := "none"
		if strings.Contains(name, "store_header") || strings.Contains(name, "methods") {
			want = "leave the setting out for the default" // none is no value of theirs
		}
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: scope %q, store headers %q, journal %q, err %v; want an error saying %q",
				name, cfg.Defaults.ScopeHeaders, cfg.Defaults.StoreHeaders, cfg.Engine.JournalDir, err, want)
		}
	}
	// A variable set to "" is unset: the default stays.
	cfg, _, err := loadProxyConfig(nil, envOf(map[string]string{"IDEM_UPSTREAM": "http://x", "IDEM_SCOPE_HEADERS": ""}), io.Discard, io.Discard)
	if err != nil || !slices.Equal(cfg.Defaults.ScopeHeaders, []string{proxy.DefaultScopeHeader}) {
		t.Errorf("IDEM_SCOPE_HEADERS=\"\": %v %q", err, cfg.Defaults.ScopeHeaders)
	}
	// none still says none.
	cfg, _, err = loadProxyConfig([]string{"--scope-header", "none", "--journal-dir", "none"}, envOf(map[string]string{"IDEM_UPSTREAM": "http://x"}), io.Discard, io.Discard)
	if err != nil || cfg.JournalDir() != "" || !slices.Equal(cfg.Defaults.ScopeHeaders, []string{"none"}) {
		t.Errorf("none: %v %q %q", err, cfg.Defaults.ScopeHeaders, cfg.JournalDir())
	}
}

// TestNegativeDurationsAreRefused: a negative timeout is refused, naming
// its setting, in every face.
func TestNegativeDurationsAreRefused(t *testing.T) {
	for _, f := range []string{"--upstream-timeout=-1s", "--shutdown-timeout=-1s", "--read-header-timeout=-1s", "--read-timeout=-1s",
		"--write-timeout=-1s", "--idle-timeout=-1s", "--max-header-bytes=-1"} {
		_, _, err := loadProxyConfig([]string{"--upstream", "http://127.0.0.1:9", f}, envOf(nil), io.Discard, io.Discard)
		name := strings.TrimPrefix(strings.Split(f, "=")[0], "--")
		if err == nil || !strings.Contains(err.Error(), strings.ReplaceAll(name, "-", "_")) {
			t.Errorf("%s: err %v; want one naming %s", f, err, strings.ReplaceAll(name, "-", "_"))
		}
	}
}

// TestYAMLMistakesAreRefused: a key given twice, a second document, and a
// route's own keys under defaults are mistakes the file must not hide. A
// lease or retention under defaults was read, and overrode the engine's
// for every route: --retention 72h (or IDEM_RETENTION) lost to the file's
// defaults, and a retry after the file's retention ran again.
func TestYAMLMistakesAreRefused(t *testing.T) {
	for name, c := range map[string]struct{ yaml, want string }{
		"duplicate key":           {"upstream: http://x\nstore: sqlite:a.db\nstore: \"memory:\"\n", "line 3: store is given twice"},
		"duplicate in route":      {"upstream: http://x\nroutes:\n  - match: /a\n    wait: 1s\n    wait: 2s\n", "line 5: wait is given twice"},
		"second document":         {"upstream: http://x\n---\nstore: \"memory:\"\n", "one document"},
		"match under default":     {"upstream: http://x\ndefaults:\n  match: /a\n", "line 3: match"},
		"bypass under default":    {"upstream: http://x\ndefaults:\n  bypass: true\n", "line 3: bypass"},
		"route key at the top":    {"upstream: http://x\nmatch: /a\n", "line 2: match is a route's, not a setting of the file: write it in a route under routes"},
		"request rule at the top": {"upstream: http://x\nrequire_key: true\n", "line 2: require_key is a setting of requests, not of the file: write it under defaults:"},
		"lease under default":     {"upstream: http://x\ndefaults:\n  lease: 5s\n", "line 3: lease is not a setting of defaults: write it at the top level (--lease"},
		"retention under default": {"upstream: http://x\ndefaults:\n  retention: 2s\n", "line 3: retention is not a setting of defaults: write it at the top level (--retention"},
	} {
		cfg := proxy.DefaultConfig()
		err := decodeProxyYAML([]byte(c.yaml), &cfg)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err %v; want one saying %q", name, err, c.want)
		}
	}
}

// decodeProxyYAML reads a configuration file over cfg as loadProxyConfig
// does with no environment and no flags: every route over the file's
// defaults.
func decodeProxyYAML(data []byte, cfg *proxy.Config) error {
	routes, err := decodeProxyFile(data, cfg)
	if err != nil {
		return err
	}
	return routes.decode(cfg)
}

// TestConfigFlagOverridesTheEnvironment: --config, when given, names the
// file whatever IDEM_CONFIG says, and --config= names none, in idem proxy
// as in idem keys and idem reconcile (the proxy read IDEM_CONFIG's file
// when --config was given empty).
func TestConfigFlagOverridesTheEnvironment(t *testing.T) {
	broken := writeFile(t, "broken.yaml", "upstream: [not, a, url\n")
	env := func(k string) string {
		if k == "IDEM_CONFIG" {
			return broken
		}
		return ""
	}
	if _, _, err := loadProxyConfig([]string{"--config=", "--upstream", "http://127.0.0.1:9000"}, env, io.Discard, io.Discard); err != nil {
		t.Fatalf("--config= with IDEM_CONFIG naming a broken file: %v; want no file read", err)
	}
}
