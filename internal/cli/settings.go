package cli

import (
	"encoding"
	"fmt"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/idemhq/idem/internal/proxy"
)

// setting is one option of the proxy's configuration, spelled three ways: a
// YAML key, an IDEM_* variable and a flag. The settings are found by walking
// proxy.Config (which is made of idem.Config and httpidem.Config) by their
// YAML names, so an option added to those structs is reachable at once from
// every face; only its help line is written here.
type setting struct {
	yaml  string // the YAML path: "store_timeout", "defaults.wait"
	flag  string // the flag: "store-timeout", "wait"; repeatable ones are singular ("method")
	env   string // IDEM_STORE_TIMEOUT, IDEM_WAIT
	field func(*proxy.Config) reflect.Value
	typ   reflect.Type
}

// settingHelp is each setting's help line, by its last YAML name.
var settingHelp = map[string]string{
	"listen":              "address to serve the proxied API on",
	"upstream":            "URL of the API behind the proxy (required)",
	"store":               "store DSN: sqlite:PATH, postgres://…, redis://…, redis+cluster://…, dynamodb://…, memcached://…, memory:",
	"admin_listen":        "address of /healthz, /readyz and /metrics (empty: off)",
	"upstream_timeout":    "wait for the upstream's response headers; past it the outcome is unknown",
	"shutdown_timeout":    "how long SIGTERM lets in-flight requests finish and the journal empty",
	"lease":               "lease length, renewed while the upstream works",
	"retention":           "how long outcomes are replayed",
	"poll":                "how often a waiting duplicate looks again when nothing wakes it",
	"store_timeout":       "bound on each store call for a request, retries included",
	"journal_dir":         "directory where outcomes wait while the store is unreachable (none: memory only)",
	"read_header_timeout": "bound on reading a request's headers",
	"read_timeout":        "bound on reading a whole request, body included",
	"write_timeout":       "bound from a request's headers to the end of its response; keep it above upstream-timeout + wait",
	"idle_timeout":        "close a kept-alive client connection idle this long",
	"max_header_bytes":    "the largest request headers accepted, in bytes",
	"methods":             "methods covered (repeatable, or comma-separated)",
	"require_key":         "answer 400 to covered requests without a key",
	"key_format":          "keys accepted: any or uuid",
	"scope_headers":       "headers whose SHA-256 scopes keys per caller (repeatable), or none",
	"canonical_json":      "fingerprint JSON bodies in their RFC 8785 canonical form",
	"include_fields":      "fingerprint only these JSON members, dotted (repeatable)",
	"exclude_fields":      "leave these JSON members out of the fingerprint, dotted (repeatable)",
	"max_request_body":    "the largest request body accepted, in bytes",
	"max_response_body":   "the largest response body stored for replay, in bytes",
	"store_headers":       "store and replay only these response headers (repeatable; default all but credentials and hop-by-hop)",
	"wait":                "let a duplicate wait this long for the first request's outcome before a 409 (negative: 409 at once)",
	"takeover_safe":       "the upstream commits all its effects atomically: an expired lease may be taken over",
	"fail_open":           "run requests unprotected when the store cannot be reached, instead of 503",
}

// yamlOnly are the YAML names that are not flags: routes have their own
// lists, and a route's lease and retention are the engine's flags.
var yamlOnly = map[string]bool{"routes": true, "defaults.match": true, "defaults.bypass": true,
	"defaults.lease": true, "defaults.retention": true}

// proxySettings lists the settings of proxy.Config.
func proxySettings() []setting {
	var out []setting
	var walk func(t reflect.Type, path []int, prefix string)
	walk = func(t reflect.Type, path []int, prefix string) {
		for i := range t.NumField() {
			f := t.Field(i)
			tag, opts, _ := strings.Cut(f.Tag.Get("yaml"), ",")
			if tag == "-" || !f.IsExported() {
				continue
			}
			p := append(slices.Clone(path), i)
			if opts == "inline" {
				walk(f.Type, p, prefix)
				continue
			}
			name := prefix + tag
			if yamlOnly[name] {
				continue
			}
			if f.Type.Kind() == reflect.Struct && f.Type != reflect.TypeFor[time.Duration]() {
				walk(f.Type, p, name+".")
				continue
			}
			short := tag
			flagName := strings.ReplaceAll(short, "_", "-")
			if f.Type.Kind() == reflect.Slice {
				flagName = strings.TrimSuffix(flagName, "s")
			}
			out = append(out, setting{yaml: name, flag: flagName, env: "IDEM_" + strings.ToUpper(short), typ: f.Type,
				field: func(c *proxy.Config) reflect.Value { return reflect.ValueOf(c).Elem().FieldByIndex(p) }})
		}
	}
	walk(reflect.TypeFor[proxy.Config](), nil, "")
	return out
}

var textUnmarshaler = reflect.TypeFor[encoding.TextUnmarshaler]()

// set parses v into the setting's field of cfg. A list replaces what was
// there when reset, and is added to otherwise (a repeated flag).
func (s setting) set(cfg *proxy.Config, v string, reset bool) error {
	f := s.field(cfg)
	if f.Addr().Type().Implements(textUnmarshaler) {
		return f.Addr().Interface().(encoding.TextUnmarshaler).UnmarshalText([]byte(v))
	}
	switch {
	case f.Type() == reflect.TypeFor[time.Duration]():
		d, err := time.ParseDuration(v)
		if err != nil {
			return fmt.Errorf("%q is not a duration such as 30s or 24h", v)
		}
		f.SetInt(int64(d))
	case f.Kind() == reflect.String:
		f.SetString(v)
	case f.Kind() == reflect.Bool:
		b, err := strconv.ParseBool(v)
		if err != nil {
			return fmt.Errorf("%q is not true or false", v)
		}
		f.SetBool(b)
	case f.Kind() == reflect.Int || f.Kind() == reflect.Int64:
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 {
			return fmt.Errorf("%q is not a number of bytes", v)
		}
		f.SetInt(n)
	case f.Kind() == reflect.Slice && f.Type().Elem().Kind() == reflect.String:
		var items []string
		for _, item := range strings.Split(v, ",") {
			if item = strings.TrimSpace(item); item != "" {
				items = append(items, item)
			}
		}
		if !reset {
			items = append(f.Interface().([]string), items...)
		}
		f.Set(reflect.ValueOf(items))
	default:
		return fmt.Errorf("setting %s has a type (%s) this command cannot parse", s.yaml, f.Type())
	}
	return nil
}

// show formats the setting's value in cfg for help text.
func (s setting) show(cfg *proxy.Config) string {
	v := s.field(cfg).Interface()
	switch x := v.(type) {
	case []string:
		if len(x) == 0 {
			return "none"
		}
		return strings.Join(x, ",")
	case string:
		if x == "" {
			return "none"
		}
	}
	return fmt.Sprint(v)
}

// flagSetting is a setting's flag: its text until the settings are applied
// in order (file, environment, flags).
type flagSetting struct {
	s      setting
	values []string
}

func (f *flagSetting) String() string { return strings.Join(f.values, ",") }
func (f *flagSetting) Set(v string) error {
	f.values = append(f.values, v)
	return nil
}
func (f *flagSetting) IsBoolFlag() bool { return f.s.typ.Kind() == reflect.Bool }

// decodeProxyYAML reads a configuration file over cfg, which holds the
// defaults: keys present change what they name, and every route starts from
// the file's defaults. Unknown keys are errors.
func decodeProxyYAML(data []byte, cfg *proxy.Config) error {
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return err
	}
	if len(doc.Content) == 0 {
		return nil // an empty file
	}
	top := doc.Content[0]
	var routes *yaml.Node
	if top.Kind == yaml.MappingNode {
		for i := 0; i+1 < len(top.Content); i += 2 {
			if top.Content[i].Value == "routes" {
				routes = top.Content[i+1]
				top.Content = slices.Delete(top.Content, i, i+2)
				break
			}
		}
	}
	if err := strictDecode(top, cfg); err != nil {
		return err
	}
	if routes == nil {
		return nil
	}
	if routes.Kind != yaml.SequenceNode {
		return fmt.Errorf("line %d: routes must be a list", routes.Line)
	}
	cfg.Routes = nil
	for _, n := range routes.Content {
		r := cfg.Defaults
		r.Match = ""
		if err := strictDecode(n, &r); err != nil {
			return err
		}
		cfg.Routes = append(cfg.Routes, r)
	}
	return nil
}

// strictDecode decodes n into v after checking that every key in n names a
// setting of v: an unknown key is an error that names its line.
func strictDecode(n *yaml.Node, v any) error {
	if err := checkKeys(n, reflect.TypeOf(v).Elem(), ""); err != nil {
		return err
	}
	return n.Decode(v)
}

// yamlFields maps the YAML names of t's fields, inline ones included, to
// their types.
func yamlFields(t reflect.Type, into map[string]reflect.Type) {
	for i := range t.NumField() {
		f := t.Field(i)
		tag, opts, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		switch {
		case tag == "-" || !f.IsExported():
		case opts == "inline":
			yamlFields(f.Type, into)
		case tag != "":
			into[tag] = f.Type
		}
	}
}

// checkKeys reports the first key of n that names no setting of t.
func checkKeys(n *yaml.Node, t reflect.Type, where string) error {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch {
	case n.Kind == yaml.MappingNode && t.Kind() == reflect.Struct && t != reflect.TypeFor[time.Duration]():
		fields := map[string]reflect.Type{}
		yamlFields(t, fields)
		for i := 0; i+1 < len(n.Content); i += 2 {
			key := n.Content[i].Value
			ft, ok := fields[key]
			if !ok {
				known := make([]string, 0, len(fields))
				for k := range fields {
					known = append(known, k)
				}
				slices.Sort(known)
				return fmt.Errorf("line %d: %s is not a setting%s (settings: %s)", n.Content[i].Line, key, where, strings.Join(known, ", "))
			}
			if err := checkKeys(n.Content[i+1], ft, " of "+key); err != nil {
				return err
			}
		}
	case n.Kind == yaml.SequenceNode && t.Kind() == reflect.Slice:
		for _, item := range n.Content {
			if err := checkKeys(item, t.Elem(), where); err != nil {
				return err
			}
		}
	}
	return nil
}
