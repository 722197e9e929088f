package memcachedstore

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/idemhq/idem/store"
)

// hashLen is the length of a record's hash as it appears in its Memcached
// key: 32 bytes of SHA-256, unpadded base64url.
const hashLen = 43

// recordHash names the record of scope and key inside Memcached's key space:
// the unpadded base64url of SHA-256 over a version tag, the scope's length,
// the scope and the key. The length makes it unambiguous ("a:b","c" is not
// "a","b:c"); the alphabet is legal in a Memcached key.
func recordHash(scope, key string) string {
	h := sha256.New()
	h.Write([]byte("idem/memcachedstore/v1\x00"))
	var n [4]byte
	binary.BigEndian.PutUint32(n[:], uint32(len(scope)))
	h.Write(n[:])
	h.Write([]byte(scope))
	h.Write([]byte(key))
	return base64.RawURLEncoding.EncodeToString(h.Sum(nil))
}

// valueVersion is the version of the encoding of a record's value.
const valueVersion = 1

// meta is everything of a record but its response body, as JSON. Times are
// unix milliseconds from the params; Expires is 0 while unsettled.
type meta struct {
	V           int         `json:"v"`
	Scope       string      `json:"scope"`
	Key         string      `json:"key"`
	State       store.State `json:"state"`
	Fingerprint string      `json:"fp"`
	Token       string      `json:"token"`
	Fence       int64       `json:"fence"`
	Lease       int64       `json:"lease"`
	TakeoverOK  bool        `json:"ts,omitempty"`
	Created     int64       `json:"created"`
	Updated     int64       `json:"updated"`
	Expires     int64       `json:"exp,omitempty"`
	// Response is the response's MarshalBinary without its body, which
	// follows the JSON line raw; RawResponse is the same when it is not
	// JSON (a header that is no UTF-8: MarshalBinary's compact form), in
	// base64.
	Response    json.RawMessage `json:"resp,omitempty"`
	RawResponse []byte          `json:"respb,omitempty"`
	// Body is true when the response has a body after the JSON line.
	Body bool `json:"body,omitempty"`
	// Checkpoints are the store.EncodeCheckpoints lines.
	Checkpoints string `json:"cps,omitempty"`
}

// encode returns the value a record is stored as: one line of JSON (meta),
// then the response body as it is. JSON escapes every control character
// inside strings, so the first newline ends the line; the body is kept raw so
// that it is not inflated by base64 inside the item's size limit.
func encode(r *store.Record) ([]byte, error) {
	m := meta{
		V:           valueVersion,
		Scope:       r.Scope,
		Key:         r.Key,
		State:       r.State,
		Fingerprint: string(r.Fingerprint),
		Token:       r.Token,
		Fence:       r.Fence,
		Lease:       r.LeaseExpires.UnixMilli(),
		TakeoverOK:  r.TakeoverSafe,
		Created:     r.Created.UnixMilli(),
		Updated:     r.Updated.UnixMilli(),
		Checkpoints: string(store.EncodeCheckpoints(r.Checkpoints)),
	}
	if !r.Expires.IsZero() {
		m.Expires = r.Expires.UnixMilli()
	}
	var body []byte
	if r.Response != nil {
		head := *r.Response
		body, head.Body = r.Response.Body, nil
		b, err := head.MarshalBinary()
		if err != nil {
			return nil, fmt.Errorf("encoding the response: %w", err)
		}
		if json.Valid(b) {
			m.Response = b
		} else {
			m.RawResponse = b
		}
		m.Body = len(body) > 0
	}
	var buf bytes.Buffer
	buf.Grow(512 + len(body) + len(m.Checkpoints))
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(m); err != nil { // writes the line and its newline
		return nil, fmt.Errorf("encoding the record: %w", err)
	}
	buf.Write(body)
	return buf.Bytes(), nil
}

// errForeign reports a value that belongs to another scope and key: two
// names whose hashes collide. It is never shown to a caller as a record.
var errForeign = errors.New("the item holds another scope and key")

// decode reads a value written by encode. When scope and key are given
// (want is true), a value of another scope and key gives errForeign; when
// they are not, the value's own scope and key must hash to h.
func decode(v []byte, want bool, scope, key, h string) (store.Record, error) {
	line, body, ok := bytes.Cut(v, []byte("\n"))
	if !ok {
		return store.Record{}, errors.New("the stored value has no header line")
	}
	var m meta
	if err := json.Unmarshal(line, &m); err != nil {
		return store.Record{}, fmt.Errorf("decoding the stored record: %w", err)
	}
	if m.V != valueVersion {
		return store.Record{}, fmt.Errorf("the stored record has encoding version %d, this build reads %d", m.V, valueVersion)
	}
	foreign := m.Scope != scope || m.Key != key
	if !want {
		foreign = recordHash(m.Scope, m.Key) != h
	}
	if foreign {
		return store.Record{}, errForeign
	}
	if !m.State.Valid() {
		return store.Record{}, fmt.Errorf("the stored state %q is not a state", m.State)
	}
	at := func(ms int64) time.Time { return time.UnixMilli(ms).UTC() }
	r := store.Record{
		Scope:        m.Scope,
		Key:          m.Key,
		State:        m.State,
		Fingerprint:  store.Fingerprint(m.Fingerprint),
		Token:        m.Token,
		Fence:        m.Fence,
		LeaseExpires: at(m.Lease),
		TakeoverSafe: m.TakeoverOK,
		Created:      at(m.Created),
		Updated:      at(m.Updated),
	}
	if m.Expires != 0 {
		r.Expires = at(m.Expires)
	}
	if m.RawResponse != nil {
		m.Response = m.RawResponse
	}
	switch {
	case m.Response != nil:
		r.Response = new(store.Response)
		if err := r.Response.UnmarshalBinary(m.Response); err != nil {
			return store.Record{}, err
		}
		if m.Body {
			r.Response.Body = body
		}
		if m.Body != (len(body) > 0) {
			return store.Record{}, errors.New("the stored response body is missing or unexpected")
		}
	case len(body) > 0:
		return store.Record{}, errors.New("the stored record has a body but no response")
	}
	if m.Checkpoints != "" {
		var err error
		if r.Checkpoints, err = store.DecodeCheckpoints([]byte(m.Checkpoints)); err != nil {
			return store.Record{}, err
		}
	}
	return r, nil
}
