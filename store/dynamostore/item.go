package dynamostore

import (
	"bytes"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/idemhq/idem/store"
)

// The attributes of an item; see the package documentation.
const (
	attrPK        = "pk"
	attrState     = "state"
	attrFP        = "fp"
	attrToken     = "token"
	attrFence     = "fence"
	attrLease     = "lease"
	attrTakeover  = "ts"
	attrCreated   = "created"
	attrUpdated   = "updated"
	attrExpires   = "expires"
	attrTTL       = "ttl"
	attrResp      = "resp"
	attrBody      = "body"
	attrCps       = "cps"
	attrCpsBytes  = "cps_bytes"
	attrVersion   = "ver"
	attrShard     = "gsi_shard"
	attrStaleAt   = "gsi_lease"
	staleIndex    = "idem_stale"
	itemSizeLimit = 400 << 10 // DynamoDB's limit on an item: 400 KB, names and values
)

// Limits of what one item holds. Together with the record's fixed
// attributes (at most [fixedBytes]) they add up to less than DynamoDB's
// 400 KB item limit, whatever the record holds.
const (
	// MaxBodyBytes is the largest response body kept (see [Store.MaxBody]):
	// a larger one is stored as omitted.
	MaxBodyBytes = 350 << 10
	// MaxHeaderBytes is the room an item keeps for a response without its
	// body once encoded (status and headers, by
	// [store.Response.MarshalBinary]) beside a body of [MaxBodyBytes]. A
	// response may take more: its status, headers and body share the room
	// of both, so larger headers leave less for the body, which is stored
	// as omitted when it does not fit. A Finish whose status and headers
	// alone take more than MaxHeaderBytes + MaxBodyBytes fails with an
	// error wrapping [store.ErrInvalid], before anything is written.
	MaxHeaderBytes = 16 << 10
	// MaxCheckpointBytes is the most a record's checkpoints may take, counted
	// as the sum of their encoded lines ([store.AppendCheckpoint]) plus one
	// byte each. A Checkpoint that would pass it fails with an error
	// wrapping [store.ErrInvalid], and nothing is written.
	MaxCheckpointBytes = 32 << 10
	// maxResponseBytes is the room of a response: its encoded status and
	// headers plus its body.
	maxResponseBytes = MaxHeaderBytes + MaxBodyBytes
	// fixedBytes bounds every other attribute of an item, names included:
	// pk (at most 515 bytes), fp (255), token (64), state and ten numbers.
	fixedBytes = 2 << 10
)

// pkOf encodes scope and key as the item's partition key. The scope's length
// makes it unambiguous: ("a:b", "c") is "3:a:b:c", ("a", "b:c") is "1:a:b:c".
func pkOf(scope, key string) string {
	return strconv.Itoa(len(scope)) + ":" + scope + ":" + key
}

// parsePK is the inverse of pkOf.
func parsePK(pk string) (scope, key string, err error) {
	n, rest, ok := strings.Cut(pk, ":")
	l, convErr := strconv.Atoi(n)
	if !ok || convErr != nil || l < 0 || l >= len(rest) || rest[l] != ':' {
		return "", "", errors.New("a partition key is not a scope and key")
	}
	return rest[:l], rest[l+1:], nil
}

func ms(t time.Time) int64 { return t.UnixMilli() }

// msTime is the time of unix milliseconds n, in UTC.
func msTime(n int64) time.Time { return time.UnixMilli(n).UTC() }

// trunc truncates t to the millisecond, in UTC, as the store keeps it.
func trunc(t time.Time) time.Time { return msTime(ms(t)) }

// ttlSeconds is the ttl attribute of a record that expires at exp: the epoch
// second at or after it, so that DynamoDB never deletes a live record.
func ttlSeconds(exp time.Time) int64 {
	n := ms(exp)
	return (n + 999) / 1000
}

func avS(s string) types.AttributeValue {
	return &types.AttributeValueMemberS{Value: s}
}

func avN(n int64) types.AttributeValue {
	return &types.AttributeValueMemberN{Value: strconv.FormatInt(n, 10)}
}

func avB(b []byte) types.AttributeValue {
	return &types.AttributeValueMemberB{Value: b}
}

func avBool(b bool) types.AttributeValue {
	return &types.AttributeValueMemberBOOL{Value: b}
}

// staleAt is the index score of an unsettled record: when it is (or was)
// due for the reconciler. An IN_PROGRESS record is due when its lease ends;
// an UNKNOWN one at once, so its score is never later than when it became
// UNKNOWN.
func staleAt(r *store.Record) time.Time {
	if r.State == store.StateUnknown && r.Updated.Before(r.LeaseExpires) {
		return r.Updated
	}
	return r.LeaseExpires
}

// encodeResponse splits a response into the resp attribute (the response
// without its body, by MarshalBinary) and the body attribute (nil when the
// body is empty), so that the body is stored as raw bytes rather than the
// base64 of MarshalBinary's JSON.
func encodeResponse(r *store.Response) (meta, body []byte, err error) {
	head := *r
	head.Body = nil
	meta, err = head.MarshalBinary()
	if err != nil {
		return nil, nil, fmt.Errorf("encoding the response: %w", err)
	}
	return meta, r.Body, nil
}

// encode makes the whole item of a record at version ver, for a PutItem.
func (s *Store) encode(r *store.Record, ver int64) (map[string]types.AttributeValue, error) {
	pk := pkOf(r.Scope, r.Key)
	item := map[string]types.AttributeValue{
		attrPK:       avS(pk),
		attrState:    avS(string(r.State)),
		attrFP:       avS(string(r.Fingerprint)),
		attrToken:    avS(r.Token),
		attrFence:    avN(r.Fence),
		attrLease:    avN(ms(r.LeaseExpires)),
		attrTakeover: avBool(r.TakeoverSafe),
		attrCreated:  avN(ms(r.Created)),
		attrUpdated:  avN(ms(r.Updated)),
		attrVersion:  avN(ver),
	}
	if r.State.Terminal() {
		item[attrExpires] = avN(ms(r.Expires))
		item[attrTTL] = avN(ttlSeconds(r.Expires))
	} else {
		item[attrShard] = avS(s.shardOf(pk))
		item[attrStaleAt] = avN(ms(staleAt(r)))
	}
	if r.Response != nil {
		meta, body, err := encodeResponse(r.Response)
		if err != nil {
			return nil, err
		}
		item[attrResp] = avB(meta)
		if len(body) > 0 {
			item[attrBody] = avB(body)
		}
	}
	if len(r.Checkpoints) > 0 {
		list := make([]types.AttributeValue, len(r.Checkpoints))
		n := 0
		for i, c := range r.Checkpoints {
			line := store.AppendCheckpoint(nil, c)
			list[i] = avB(line)
			n += len(line) + 1
		}
		item[attrCps] = &types.AttributeValueMemberL{Value: list}
		item[attrCpsBytes] = avN(int64(n))
	}
	return item, nil
}

// stored is a record as read, with the attributes that are not part of
// store.Record.
type stored struct {
	store.Record
	ver     int64
	staleAt int64 // gsi_lease; -1 when absent
	cpsSize int64 // cps_bytes
	cpLines [][]byte
}

// decode reads an item.
func decode(item map[string]types.AttributeValue) (*stored, error) {
	var firstErr error
	fail := func(format string, args ...any) {
		if firstErr == nil {
			firstErr = fmt.Errorf(format, args...)
		}
	}
	str := func(name string) string {
		switch v := item[name].(type) {
		case *types.AttributeValueMemberS:
			return v.Value
		case nil:
			fail("attribute %s is missing", name)
		default:
			fail("attribute %s is a %T, not a string", name, v)
		}
		return ""
	}
	num := func(name string, def int64, required bool) int64 {
		switch v := item[name].(type) {
		case *types.AttributeValueMemberN:
			n, err := strconv.ParseInt(v.Value, 10, 64)
			if err != nil {
				fail("attribute %s is %q, not an integer", name, v.Value)
			}
			return n
		case nil:
			if required {
				fail("attribute %s is missing", name)
			}
		default:
			fail("attribute %s is a %T, not a number", name, v)
		}
		return def
	}
	bin := func(name string) ([]byte, bool) {
		switch v := item[name].(type) {
		case *types.AttributeValueMemberB:
			return v.Value, true
		case nil:
		default:
			fail("attribute %s is a %T, not binary", name, v)
		}
		return nil, false
	}

	st := &stored{}
	r := &st.Record
	pk := str(attrPK)
	var err error
	if r.Scope, r.Key, err = parsePK(pk); err != nil {
		fail("%v", err)
	}
	r.State = store.State(str(attrState))
	r.Fingerprint = store.Fingerprint(str(attrFP))
	r.Token = str(attrToken)
	r.Fence = num(attrFence, 0, true)
	r.LeaseExpires = msTime(num(attrLease, 0, true))
	switch v := item[attrTakeover].(type) {
	case *types.AttributeValueMemberBOOL:
		r.TakeoverSafe = v.Value
	case nil:
	default:
		fail("attribute %s is a %T, not a boolean", attrTakeover, v)
	}
	r.Created = msTime(num(attrCreated, 0, true))
	r.Updated = msTime(num(attrUpdated, 0, true))
	if exp := num(attrExpires, 0, false); exp != 0 {
		r.Expires = msTime(exp)
	}
	st.ver = num(attrVersion, 0, false)
	st.staleAt = num(attrStaleAt, -1, false)
	st.cpsSize = num(attrCpsBytes, 0, false)
	if firstErr != nil {
		return nil, firstErr
	}
	if !r.State.Valid() {
		return nil, fmt.Errorf("state %q is not a state", r.State)
	}
	if meta, ok := bin(attrResp); ok {
		r.Response = new(store.Response)
		if err := r.Response.UnmarshalBinary(meta); err != nil {
			return nil, err
		}
		if body, ok := bin(attrBody); ok {
			r.Response.Body = body
		}
	}
	switch v := item[attrCps].(type) {
	case *types.AttributeValueMemberL:
		var all []byte
		for i, e := range v.Value {
			b, ok := e.(*types.AttributeValueMemberB)
			if !ok {
				return nil, fmt.Errorf("checkpoint %d is a %T, not binary", i, e)
			}
			st.cpLines = append(st.cpLines, b.Value)
			all = append(all, b.Value...)
		}
		if r.Checkpoints, err = store.DecodeCheckpoints(all); err != nil {
			return nil, err
		}
	case nil:
	default:
		return nil, fmt.Errorf("attribute %s is a %T, not a list", attrCps, v)
	}
	if firstErr != nil {
		return nil, firstErr
	}
	return st, nil
}

// hasLine reports whether the record holds the checkpoint line.
func (st *stored) hasLine(line []byte) bool {
	for _, l := range st.cpLines {
		if bytes.Equal(l, line) {
			return true
		}
	}
	return false
}

// itemSize is the size DynamoDB counts for an item: the UTF-8 length of each
// attribute name plus the size of its value (strings and binaries their
// length, numbers at most 21 bytes, booleans 1, lists 3 plus 1 per element
// plus the elements). It may overstate numbers, never understate.
func itemSize(item map[string]types.AttributeValue) int {
	n := 0
	for name, v := range item {
		n += len(name) + valueSize(v)
	}
	return n
}

func valueSize(v types.AttributeValue) int {
	switch v := v.(type) {
	case *types.AttributeValueMemberS:
		return len(v.Value)
	case *types.AttributeValueMemberB:
		return len(v.Value)
	case *types.AttributeValueMemberN:
		return min(len(v.Value), 21)
	case *types.AttributeValueMemberL:
		n := 3
		for _, e := range v.Value {
			n += 1 + valueSize(e)
		}
		return n
	default:
		return 1
	}
}
