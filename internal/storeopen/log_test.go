package storeopen

import (
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"
)

// TestDriverLogIsStructured: what the Redis driver logs by itself becomes a
// line of the process's own log, JSON when the log is.
func TestDriverLogIsStructured(t *testing.T) {
	var out strings.Builder
	d := driverLog{slog.New(slog.NewJSONHandler(&out, nil)).With("driver", "go-redis")}
	d.Printf(context.Background(), "redis: connection pool: failed to dial after %d attempts: %v\n", 5, "refused")
	var line map[string]any
	if err := json.Unmarshal([]byte(out.String()), &line); err != nil {
		t.Fatalf("not a JSON line: %q", out.String())
	}
	if line["level"] != "WARN" || line["driver"] != "go-redis" || line["msg"] != "redis: connection pool: failed to dial after 5 attempts: refused" {
		t.Fatalf("line = %v", line)
	}
}
