package idem

import (
	"context"

	"github.com/idemhq/idem/store"
)

// Checkpoint records a recovery point under l before a step that leaves the
// database (see [Checkpoint]). [ErrLeaseLost] means the lease has run out
// or was taken over: do not take the step. A store that does not answer
// within the store timeout is [ErrUnavailable] (the checkpoint may have
// been written: it is not sent again, since it would be appended twice).
func (e *Engine) Checkpoint(ctx context.Context, l Lease, name string, data []byte) error {
	return e.bounded(ctx, func(ctx context.Context) error {
		return e.store.Checkpoint(ctx, store.CheckpointParams{Scope: l.Scope, Key: l.Key, Token: l.Token, Now: e.clock.Now(), Name: name, Data: data})
	})
}
