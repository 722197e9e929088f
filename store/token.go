package store

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
)

// NewToken returns a lease token: 128 random bits from crypto/rand, in hex.
func NewToken() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("idem: reading random token: %w", err)
	}
	return hex.EncodeToString(b[:]), nil
}
