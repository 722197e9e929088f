package cli

import (
	"bytes"
	"encoding"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/idemhq/idem"
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
// A word in backquotes names the flag's value in help (flag.UnquoteUsage).
var settingHelp = map[string]string{
	"listen":              "`address` to serve the proxied API on",
	"upstream":            "`URL` of the API behind the proxy",
	"store":               "the store, a `DSN`: " + storeKinds,
	"admin_listen":        "`address` of /healthz, /readyz, /metrics (Prometheus) and the console (/console/); a bare :port is on loopback",
	"admin_token":         "`token` every console action must carry; prefer the variable, as a flag shows in the process list",
	"console_read_only":   "serve the console with no action, and no token needed",
	"console_mask":        "hide keys, stored bodies, header values and checkpoint data in the console (the listing then has no key filter)",
	"audit_log":           "`file` the console's actions are appended to",
	"upstream_timeout":    "bounds each stall in sending the request, then the wait for the response headers, then for each part of its body; past it the outcome is unknown",
	"shutdown_timeout":    "one deadline from SIGTERM: /readyz goes 503, in-flight requests finish, the journal empties; keep it above upstream-timeout, and a pod's terminationGracePeriodSeconds above it (Kubernetes' default: 30s)",
	"lease":               "lease length, renewed while the upstream works",
	"retention":           "how long outcomes are replayed",
	"poll":                "how often a waiting duplicate looks again when nothing wakes it",
	"store_timeout":       "bound on each store call for a request, retries included",
	"cache_size":          "the `size` of the completed outcomes kept in memory to answer replays without the store (negative: no cache)",
	"prune_interval":      "how often settled records whose retention has run out are deleted from the store (negative: never; then run idem keys purge)",
	"journal_dir":         "`directory` where outcomes wait while the store is unreachable (none: memory only)",
	"read_header_timeout": "bound on reading a request's headers",
	"read_timeout":        "bound on reading a whole request, body included",
	"write_timeout":       "bound from a request's headers to the end of its response; keep it above upstream-timeout + wait",
	"idle_timeout":        "close a kept-alive client connection idle this long",
	"max_header_bytes":    "the largest request headers accepted",
	"methods":             "`method`s covered (repeatable, or comma-separated)",
	"require_key":         "answer 400 to covered requests without a key",
	"key_format":          "`format` of the keys accepted: any or uuid",
	"log_format":          "`format` of log lines: text or json",
	"access_log":          "log a line for every request: method, path, status, duration, what idem did, key hash",
	"scope_headers":       "`header`s whose SHA-256 scopes keys per caller (repeatable), or none",
	"canonical_json":      "fingerprint JSON bodies in their RFC 8785 canonical form (a body that is not JSON, or repeats a member's name in any case: as sent)",
	"include_fields":      "fingerprint only these JSON `member`s, dotted, names matched in any case (repeatable)",
	"exclude_fields":      "leave these JSON `member`s out of the fingerprint, dotted (repeatable)",
	"max_request_body":    "the largest request body accepted",
	"max_response_body":   "the largest response body stored for replay (a larger one is answered once, then 409)",
	"store_headers":       "store and replay only these response `header`s (repeatable)",
	"wait":                "let a duplicate wait this long for the first request's outcome before a 409 (negative: 409 at once)",
	"takeover_safe":       "an expired lease may be taken over (a retry runs the request again) instead of the record becoming UNKNOWN: only for an upstream that deduplicates on the Idempotency-Key it is sent (the proxy forwards it), since the upstream's transaction cannot hold idem's record",
	"console_remote":      "serve the console to connections from other machines than this one (its pages show stored outcomes and need no token; by default: loopback only, through an SSH tunnel or kubectl port-forward)",
	"explicit_release":    "store a 429 or 503 from the upstream and replay it like any other answer, instead of releasing the key (for an upstream that may answer 503 after acting); an upstream the proxy could not reach still releases it",
	"fail_open":           "run requests unprotected when the store cannot be reached, instead of 503 (never when it answered with an error, such as a record it cannot read, access refused or writes refused)",
}

// zeroMeans says what a setting left empty means, where that is not
// nothing, for help.
var zeroMeans = map[string]string{
	"upstream":       "required",
	"cache_size":     formatSize(idem.DefaultCacheSize),
	"admin_listen":   "off",
	"admin_token":    "none: the console is off unless read-only",
	"audit_log":      "memory only",
	"include_fields": "all",
	"store_headers":  "all but credentials and hop-by-hop",
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
			if f.Type.Kind() == reflect.Struct && f.Type != durationType {
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

var (
	textUnmarshaler = reflect.TypeFor[encoding.TextUnmarshaler]()
	durationType    = reflect.TypeFor[time.Duration]()
)

// set parses v into the setting's field of cfg. A list replaces what was
// there when reset, and is added to otherwise (a repeated flag).
func (s setting) set(cfg *proxy.Config, v string, reset bool) error {
	short := s.yaml[strings.LastIndex(s.yaml, ".")+1:]
	if noEmpty[short] && strings.TrimSpace(v) == "" {
		return emptyError(short)
	}
	return explainEmpty(short, parseValue(s.field(cfg), v, reset))
}

// errEmpty is parseValue's error for a list with nothing in it.
var errEmpty = errors.New("empty")

// noEmpty are the settings other than lists that an empty value would turn
// off without saying so.
var noEmpty = map[string]bool{"journal_dir": true}

// explainEmpty turns errEmpty into emptyError(name).
func explainEmpty(name string, err error) error {
	if errors.Is(err, errEmpty) {
		return emptyError(name)
	}
	return err
}

// emptyError says why an empty value of the setting named name (its last
// YAML name) is refused, in every face: it would turn a protection off
// without saying so (one scope for every caller, no journal), or mean its
// default while looking like "nothing".
func emptyError(name string) error {
	switch name {
	case "scope_headers":
		return fmt.Errorf("an empty list would put every caller's keys in one scope: write none for that, or leave the setting out for the default (%s)", proxy.DefaultScopeHeader)
	case "journal_dir":
		return fmt.Errorf("an empty directory would mean no journal: write none for that (outcomes then wait in memory only), or leave the setting out for the default (%s)", proxy.DefaultJournalDir)
	}
	d := proxy.DefaultConfig()
	for _, s := range proxySettings() {
		if strings.HasSuffix(s.yaml, name) && s.defaultText(&d) != "" {
			return fmt.Errorf("an empty list is refused, as it reads as none but means the default: leave the setting out for the default (%s)", s.defaultText(&d))
		}
	}
	return errors.New("an empty list is refused, as it reads as none but means the default: leave the setting out")
}

// parseValue parses v into f: the one parser of every setting, whether it
// comes from a flag, an IDEM_* variable or the YAML file. Whole numbers are
// sizes in bytes.
func parseValue(f reflect.Value, v string, reset bool) error {
	if f.Addr().Type().Implements(textUnmarshaler) {
		return f.Addr().Interface().(encoding.TextUnmarshaler).UnmarshalText([]byte(v))
	}
	switch {
	case f.Type() == durationType:
		d, err := time.ParseDuration(v)
		if err != nil {
			return fmt.Errorf("%q is not a duration such as 30s, 5m or 24h", v)
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
		n, err := parseSize(v)
		if err != nil {
			return err
		}
		f.SetInt(n)
	case f.Kind() == reflect.Slice && f.Type().Elem().Kind() == reflect.String:
		var items []string
		for _, item := range strings.Split(v, ",") {
			if item = strings.TrimSpace(item); item != "" {
				items = append(items, item)
			}
		}
		if len(items) == 0 {
			return errEmpty
		}
		if !reset {
			items = append(f.Interface().([]string), items...)
		}
		f.Set(reflect.ValueOf(items))
	default:
		return fmt.Errorf("a %s cannot be given as text", f.Type())
	}
	return nil
}

// sizeUnits are the units a size may have: SI and binary multiples.
var sizeUnits = []struct {
	name string
	n    int64
}{{"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}, {"GB", 1e9}, {"MB", 1e6}, {"KB", 1e3}, {"B", 1}}

// parseSize parses a size in bytes: 1048576, 1MiB, 512KiB, 2MB. A negative
// size is the settings' way to say "none" where they allow it.
func parseSize(v string) (int64, error) {
	num, mult := strings.TrimSpace(v), int64(1)
	for _, u := range sizeUnits {
		if len(num) > len(u.name) && strings.EqualFold(num[len(num)-len(u.name):], u.name) {
			num, mult = strings.TrimSpace(num[:len(num)-len(u.name)]), u.n
			break
		}
	}
	n, err := strconv.ParseInt(num, 10, 64)
	if err != nil || n > math.MaxInt64/mult || n < math.MinInt64/mult {
		return 0, fmt.Errorf("%q is not a size such as 1048576, 512KiB or 2MiB", v)
	}
	return n * mult, nil
}

// formatSize writes a size the way parseSize reads it, in the largest
// binary unit that divides it.
func formatSize(n int64) string {
	for _, u := range sizeUnits[:3] {
		if n >= u.n && n%u.n == 0 {
			return strconv.FormatInt(n/u.n, 10) + u.name
		}
	}
	return strconv.FormatInt(n, 10)
}

// defaultText is what help says of the setting's default in cfg.
func (s setting) defaultText(cfg *proxy.Config) string {
	if d := s.show(cfg); d != "" {
		return d
	}
	return zeroMeans[strings.TrimPrefix(s.yaml, "defaults.")]
}

// show formats the setting's value in cfg for help text, the way it would
// be given; "" for no value.
func (s setting) show(cfg *proxy.Config) string {
	f := s.field(cfg)
	switch x := f.Interface().(type) {
	case []string:
		return strings.Join(x, ",")
	case bool:
		if !x {
			return ""
		}
	case int, int64:
		if f.Int() == 0 {
			return ""
		}
		return formatSize(f.Int())
	case time.Duration:
		return formatDuration(x)
	case fmt.Stringer:
		return x.String()
	}
	return fmt.Sprint(f.Interface())
}

// formatDuration writes d without time.Duration's zero units: 1m, not 1m0s.
func formatDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = s[:len(s)-2]
	}
	if strings.HasSuffix(s, "h0m") {
		s = s[:len(s)-2]
	}
	return s
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

// placeholder names the flag's value in help, unless its usage does.
func (f *flagSetting) placeholder() string {
	switch {
	case f.s.typ == durationType:
		return "duration"
	case f.s.typ.Kind() == reflect.Int || f.s.typ.Kind() == reflect.Int64:
		return "size"
	}
	return "value"
}

// fileRoutes are the routes of a configuration file, read once the
// defaults they start from are complete (the file's, then the
// environment's and the flags'), and the settings the file gives.
type fileRoutes struct {
	node *yaml.Node
	// set holds the settings the file gives, by their YAML path
	// ("store_timeout", "defaults.wait").
	set map[string]bool
}

// decodeProxyFile reads a configuration file over cfg, all but its routes,
// which it returns to be read over the final defaults.
func decodeProxyFile(data []byte, cfg *proxy.Config) (fileRoutes, error) {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc, extra yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return fileRoutes{}, nil // an empty file
		}
		return fileRoutes{}, errors.New(strings.TrimPrefix(err.Error(), "yaml: "))
	}
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		line := extra.Line
		if err != nil {
			return fileRoutes{}, errors.New(strings.TrimPrefix(err.Error(), "yaml: "))
		}
		return fileRoutes{}, fmt.Errorf("line %d: a second document (---): the file is one document", line)
	}
	if len(doc.Content) == 0 {
		return fileRoutes{}, nil
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
	if err := decodeNode(top, reflect.ValueOf(cfg).Elem(), "the file"); err != nil {
		return fileRoutes{}, err
	}
	if routes != nil && routes.Kind != yaml.SequenceNode {
		return fileRoutes{}, fmt.Errorf("line %d: routes must be a list", routes.Line)
	}
	set := map[string]bool{}
	for i := 0; top.Kind == yaml.MappingNode && i+1 < len(top.Content); i += 2 {
		name, value := top.Content[i].Value, top.Content[i+1]
		set[name] = true
		for j := 0; name == "defaults" && value.Kind == yaml.MappingNode && j+1 < len(value.Content); j += 2 {
			set["defaults."+value.Content[j].Value] = true
		}
	}
	return fileRoutes{routes, set}, nil
}

// decode reads the routes into cfg.Routes, each over cfg.Defaults.
func (rs fileRoutes) decode(cfg *proxy.Config) error {
	if rs.node == nil {
		return nil
	}
	cfg.Routes = nil
	for _, n := range rs.node.Content {
		r := cfg.Defaults
		r.Match = ""
		if err := decodeNode(n, reflect.ValueOf(&r).Elem(), "a route"); err != nil {
			return err
		}
		cfg.Routes = append(cfg.Routes, r)
	}
	return nil
}

// requestSetting reports whether key names a setting of requests (a
// route's, httpidem.Config's), which a file gives under defaults or routes.
func requestSetting(key string) bool {
	fields := map[string]reflect.Value{}
	yamlFields(reflect.ValueOf(&proxy.Route{}).Elem(), fields)
	_, ok := fields[key]
	return ok
}

// decodeNode reads n into v (named name in errors): a mapping into a
// struct by the fields' YAML names, a list or a comma-separated scalar into
// a list, and any other scalar by parseValue.
func decodeNode(n *yaml.Node, v reflect.Value, name string) error {
	if n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	switch {
	case v.Kind() == reflect.Struct && v.Type() != durationType:
		if n.Kind != yaml.MappingNode {
			return fmt.Errorf("line %d: %s must be a mapping of settings", n.Line, name)
		}
		fields := map[string]reflect.Value{}
		yamlFields(v, fields)
		if name == "defaults" {
			// A route's own keys: under defaults they would mean nothing.
			// Its lease and retention: under defaults they would override
			// the engine's (the top-level lease and retention, which flags
			// and variables set) for every route, flags and variables
			// included.
			for _, k := range []string{"match", "bypass", "lease", "retention"} {
				delete(fields, k)
			}
		}
		seen := map[string]bool{}
		for i := 0; i+1 < len(n.Content); i += 2 {
			key := n.Content[i].Value
			f, ok := fields[key]
			switch {
			case !ok && name == "defaults" && (key == "match" || key == "bypass"):
				return fmt.Errorf("line %d: %s is a route's, not a setting of defaults: write it in a route under routes", n.Content[i].Line, key)
			case !ok && name == "defaults" && (key == "lease" || key == "retention"):
				return fmt.Errorf("line %d: %s is not a setting of defaults: write it at the top level (--%s, IDEM_%s), or in a route under routes",
					n.Content[i].Line, key, key, strings.ToUpper(key))
			case !ok && name == "the file" && (key == "match" || key == "bypass"):
				return fmt.Errorf("line %d: %s is a route's, not a setting of the file: write it in a route under routes", n.Content[i].Line, key)
			case !ok && name == "the file" && requestSetting(key):
				return fmt.Errorf("line %d: %s is a setting of requests, not of the file: write it under defaults: (every route) or in a route under routes",
					n.Content[i].Line, key)
			case !ok:
				known := slices.Sorted(maps.Keys(fields))
				return fmt.Errorf("line %d: %s is not a setting of %s (its settings: %s)", n.Content[i].Line, key, name, strings.Join(known, ", "))
			case seen[key]:
				return fmt.Errorf("line %d: %s is given twice in %s", n.Content[i].Line, key, name)
			}
			seen[key] = true
			if err := decodeNode(n.Content[i+1], f, key); err != nil {
				return err
			}
		}
	case n.Kind == yaml.ScalarNode && n.Tag == "!!null":
		if v.Kind() == reflect.Slice || noEmpty[name] {
			return fmt.Errorf("line %d: %s: %w", n.Line, name, emptyError(name))
		}
		v.SetZero()
	case v.Kind() == reflect.Slice && n.Kind == yaml.SequenceNode:
		if len(n.Content) == 0 {
			return fmt.Errorf("line %d: %s: %w", n.Line, name, emptyError(name))
		}
		v.SetZero()
		for _, item := range n.Content {
			if item.Kind != yaml.ScalarNode {
				return fmt.Errorf("line %d: %s is a list of single values", item.Line, name)
			}
			if err := parseValue(v, item.Value, false); err != nil {
				return fmt.Errorf("line %d: %s: %w", item.Line, name, explainEmpty(name, err))
			}
		}
	case n.Kind != yaml.ScalarNode:
		return fmt.Errorf("line %d: %s takes a single value", n.Line, name)
	case noEmpty[name] && strings.TrimSpace(n.Value) == "":
		return fmt.Errorf("line %d: %s: %w", n.Line, name, emptyError(name))
	default:
		if err := parseValue(v, n.Value, true); err != nil {
			return fmt.Errorf("line %d: %s: %w", n.Line, name, explainEmpty(name, err))
		}
	}
	return nil
}

// yamlFields maps the YAML names of struct v's fields, inline ones
// included, to the fields.
func yamlFields(v reflect.Value, into map[string]reflect.Value) {
	t := v.Type()
	for i := range t.NumField() {
		f := t.Field(i)
		tag, opts, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		switch {
		case tag == "-" || !f.IsExported():
		case opts == "inline":
			yamlFields(v.Field(i), into)
		case tag != "":
			into[tag] = v.Field(i)
		}
	}
}
