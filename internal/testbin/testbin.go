// Package testbin builds the idem command once for a test binary's tests that
// run it as a real process (SIGKILL, restarts, start-up).
package testbin

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/idemhq/idem/internal/testkit"
)

// Main builds the idem command, sets *bin to its path, runs the tests and
// exits with their status. Call it from TestMain.
func Main(m *testing.M, bin *string) {
	dir, err := os.MkdirTemp("", "idem-bin")
	if err != nil {
		fmt.Fprintln(os.Stderr, "building idem:", err)
		os.Exit(1)
	}
	*bin = filepath.Join(dir, "idem")
	// Built in idem's own module, whichever module's tests call this (the
	// interop tests are a module of their own).
	_, self, _, _ := runtime.Caller(0)
	build := exec.Command("go", "build", "-o", *bin, "./cmd/idem")
	build.Dir = filepath.Join(filepath.Dir(self), "..", "..")
	build.Stderr = os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building idem:", err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	testkit.Main(m, func() { os.RemoveAll(dir) })
}
