package console_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem/internal/console"
)

// TestAuditLogThatCannotBeWrittenIsRefused: an audit log in a directory
// that does not exist is refused when it is opened, at start, so that no
// console action runs and then fails to be audited. (It was accepted: every
// action ran, and its audit failed.) A read-only console, which writes
// nothing, starts all the same.
func TestAuditLogThatCannotBeWrittenIsRefused(t *testing.T) {
	path := filepath.Join(t.TempDir(), "no-such-dir", "audit.log")
	if _, err := console.OpenAudit(path, true); err == nil {
		t.Fatalf("OpenAudit(%s) accepted a file it cannot write", path)
	}
	// A read-only console writes nothing: it starts with an empty log.
	if a, err := console.OpenAudit(path, false); err != nil || len(a.Recent()) != 0 {
		t.Fatalf("OpenAudit(%s) for a read-only console: %v", path, err)
	}
}

// TestAuditLogWithATornLine: an append cut short (a crash, a full disk)
// leaves a line without its end. The log still opens (it stopped the proxy
// from starting), keeps the entries around it, names the line, and the next
// entry is a line of its own, which a later start reads.
func TestAuditLogWithATornLine(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.log")
	a, err := console.OpenAudit(path, true)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Write(console.Entry{At: time.Now(), Who: "ann", Action: "purge", After: "0 purged"}); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString(`{"at":"2026-12-01T10:05:00Z","who":"bo`) // the next append, torn
	f.Close()
	for _, who := range []string{"cy", "di"} {
		if a, err = console.OpenAudit(path, true); err != nil {
			t.Fatalf("reopening an audit log with a line cut short: %v", err)
		}
		if got := a.Unreadable(); len(got) != 1 || got[0] != 2 {
			t.Fatalf("unreadable lines %v, want [2]", got)
		}
		if err := a.Write(console.Entry{At: time.Now(), Who: who, Action: "purge", After: "0 purged"}); err != nil {
			t.Fatal(err)
		}
	}
	a, err = console.OpenAudit(path, true)
	if err != nil {
		t.Fatal(err)
	}
	var who []string
	for _, e := range a.Recent() {
		who = append(who, e.Who)
	}
	if strings.Join(who, ",") != "di,cy,ann" || len(a.Unreadable()) != 1 {
		t.Fatalf("entries by %v, unreadable lines %v; want di, cy and ann, and the torn line", who, a.Unreadable())
	}
}
