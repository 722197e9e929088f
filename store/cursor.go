package store

import (
	"encoding/base64"
	"encoding/binary"
	"fmt"
)

// cursorVersion begins every cursor, so that the encoding can change.
const cursorVersion = 1

// EncodeCursor returns the scan cursor of the store that calls itself owner
// (its kind and what tells its deployments apart: a schema, a key prefix),
// positioned after fields. Every store makes its cursors this way, so that a
// cursor given to another store, or to another deployment of the same kind,
// is refused with [ErrInvalid] instead of being read as something else.
func EncodeCursor(owner string, fields ...string) string {
	b := []byte{cursorVersion}
	for _, s := range append([]string{owner}, fields...) {
		b = binary.AppendUvarint(b, uint64(len(s)))
		b = append(b, s...)
	}
	return base64.RawURLEncoding.EncodeToString(b)
}

// DecodeCursor returns the n fields of a cursor that [EncodeCursor] made for
// owner. A cursor that is malformed, of another version, made by another
// owner or holding another number of fields gives an error wrapping
// [ErrInvalid].
func DecodeCursor(cursor, owner string, n int) ([]string, error) {
	bad := fmt.Errorf("%w: the scan cursor is not one of %s", ErrInvalid, owner)
	b, err := base64.RawURLEncoding.DecodeString(cursor)
	if err != nil || len(b) == 0 || b[0] != cursorVersion {
		return nil, bad
	}
	b = b[1:]
	var parts []string
	for len(b) > 0 {
		l, w := binary.Uvarint(b)
		if w <= 0 || l > uint64(len(b)-w) {
			return nil, bad
		}
		parts = append(parts, string(b[w:w+int(l)]))
		b = b[w+int(l):]
	}
	if len(parts) != n+1 || parts[0] != owner {
		return nil, bad
	}
	return parts[1:], nil
}
