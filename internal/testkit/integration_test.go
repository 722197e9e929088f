package testkit

import (
	"strings"
	"testing"
)

func TestSkipNoticeSaysHowToRun(t *testing.T) {
	got := SkipNotice("pgstore", map[string]int{"IDEM_TEST_REDIS_URL": 2, "IDEM_TEST_DATABASE_URL": 57})
	lines := strings.Split(strings.TrimSpace(got), "\n")
	if len(lines) != 2 || !strings.Contains(lines[0], "pgstore: 57 integration test(s) did not run: set IDEM_TEST_DATABASE_URL=postgres://") ||
		!strings.Contains(lines[1], "2 integration test(s) did not run: set IDEM_TEST_REDIS_URL=redis://") {
		t.Fatalf("notice:\n%s", got)
	}
}
