package idem

import (
	"context"

	"github.com/idemhq/idem/store"
)

// Checkpoint records a recovery point under l before a step that leaves the
// database (see [Checkpoint]). [ErrLeaseLost] means the lease has run out
// or was taken over: do not take the step.
func (e *Engine) Checkpoint(ctx context.Context, l Lease, name string, data []byte) error {
	return e.store.Checkpoint(ctx, store.CheckpointParams{Scope: l.Scope, Key: l.Key, Token: l.Token, Now: e.clock.Now(), Name: name, Data: data})
}
