package store

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"time"
)

// Checkpoint is a recovery point: what a handler recorded about its progress
// just before a step whose effect leaves the database (a call to a card
// acquirer, say), so that whoever later finds the record unsettled — the
// reconciler, an operator — knows what may have happened and how to ask.
type Checkpoint struct {
	// Name names the step, e.g. "authorize".
	Name string `json:"name"`
	// Data is what the step needs to be looked up later, e.g. the
	// downstream idempotency key it sent; at most [MaxCheckpointData] bytes.
	Data []byte `json:"data,omitempty"`
	// At is when the checkpoint was recorded.
	At time.Time `json:"at"`
}

// Limits of a checkpoint.
const (
	// MaxCheckpointName is the longest checkpoint name, in bytes.
	MaxCheckpointName = 64
	// MaxCheckpointData is the most data a checkpoint holds, in bytes.
	MaxCheckpointData = 4096
)

// CheckpointParams asks a store to add a checkpoint to a running record.
type CheckpointParams struct {
	Scope, Key, Token string
	Now               time.Time
	Name              string
	Data              []byte
}

// Validate reports malformed params; the error wraps [ErrInvalid].
func (p CheckpointParams) Validate() error {
	if err := validateRef(p.Scope, p.Key, p.Token, p.Now); err != nil {
		return err
	}
	if p.Name == "" || len(p.Name) > MaxCheckpointName || nonPrintable(p.Name) >= 0 {
		return invalid("checkpoint name must be 1 to %d bytes of printable ASCII", MaxCheckpointName)
	}
	if len(p.Data) > MaxCheckpointData {
		return invalid("checkpoint data is %d bytes, over the limit of %d", len(p.Data), MaxCheckpointData)
	}
	return nil
}

// Checkpoint returns the checkpoint the params describe.
func (p CheckpointParams) Checkpoint() Checkpoint {
	return Checkpoint{Name: p.Name, Data: p.Data, At: p.Now}
}

// Apply is the checkpoint transition on the stored record r (nil when there
// is none). Like a renewal, it needs a running lease under p.Token that has
// not run out. It appends the checkpoint and clears TakeoverSafe: work that
// is about to leave the database can no longer be taken over blindly, so if
// its lease now expires the record becomes UNKNOWN.
func (p CheckpointParams) Apply(r *Record) error {
	if r == nil || r.Token != p.Token || r.State != StateInProgress || !p.Now.Before(r.LeaseExpires) {
		return ErrLeaseLost
	}
	r.Checkpoints = append(r.Checkpoints, p.Checkpoint())
	r.TakeoverSafe = false
	r.Updated = p.Now
	return nil
}

// AppendCheckpoint appends the stored form of c to b: one JSON object and a
// newline. Stores keep a record's checkpoints as the concatenation of these,
// so adding one is an append (SQL ||, Redis string concatenation).
func AppendCheckpoint(b []byte, c Checkpoint) []byte {
	line, _ := json.Marshal(c) // cannot fail: strings, bytes and a time
	return append(append(b, line...), '\n')
}

// DecodeCheckpoints reads what AppendCheckpoint wrote; nil or empty input is
// no checkpoints.
func DecodeCheckpoints(b []byte) ([]Checkpoint, error) {
	var cps []Checkpoint
	for _, line := range bytes.Split(bytes.TrimSuffix(b, []byte("\n")), []byte("\n")) {
		if len(line) == 0 {
			continue
		}
		var c Checkpoint
		if err := json.Unmarshal(line, &c); err != nil {
			return nil, fmt.Errorf("idem: decoding stored checkpoint: %w", err)
		}
		cps = append(cps, c)
	}
	return cps, nil
}

// EncodeCheckpoints is the stored form of cps (nil when there are none).
func EncodeCheckpoints(cps []Checkpoint) []byte {
	var b []byte
	for _, c := range cps {
		b = AppendCheckpoint(b, c)
	}
	return b
}

// DownstreamKey derives the idempotency key to send to a downstream service
// for one step of this request. It is the same for every attempt at the same
// request — the same scope, key and payload — including a takeover, a retry
// after a release, and the reconciler's lookup, so re-sending a step with it
// is itself idempotent at the downstream service, and the reconciler can ask
// the downstream service about it. Different requests never share one.
func DownstreamKey(scope, key string, fp Fingerprint, step string) string {
	h := sha256.New()
	for _, part := range []string{"idem/downstream/v1", scope, key, string(fp), step} {
		h.Write([]byte(part))
		h.Write([]byte{0})
	}
	return "idem_" + hex.EncodeToString(h.Sum(nil)[:16])
}

// DownstreamKey is [DownstreamKey] for this lease's request.
func (l Lease) DownstreamKey(step string) string {
	return DownstreamKey(l.Scope, l.Key, l.Fingerprint, step)
}

// DownstreamKey is [DownstreamKey] for this record's request.
func (r *Record) DownstreamKey(step string) string {
	return DownstreamKey(r.Scope, r.Key, r.Fingerprint, step)
}
