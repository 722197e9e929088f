package pgstore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemhq/idem/store"
)

// translate turns a driver error into the root package's vocabulary at the
// store's edge. Errors that mean the server could not be reached or did not
// answer wrap [store.ErrUnavailable]; a refusal of the role's login or
// privileges wraps it and [store.ErrDenied]; a refusal for a reason of the
// moment by a server that reads (see refused) wraps it and
// [store.ErrRefused]; every other error is wrapped
// with the operation's name. The driver's error stays in the chain (for logs and for
// errors.Is with context.Canceled or context.DeadlineExceeded), but no pgx
// type is part of the API.
func translate(op string, err error) error {
	switch {
	case denied(err):
		return fmt.Errorf("pgstore: %s: %w", op, store.Denied(err))
	case refused(err):
		return fmt.Errorf("pgstore: %s: %w", op, store.Refused(err))
	case unavailable(err):
		return fmt.Errorf("pgstore: %s: %w: %w", op, store.ErrUnavailable, err)
	}
	return fmt.Errorf("pgstore: %s: %w", op, err)
}

// denied reports whether err is the server refusing the role: its login
// (class 28: a password or a role rotated) or its privileges on the
// records (42501: a grant revoked). The server was reached, and may hold
// the record (see [store.ErrDenied]); the call may succeed once access is
// restored.
func denied(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return strings.HasPrefix(pgErr.Code, "28") || pgErr.Code == "42501"
	}
	return false
}

// refused reports whether err is the server, which reads, refusing a call
// for a reason that may pass (see [store.ErrRefused]): a read-only
// transaction (a standby), a full disk or its memory short, a lock not had
// in time (lock_timeout: the row of a request running in its business
// transaction), a transaction rolled back (deadlock, serialization), a
// damaged page of the table or of an index (XX001 data_corrupted, XX002
// index_corrupted: until it is repaired). (A statement cancelled, 57014,
// is not: the cancel may be the caller's deadline, the store too slow to
// answer.)
func refused(err error) bool {
	var pgErr *pgconn.PgError
	if errors.Is(err, context.Canceled) || !errors.As(err, &pgErr) {
		return false
	}
	switch code := pgErr.Code; {
	case code == "25006", code == "53100", code == "53200", code == "55P03",
		code == "XX001", code == "XX002":
		return true
	default:
		return strings.HasPrefix(code, "40")
	}
}

// unavailable reports whether err means that the store could not be reached
// or did not answer, so that the outcome of the call is not known, or that
// it could not take the call now (too many connections, a statement
// cancelled by its timeout, a shutdown): the call may succeed when tried
// again.
func unavailable(err error) bool {
	switch {
	case errors.Is(err, context.Canceled):
		// The caller gave up; the store did nothing wrong.
		return false
	case errors.Is(err, context.DeadlineExceeded):
		// The store did not answer in time. (A context already done before
		// the call never gets here: each method checks it first.)
		return true
	}
	var connectErr *pgconn.ConnectError
	if errors.As(err, &connectErr) {
		// No connection at all: refused, timed out, TLS or auth failure.
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		code := pgErr.Code
		// (The refusals of a server that reads, a rolled-back transaction,
		// a lock not had, a standby, are refused's: translate asks it first.)
		return strings.HasPrefix(code, "08") || // connection exception
			strings.HasPrefix(code, "53") || // insufficient resources: too many connections
			strings.HasPrefix(code, "57P") || // operator intervention: admin or crash shutdown, cannot connect now
			code == "57014" // query canceled: statement_timeout, the server did not answer in time
	}
	if pgconn.Timeout(err) || pgconn.SafeToRetry(err) {
		return true
	}
	var netErr net.Error
	if errors.As(err, &netErr) {
		return true
	}
	// The server closed the connection mid-conversation.
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed)
}
