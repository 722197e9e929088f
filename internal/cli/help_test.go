package cli

import (
	"context"
	"flag"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the help golden files in testdata/help")

// TestHelp: every command's --help, and `idem help`, match their golden
// files (go test ./internal/cli -run TestHelp -update rewrites them), go to
// stdout and exit 0; each shows an example, and names what every flag takes.
func TestHelp(t *testing.T) {
	pages := map[string][]string{"idem": {"help"}, "keys": {"keys", "--help"}}
	for _, c := range commands {
		pages[strings.ReplaceAll(c.name, " ", "-")] = append(strings.Fields(c.name), "--help")
	}
	vague := regexp.MustCompile(`(?m)^  --\S+ (VALUE|STRING)\b`)
	for name, args := range pages {
		var stdout, stderr strings.Builder
		if code := Main(context.Background(), args, envOf(nil), &stdout, &stderr); code != 0 || stderr.Len() > 0 {
			t.Errorf("idem %s: exit %d, stderr %q", strings.Join(args, " "), code, stderr.String())
		}
		got := stdout.String()
		path := filepath.Join("testdata", "help", name+".txt")
		if *update {
			os.MkdirAll(filepath.Dir(path), 0o755)
			if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		want, err := os.ReadFile(path)
		if err != nil || got != string(want) {
			t.Errorf("idem %s: help differs from %s (%v); run go test ./internal/cli -run TestHelp -update and review the diff\n%s", strings.Join(args, " "), path, err, got)
		}
		if name != "version" && name != "idem" && name != "keys" && !strings.Contains(got, "Examples:\n") {
			t.Errorf("idem %s has no example", name)
		}
		if m := vague.FindString(got); m != "" {
			t.Errorf("idem %s: %q does not say what the flag takes", name, m)
		}
	}
}

// TestUsageErrors: a wrong command line exits 2 and says, on stderr, what is
// wrong and where to read how it goes; nothing goes to stdout.
func TestUsageErrors(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "Usage:"},
		{[]string{"frobnicate"}, `unknown command "frobnicate"`},
		{[]string{"help", "bogus"}, `no command "bogus"`},
		{[]string{"keys"}, "Commands:"},
		{[]string{"keys", "frob"}, `unknown command "frob"`},
		{[]string{"keys", "ls", "--bogus"}, "unknown flag --bogus\nRun 'idem keys ls --help'"},
		{[]string{"keys", "show"}, "takes 1 key, not 0"},
		{[]string{"keys", "ls", "--store", "nope:x"}, `unknown kind "nope"`},
		{[]string{"keys", "ls", "--store", "idem.db"}, `store "idem.db" names no kind: a SQLite file is sqlite:idem.db`},
		{[]string{"keys", "ls", "--store", "postgres://u:s3cret@host:abc/db"}, "invalid port"},
		{[]string{"demo", "--store", "memory:"}, "takes sqlite:PATH or postgres://"},
		{[]string{"demo", "--lease", "soon"}, `--lease "soon": want a duration`},
		{[]string{"echo", "extra"}, `unexpected argument "extra"`},
		{[]string{"reconcile", "--once"}, "--resolver-url is required"},
		{[]string{"reconcile", "--resolver-url", "http://x", "--log-format", "xml"}, "want text or json"},
		{[]string{"verify"}, "--url is required"},
		{[]string{"verify", "--url", "http://x", "--concurrency", "many"}, `--concurrency "many": want a whole number`},
		{[]string{"version", "--short"}, "unknown flag --short"},
	} {
		var stdout, stderr strings.Builder
		code := Main(context.Background(), c.args, envOf(nil), &stdout, &stderr)
		if code != 2 || stdout.Len() > 0 || !strings.Contains(stderr.String(), c.want) || strings.Contains(stderr.String(), "s3cret") {
			t.Errorf("idem %s: exit %d, stdout %q, stderr %q; want exit 2 and %q on stderr", strings.Join(c.args, " "), code, stdout.String(), stderr.String(), c.want)
		}
	}
}

// TestEnvironmentErrorsSayWhatIsWanted: a variable a command cannot read
// says what it wants, as the flag does ("$IDEM_LEASE: parse error" did not).
func TestEnvironmentErrorsSayWhatIsWanted(t *testing.T) {
	var stdout, stderr strings.Builder
	code := Main(context.Background(), []string{"demo"}, envOf(map[string]string{"IDEM_LEASE": "30"}), &stdout, &stderr)
	if want := `$IDEM_LEASE "30": want a duration such as 30s`; code != 2 || !strings.Contains(stderr.String(), want) {
		t.Errorf("IDEM_LEASE=30 idem demo: exit %d, stderr %q; want exit 2 and %q", code, stderr.String(), want)
	}
}

// TestConfigReference: docs/config.md is the reference the settings make
// (go test ./internal/cli -run TestConfigReference -update rewrites it).
func TestConfigReference(t *testing.T) {
	path := filepath.Join("..", "..", "docs", "config.md")
	got := configReference()
	if *update {
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil || string(want) != got {
		t.Fatalf("%s is not what the settings make (%v): run go test ./internal/cli -run TestConfigReference -update", path, err)
	}
	for _, s := range proxySettings() {
		if !strings.Contains(got, "`--"+s.flag+"`") || !strings.Contains(got, "`"+s.env+"`") {
			t.Errorf("the reference leaves out %s", s.yaml)
		}
	}
}
