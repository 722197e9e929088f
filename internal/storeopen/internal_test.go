package storeopen

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemhq/idem"
)

// TestScrubFindsThePasswordInTheText: scrub finds the password in the
// DSN's text, whatever url.Parse makes of it; with an unencoded / ? or # in
// it, a driver names what follows as the database or an option, and that
// is taken out too.
func TestScrubFindsThePasswordInTheText(t *testing.T) {
	for dsn, msg := range map[string]string{
		"postgres://app:/hunter2@db:5432/test":     "failed to connect to `user=app database=hunter2@db:5432/test`",
		"postgres://app:2024/hunter2@db:5432/test": "failed to connect to `user=app database=hunter2@db:5432/test`",
		"postgres://app:12?hunter2@db:5432/test":   `unrecognized configuration parameter "hunter2@db:5432/test"`,
		"redis://:/hunter2@127.0.0.1:6379/0":       "redis: invalid database number: \"hunter2@127.0.0.1:6379/0\"",
	} {
		if got := scrub(errors.New(msg), dsn).Error(); strings.Contains(got, "hunter2") {
			t.Errorf("scrub(%q, %s) = %q", msg, dsn, got)
		}
	}
}

// TestMisconfiguredPostgres: the PostgreSQL refusals that waiting does not
// change, and PgBouncer's 08P01s that it may.
func TestMisconfiguredPostgres(t *testing.T) {
	for _, c := range []struct {
		code, msg string
		want      bool
	}{
		{"3D000", `database "x" does not exist`, true},
		{"42704", `unrecognized configuration parameter "idem_schem"`, true},
		{"22023", `invalid value for parameter "statement_timeout": "soon"`, true},
		{"08P01", "unsupported startup parameter: idem_schem", true},
		{"08P01", "no more connections allowed (max_client_conn)", false},
		{"08P01", "pgbouncer cannot connect to server", false},
		{"57P03", "the database system is starting up", false},
	} {
		err := fmt.Errorf("%w: %w", idem.ErrUnavailable, &pgconn.PgError{Code: c.code, Message: c.msg})
		if got := misconfigured("postgres", err); got != c.want {
			t.Errorf("misconfigured(%s %s) = %v; want %v", c.code, c.msg, got, c.want)
		}
	}
}
