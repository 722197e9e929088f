package store

import (
	"encoding/base64"
	"fmt"
	"strings"
)

// Fingerprint identifies a payload without revealing it. It holds a SHA-256
// per part (method, path, query, body) under a version prefix, so a mismatch
// can name the part that differed and never its value. Fingerprints are
// compared for equality as strings.
type Fingerprint string

// fingerprintParts names the parts of a payload in the order a
// [Fingerprint] holds them.
var fingerprintParts = [4]string{"method", "path", "query", "body"}

// Diff names the parts in which f and g differ, in the order method, path, query, body;
// nil when they are equal. Fingerprints of different versions, or that are
// not fingerprints at all, differ in "version".
func (f Fingerprint) Diff(g Fingerprint) []string {
	if f == g {
		return nil
	}
	fp, gp := strings.Split(string(f), "."), strings.Split(string(g), ".")
	if len(fp) != 5 || len(gp) != 5 || fp[0] != gp[0] {
		return []string{"version"}
	}
	var diff []string
	for i, name := range fingerprintParts {
		if fp[i+1] != gp[i+1] {
			diff = append(diff, name)
		}
	}
	return diff
}

// compactFingerprint is the first byte of a fingerprint's compact form
// when it holds the four sums of a version-1 fingerprint; a fingerprint
// kept as its text starts with a printable character.
const compactFingerprint = 1

// sumText is the length of one sum of a version-1 fingerprint in its text:
// a SHA-256 in unpadded base64url.
const sumText = 43

// Compact returns f as a store may keep it in binary: a version-1
// fingerprint (idem.NewFingerprint's, "v1" and four base64url SHA-256
// sums, 178 characters) as a marker byte and the four sums, 129 bytes; any
// other as its text. [FingerprintFromCompact] reads either back as f, so
// two fingerprints are equal exactly when their compact forms are: a store
// may compare them on the server.
func (f Fingerprint) Compact() []byte {
	parts := strings.Split(string(f), ".")
	if len(parts) != 5 || parts[0] != "v1" {
		return []byte(f)
	}
	b := make([]byte, 1, 1+4*32)
	b[0] = compactFingerprint
	for _, p := range parts[1:] {
		// Strict: a sum whose last character has bits set that a sum does
		// not use would read back as another text.
		if len(p) != sumText {
			return []byte(f)
		}
		var err error
		if b, err = base64.RawURLEncoding.Strict().AppendDecode(b, []byte(p)); err != nil {
			return []byte(f)
		}
	}
	return b
}

// FingerprintFromCompact reads what [Fingerprint.Compact] wrote.
func FingerprintFromCompact(b []byte) (Fingerprint, error) {
	if len(b) > 0 && b[0] == compactFingerprint {
		if len(b) != 1+4*32 {
			return "", fmt.Errorf("idem: stored fingerprint is %d bytes, want 129", len(b))
		}
		var s strings.Builder
		s.Grow(2 + 4*(1+sumText))
		s.WriteString("v1")
		for i := 1; i < len(b); i += 32 {
			s.WriteByte('.')
			s.WriteString(base64.RawURLEncoding.EncodeToString(b[i : i+32]))
		}
		return Fingerprint(s.String()), nil
	}
	if err := validateFingerprint(Fingerprint(b)); err != nil {
		return "", fmt.Errorf("idem: stored fingerprint is neither text nor compact")
	}
	return Fingerprint(b), nil
}
