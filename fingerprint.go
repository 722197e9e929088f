package idem

import (
	"crypto/sha256"
	"encoding/base64"
	"net/url"
	"strconv"
	"strings"
)

// FingerprintVersion is the version of the algorithm [NewFingerprint] uses. It
// is written into every fingerprint, so a later algorithm can tell old records
// apart instead of calling them mismatches by accident.
const FingerprintVersion = 1

// Payload is what a fingerprint covers: the parts of a request that must be
// the same for a retry to count as the same request.
type Payload struct {
	// Method is the HTTP method, compared case-sensitively.
	Method string
	// Path is the route path.
	Path string
	// Query is the raw query string. It is canonicalised (parameters sorted
	// by name, each name's values in their order) before hashing.
	Query string
	// Body is the request body (already canonicalised by the caller where
	// that is wanted, e.g. RFC 8785 JSON).
	Body []byte
}

// NewFingerprint computes the fingerprint of p with the current
// [FingerprintVersion].
func NewFingerprint(p Payload) Fingerprint {
	const sumLen = 43 // base64.RawURLEncoding.EncodedLen(sha256.Size)
	var b strings.Builder
	b.Grow(len("v") + 3 + 4*(1+sumLen)) // one allocation: the fingerprint
	b.WriteString("v")
	b.WriteString(strconv.Itoa(FingerprintVersion))
	for _, sum := range [...][sha256.Size]byte{
		sha256.Sum256([]byte(p.Method)), sha256.Sum256([]byte(p.Path)),
		sha256.Sum256([]byte(canonicalQuery(p.Query))), sha256.Sum256(p.Body),
	} {
		var enc [sumLen]byte
		base64.RawURLEncoding.Encode(enc[:], sum[:])
		b.WriteByte('.')
		b.Write(enc[:])
	}
	return Fingerprint(b.String())
}

// canonicalQuery sorts parameters by name, keeping each name's values in
// order. A query that does not parse is hashed as sent.
func canonicalQuery(q string) string {
	v, err := url.ParseQuery(q)
	if err != nil {
		return q
	}
	return v.Encode()
}
