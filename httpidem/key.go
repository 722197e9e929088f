package httpidem

import (
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/idemhq/idem"
)

// HeaderKey is the request header that carries the idempotency key.
const HeaderKey = "Idempotency-Key"

// HeaderXKey is the name some clients still give the key's header. The
// middleware honours it as HeaderKey, and both when they name one key.
const HeaderXKey = "X-Idempotency-Key"

// HeaderReplayed marks a replayed response: "Idempotent-Replayed: true".
const HeaderReplayed = "Idempotent-Replayed"

// KeyFormat restricts which keys are accepted beyond the basic rules.
type KeyFormat int

const (
	// KeyAny accepts any key of 1–255 bytes of printable ASCII.
	KeyAny KeyFormat = iota
	// KeyUUID accepts only a UUID in its canonical 8-4-4-4-12 hex form (any
	// version, either case).
	KeyUUID
)

var errKeyMissing = errors.New("no Idempotency-Key header")

// String returns the format's name: any or uuid.
func (f KeyFormat) String() string {
	if f == KeyUUID {
		return "uuid"
	}
	return "any"
}

// MarshalText implements encoding.TextMarshaler with the format's name.
func (f KeyFormat) MarshalText() ([]byte, error) { return []byte(f.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler: any or uuid.
func (f *KeyFormat) UnmarshalText(b []byte) error {
	switch strings.ToLower(string(b)) {
	case "any", "":
		*f = KeyAny
	case "uuid":
		*f = KeyUUID
	default:
		return fmt.Errorf("key format %q: want any or uuid", b)
	}
	return nil
}

// ParseKey extracts the key from the values of the Idempotency-Key header.
// The value is an RFC 9651 Structured Field String ("abc", with \" and \\ as
// the only escapes) or, as Stripe's clients send it, a bare value without
// quotes or spaces. Exactly one header is allowed. The key must then pass
// [idem.ValidateKey] and format.
func ParseKey(values []string, format KeyFormat) (string, error) {
	switch len(values) {
	case 0:
		return "", errKeyMissing
	case 1:
	default:
		return "", fmt.Errorf("%d Idempotency-Key headers; send exactly one", len(values))
	}
	v := strings.Trim(values[0], " \t")
	var key string
	if strings.HasPrefix(v, `"`) {
		var err error
		if key, err = parseSFString(v); err != nil {
			return "", err
		}
	} else {
		for i := 0; i < len(v); i++ {
			if name, ok := needsQuotes[v[i]]; ok {
				return "", fmt.Errorf(`key has %s at offset %d, which a bare key cannot hold: send the key quoted, as "…" with \" and \\ escaped (RFC 9651)`, name, i)
			}
			if c := v[i]; c < 0x20 || c > 0x7e {
				return "", notASCII(i)
			}
		}
		key = v
	}
	if err := idem.ValidateKey(key); err != nil {
		return "", errors.New(strings.TrimPrefix(err.Error(), idem.ErrInvalid.Error()+": "))
	}
	if format == KeyUUID && !isUUID(key) {
		return "", errors.New("key must be a UUID (8-4-4-4-12 hex digits)")
	}
	return key, nil
}

// needsQuotes are the printable characters a bare key cannot hold, by name
// (an error never quotes the key, nor a character of it).
var needsQuotes = map[byte]string{' ': "a space", '"': "a double quote", '\\': "a backslash", ',': "a comma"}

// notASCII is the error for a byte that no key may hold, at offset i of the
// header's value.
func notASCII(i int) error {
	return fmt.Errorf("key has a byte that is not printable ASCII at offset %d: a key is 1 to 255 characters of printable ASCII (a UUID makes a good one)", i)
}

// parseSFString parses an RFC 9651 sf-string that makes up the whole value.
func parseSFString(v string) (string, error) {
	var b strings.Builder
	for i := 1; i < len(v); i++ {
		switch c := v[i]; {
		case c == '\\':
			i++
			if i == len(v) || (v[i] != '"' && v[i] != '\\') {
				return "", errors.New(`quoted key has a backslash not followed by " or \`)
			}
			b.WriteByte(v[i])
		case c == '"':
			if i != len(v)-1 {
				return "", errors.New("quoted key has characters after its closing quote")
			}
			return b.String(), nil
		case c < 0x20 || c > 0x7e:
			return "", notASCII(i)
		default:
			b.WriteByte(c)
		}
	}
	return "", errors.New("quoted key has no closing quote")
}

func isUUID(s string) bool {
	if len(s) != 36 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch i {
		case 8, 13, 18, 23:
			if c != '-' {
				return false
			}
		default:
			if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
				return false
			}
		}
	}
	return true
}

// keyOf reads the key of a request's headers: Idempotency-Key, or
// X-Idempotency-Key, or both when they name the same key.
func keyOf(h http.Header, format KeyFormat) (string, error) {
	key, err := ParseKey(h.Values(HeaderKey), format)
	x := h.Values(HeaderXKey)
	if len(x) == 0 {
		return key, err
	}
	xkey, xerr := ParseKey(x, format)
	switch {
	case errors.Is(err, errKeyMissing):
		return xkey, xerr
	case err != nil:
		return "", err
	case xerr != nil:
		return "", fmt.Errorf("%s: %w", HeaderXKey, xerr)
	case xkey != key:
		return "", fmt.Errorf("%s and %s name two different keys", HeaderKey, HeaderXKey)
	}
	return key, nil
}

// HasKey reports whether a request's headers carry a key (HeaderKey or
// HeaderXKey), well formed or not.
func HasKey(h http.Header) bool { return len(h.Values(HeaderKey)) > 0 || len(h.Values(HeaderXKey)) > 0 }
