package main

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestHarnessRuns runs the harness briefly on the embedded stores: every
// target serves, the ratios come out, and a storm of duplicates is answered
// with one outcome for a few store calls.
func TestHarnessRuns(t *testing.T) {
	dir, bin := buildHarness(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	out := filepath.Join(dir, "out")
	cmd := exec.CommandContext(ctx, bin, "-stores", "memory,sqlite", "-rounds", "1", "-duration", "300ms", "-storm", "100", "-out", out)
	cmd.Env = append(os.Environ(), "IDEM_TEST_DATABASE_URL=", "IDEM_TEST_REDIS_URL=")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("the harness: %v\n%s", err, b)
	}
	text, err := os.ReadFile(filepath.Join(out, "results.txt"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"idem:sqlite", "raw:sqlite", "proxy:sqlite", "hop-raw:sqlite", "idem:sqlite/fresh / raw:sqlite/fresh"} {
		if !strings.Contains(string(text), want) {
			t.Errorf("results lack %q:\n%s", want, text)
		}
	}
	var rep report
	data, _ := os.ReadFile(filepath.Join(out, "results.json"))
	if err := json.Unmarshal(data, &rep); err != nil {
		t.Fatal(err)
	}
	for key, rs := range rep.Results {
		if len(rs) != 1 || rs[0].Requests == 0 || rs[0].Errors != 0 {
			t.Errorf("%s: %+v; want requests and no errors", key, rs)
		}
	}
	for _, s := range rep.Storms {
		if s.Answered != s.Duplicates || s.StoreOps > 10 {
			t.Errorf("storm on %s: %d of %d answered, %d store calls; want all, for at most 10", s.Target, s.Answered, s.Duplicates, s.StoreOps)
		}
	}
	for _, f := range []string{"throughput.svg", "p99.svg"} {
		if b, err := os.ReadFile(filepath.Join(out, f)); err != nil || !strings.HasPrefix(string(b), "<svg") {
			t.Errorf("%s: %v", f, err)
		}
	}
}

// TestScopedRawTargetRuns: raw-scoped, the raw check keyed by caller, runs
// when named, answers fresh keys and replays without errors, and is
// compared with idem's middleware.
func TestScopedRawTargetRuns(t *testing.T) {
	dir, bin := buildHarness(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	out := filepath.Join(dir, "out")
	cmd := exec.CommandContext(ctx, bin, "-stores", "sqlite", "-targets", "raw-scoped:sqlite,idem:sqlite",
		"-rounds", "1", "-duration", "300ms", "-storm", "0", "-out", out)
	cmd.Env = append(os.Environ(), "IDEM_TEST_DATABASE_URL=", "IDEM_TEST_REDIS_URL=")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("the harness: %v\n%s", err, b)
	}
	var rep report
	data, err := os.ReadFile(filepath.Join(out, "results.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, &rep); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"raw-scoped:sqlite/fresh", "raw-scoped:sqlite/replay"} {
		if rs := rep.Results[key]; len(rs) != 1 || rs[0].Requests == 0 || rs[0].Errors != 0 {
			t.Errorf("%s: %+v; want requests and no errors", key, rs)
		}
	}
	text, err := os.ReadFile(filepath.Join(out, "results.txt"))
	if err != nil || !strings.Contains(string(text), "idem:sqlite/fresh / raw-scoped:sqlite/fresh") {
		t.Errorf("results lack the comparison with the scoped raw check (%v):\n%s", err, text)
	}
}

// buildHarness builds the harness into a directory of the test's, and
// returns both.
func buildHarness(t *testing.T) (dir, bin string) {
	t.Helper()
	dir = t.TempDir()
	bin = filepath.Join(dir, "bench")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("building the harness: %v\n%s", err, out)
	}
	return dir, bin
}
