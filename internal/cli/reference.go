package cli

import (
	"fmt"
	"reflect"
	"strings"

	"github.com/idemhq/idem/internal/proxy"
)

// configReference is docs/config.md: every setting of `idem proxy`, made
// from the settings themselves so that the reference cannot drift from the
// code (TestConfigReference checks the file).
func configReference() string {
	var b strings.Builder
	b.WriteString(`# Configuration reference (` + "`idem proxy`" + `)

<!-- Generated from internal/cli/settings.go by TestConfigReference; go test ./internal/cli -run TestConfigReference -update rewrites it. -->

Every setting has three spellings: a key in the YAML file named by ` + "`--config`" + ` (or
` + "`IDEM_CONFIG`" + `), an ` + "`IDEM_…`" + ` environment variable and a flag. Flags win over the environment,
which wins over the file, which wins over the defaults; a variable that replaces what the file
says is named in a warning at start (the Docker image sets ` + "`IDEM_LISTEN`" + ` and ` + "`IDEM_ADMIN_LISTEN`" + `).
The settings are the library's own options: the engine's (` + "`idem.Config`" + `) and the
middleware's (` + "`httpidem.Config`" + `).

Values are written the same way everywhere:

- **durations** as Go writes them: ` + "`250ms`, `30s`, `5m`, `24h`" + `;
- **sizes** in bytes or with a unit: ` + "`1048576`, `512KiB`, `2MiB`" + ` (` + "`KB`, `MB`, `GB`" + ` are powers of 1000);
- **lists** comma-separated in a variable or a flag (a list flag may also be repeated), or a YAML list;
- **booleans** ` + "`true`" + ` or ` + "`false`" + ` (a flag alone means true).

An empty list (` + "`--scope-header=`" + `, ` + "`scope_headers: []`" + ` or a bare ` + "`scope_headers:`" + `) and an empty
` + "`journal_dir`" + ` are refused, as they would turn a protection off without saying so: write ` + "`none`" + `
where a setting takes it (` + "`scope_headers`" + `, ` + "`journal_dir`" + `), or leave the setting out for its
default. A variable set to the empty string counts as unset. Durations and sizes are never
negative, except where a setting says what a negative one means.

A wrong value, an unknown key, a key given twice, a second YAML document or a file that does
not parse stops the proxy before it starts, with exit status 2 and a message that names the
setting (and, in a file, its line).

## The process

| YAML | flag | environment | default | meaning |
|---|---|---|---|---|
`)
	defaults := proxy.DefaultConfig()
	row := func(s setting) {
		d := s.defaultText(&defaults)
		if d == "" {
			d = "none"
			if s.typ.Kind() == reflect.Bool {
				d = "false"
			}
		}
		help := strings.ReplaceAll(settingHelp[strings.TrimPrefix(s.yaml, "defaults.")], "`", "")
		fmt.Fprintf(&b, "| `%s` | `--%s` | `%s` | `%s` | %s |\n", strings.TrimPrefix(s.yaml, "defaults."), s.flag, s.env, d, help)
	}
	var rules []setting
	for _, s := range proxySettings() {
		if strings.HasPrefix(s.yaml, "defaults.") {
			rules = append(rules, s)
			continue
		}
		row(s)
	}
	b.WriteString("| | `--config` | `IDEM_CONFIG` | none | the YAML file |\n")
	b.WriteString(`
` + "`lease`" + ` and ` + "`retention`" + ` may also be set per route (below).

## Request rules: ` + "`defaults`" + ` and ` + "`routes`" + `

These say how requests are handled. Under ` + "`defaults`" + ` they apply to every request that no
route matches, and every route starts from them; a route changes only what it says. Their flags
and variables set ` + "`defaults`" + `.

| YAML | flag | environment | default | meaning |
|---|---|---|---|---|
`)
	for _, s := range rules {
		row(s)
	}
	b.WriteString(`
A route is a ` + "`match`" + ` (a net/http ServeMux pattern such as ` + "`POST /v1/charges`" + ` or ` + "`/v1/webhooks/`" + `;
the most specific pattern wins) with any of the rules above, plus ` + "`lease`" + `, ` + "`retention`" + ` and
` + "`bypass: true`" + ` (no idempotency at all: requests pass straight through, and a keyed one is answered
with ` + "`Idempotent-Ignored`" + `). Routes exist only in the file.

` + "```yaml" + `
listen: 127.0.0.1:8080
upstream: http://127.0.0.1:9000
store: postgres://idem@db:5432/payments?idem_schema=idem
admin_listen: 127.0.0.1:9090
log_format: json
defaults:
  scope_headers: [X-Api-Key]     # keys are per API key
  max_request_body: 2MiB
routes:
  - match: POST /v1/charges
    require_key: true
    key_format: uuid
    canonical_json: true         # {"a":1,"b":2} and {"b":2,"a":1} are the same payload
    exclude_fields: [client_ts]  # a member that differs between retries
  - match: POST /v1/ledger/transfers
    takeover_safe: true          # the upstream deduplicates on the Idempotency-Key it is sent
    lease: 10s
  - match: /v1/webhooks/
    bypass: true
` + "```" + `

## Telemetry

Traces are off unless ` + "`OTEL_EXPORTER_OTLP_ENDPOINT`" + ` (or ` + "`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`" + `) is
set, with ` + "`OTEL_TRACES_EXPORTER`" + ` unset or ` + "`otlp`" + `; ` + "`OTEL_SERVICE_NAME`" + ` names the service (default
` + "`idem`" + `). An endpoint variable that is set must be an ` + "`http://`" + ` or ` + "`https://`" + ` URL with a host, with
any ` + "`/ ? # @ : %`" + ` in its user name or password percent-encoded: the proxy and the demo refuse to
start otherwise, naming the variable. The SDK's own log lines follow ` + "`log_format`" + `, without
passwords or header values. Prometheus metrics are on ` + "`admin_listen`" + `'s ` + "`/metrics`" + `.
`)
	return b.String()
}
