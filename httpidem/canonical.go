package httpidem

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
)

// CanonicalJSON returns the RFC 8785 (JCS) form of a JSON text: object
// members sorted by their names' UTF-16 code units, no insignificant
// whitespace, numbers in their shortest ECMAScript form, strings with the
// minimal escapes. Two texts that differ only in key order or whitespace
// come out identical.
//
// A number with more digits than a float64 keeps (1.0000000000000001,
// which a float reads as 1; an integer past 2^53) is written exactly
// instead, where RFC 8785 would round it: a handler that reads amounts as
// decimals reads two such texts apart, so they must not come out
// identical.
//
// A text in which an object has two members whose names are equal under
// case folding ("amount" and "AMOUNT", or "amount" twice) is refused with
// an error (RFC 8785 admits I-JSON only, which repeats no name):
// encoding/json binds them to one field (the last wins, objects merge), so
// a Go handler reads apart texts that would come out identical.
func CanonicalJSON(data []byte) ([]byte, error) {
	v, err := decodeJSON(data)
	if err != nil {
		return nil, err
	}
	var b bytes.Buffer
	if err := writeCanonical(&b, v); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// errFoldedNames refuses an object with two members whose names are equal
// under case folding.
var errFoldedNames = errors.New("json: member names that differ only in case, or repeated")

func decodeJSON(data []byte) (any, error) {
	// Text that is not UTF-8 is not JSON: a decoder would turn every bad
	// byte into U+FFFD, and two payloads a handler reads apart into one.
	if !utf8.Valid(data) {
		return nil, errors.New("json: not UTF-8")
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF { // a stray '}' or ']' too, which More misses
		return nil, errors.New("json: trailing data after the value")
	}
	// So would a lone surrogate escape ("\ud800"), whatever else the text
	// holds.
	if loneSurrogate(data) {
		return nil, errors.New("json: a lone surrogate escape")
	}
	// And so would two members of an object whose names are equal under
	// case folding: the decoder's map keeps the last of two of one name (so
	// it holds fewer members than the text has colons outside strings, one
	// per member), and keeps apart names that encoding/json binds to one
	// field.
	if n, ok := members(v); !ok || n != colons(data) {
		return nil, errFoldedNames
	}
	return v, nil
}

// members counts the members of the objects in v, and reports false when
// an object has two whose names are equal under case folding: pairwise
// while they are few, by their folded keys when they are more.
func members(v any) (int, bool) {
	n := 0
	switch v := v.(type) {
	case []any:
		for _, e := range v {
			m, ok := members(e)
			if !ok {
				return 0, false
			}
			n += m
		}
	case map[string]any:
		var few [16]string
		var folded map[string]bool
		i := 0 // names of this object seen so far
		for name, e := range v {
			if i < len(few) {
				for _, before := range few[:i] {
					if strings.EqualFold(name, before) {
						return 0, false
					}
				}
				few[i] = name
			} else {
				if i == len(few) {
					folded = make(map[string]bool, 2*i)
					for _, before := range few {
						folded[foldKey(before)] = true
					}
				}
				key := foldKey(name)
				if folded[key] {
					return 0, false
				}
				folded[key] = true
			}
			i++
			m, ok := members(e)
			if !ok {
				return 0, false
			}
			n += m + 1
		}
	}
	return n, true
}

// colons counts the colons of a JSON text outside its strings: in a valid
// text, one per member of its objects.
func colons(data []byte) int {
	n, quoted, escaped := 0, false, false
	for _, c := range data {
		switch {
		case escaped:
			escaped = false
		case quoted && c == '\\':
			escaped = true
		case c == '"':
			quoted = !quoted
		case !quoted && c == ':':
			n++
		}
	}
	return n
}

// foldKey returns name folded as encoding/json folds names to match them
// to fields: each rune the least of those case folding makes it equal to.
// strings.EqualFold(a, b) exactly when foldKey(a) == foldKey(b).
func foldKey(name string) string {
	b := make([]byte, 0, len(name))
	for _, r := range name {
		// SimpleFold steps through the runes equal to r under case folding
		// in increasing order, from the greatest to the least.
		next := unicode.SimpleFold(r)
		for next > r {
			r, next = next, unicode.SimpleFold(next)
		}
		b = utf8.AppendRune(b, next)
	}
	return string(b)
}

// loneSurrogate reports whether a JSON text has a \u escape of a UTF-16
// surrogate that is not half of a pair. (A backslash is in a string in
// JSON, and starts an escape there.)
func loneSurrogate(data []byte) bool {
	hex := func(i int) (rune, bool) {
		if i+6 > len(data) || data[i] != '\\' || data[i+1] != 'u' {
			return 0, false
		}
		r, err := strconv.ParseUint(string(data[i+2:i+6]), 16, 16)
		return rune(r), err == nil
	}
	for i := 0; i < len(data); i++ {
		if data[i] != '\\' {
			continue
		}
		r, ok := hex(i)
		switch {
		case !ok:
			i++ // another escape: \\, \", \n...
		case utf16.IsSurrogate(r) && r < 0xdc00:
			low, ok := hex(i + 6)
			if !ok || low < 0xdc00 || low > 0xdfff {
				return true
			}
			i += 11
		case utf16.IsSurrogate(r):
			return true
		default:
			i += 5
		}
	}
	return false
}

// exactNumber returns, for a number literal whose value the float64 it
// reads as does not print back (past 2^53, or with more digits than a
// float64 keeps: 1.0000000000000001, which reads as 1), that value exactly:
// in plain digits when it is an integer with at most 20 trailing zeros
// (so an integer literal comes out as written), else as an integer
// mantissa and an exponent (10000000000000001e-16). Two such literals that
// a float would round together are two payloads: a handler that reads
// amounts as decimals (Python's Decimal, Java's BigDecimal, json.Number)
// reads them apart. A literal whose value the float prints back is for
// the float form, as RFC 8785 has it, so that 1.10 and 1.1 stay one.
func exactNumber(n string, f float64) (string, bool, error) {
	lit, ok := decimalOf(n)
	if !ok {
		return "", false, errors.New("json: number out of range for canonical form")
	}
	if !math.IsInf(f, 0) {
		if back, _ := decimalOf(strconv.FormatFloat(f, 'g', -1, 64)); back == lit {
			return "", false, nil
		}
	}
	var b strings.Builder
	if lit.neg {
		b.WriteByte('-')
	}
	b.WriteString(lit.digits)
	if lit.exp >= 0 && lit.exp <= 20 {
		b.WriteString(strings.Repeat("0", lit.exp))
	} else {
		b.WriteString("e" + strconv.Itoa(lit.exp))
	}
	return b.String(), true, nil
}

// decimal is a number's exact value: digits (no leading or trailing
// zeros; empty for zero, which has no sign) times ten to exp.
type decimal struct {
	neg    bool
	digits string
	exp    int
}

// decimalOf reads a JSON number literal (or a float as strconv formats
// it); false when its exponent is past what an int holds.
func decimalOf(n string) (decimal, bool) {
	var d decimal
	n, d.neg = strings.CutPrefix(n, "-")
	mantissa, exponent, hasExp := strings.Cut(strings.ToLower(n), "e")
	whole, frac, _ := strings.Cut(mantissa, ".")
	if hasExp {
		e, err := strconv.Atoi(exponent)
		if err != nil || e > 1<<40 || e < -(1<<40) {
			return d, false
		}
		d.exp = e
	}
	digits := strings.TrimLeft(whole+frac, "0")
	d.exp -= len(frac)
	trimmed := strings.TrimRight(digits, "0")
	d.exp += len(digits) - len(trimmed)
	d.digits = trimmed
	if d.digits == "" {
		return decimal{}, true
	}
	return d, true
}

func writeCanonical(b *bytes.Buffer, v any) error {
	switch v := v.(type) {
	case nil:
		b.WriteString("null")
	case bool:
		b.WriteString(strconv.FormatBool(v))
	case json.Number:
		f, err := strconv.ParseFloat(string(v), 64)
		if err != nil && !errors.Is(err, strconv.ErrRange) {
			return errors.New("json: number out of range for canonical form")
		}
		exact, ok, err := exactNumber(string(v), f)
		switch {
		case err != nil:
			return err
		case ok:
			b.WriteString(exact)
		case math.IsInf(f, 0):
			return errors.New("json: number out of range for canonical form")
		default:
			b.WriteString(es6Number(f))
		}
	case string:
		writeString(b, v)
	case []any:
		b.WriteByte('[')
		for i, e := range v {
			if i > 0 {
				b.WriteByte(',')
			}
			if err := writeCanonical(b, e); err != nil {
				return err
			}
		}
		b.WriteByte(']')
	case map[string]any:
		keys := make([]string, 0, len(v))
		for k := range v {
			keys = append(keys, k)
		}
		slices.SortFunc(keys, func(a, b string) int { return slices.Compare(utf16.Encode([]rune(a)), utf16.Encode([]rune(b))) })
		b.WriteByte('{')
		for i, k := range keys {
			if i > 0 {
				b.WriteByte(',')
			}
			writeString(b, k)
			b.WriteByte(':')
			if err := writeCanonical(b, v[k]); err != nil {
				return err
			}
		}
		b.WriteByte('}')
	}
	return nil
}

// es6Number formats f as ECMAScript's Number.prototype.toString does, which
// RFC 8785 requires.
func es6Number(f float64) string {
	if f == 0 {
		return "0" // also for -0
	}
	format := byte('e')
	if abs := math.Abs(f); abs >= 1e-6 && abs < 1e21 {
		format = 'f'
	}
	s := strconv.FormatFloat(f, format, -1, 64)
	if format == 'e' {
		// Go writes e-07 and e+07; ECMAScript writes e-7 and e+7.
		if i := strings.IndexByte(s, 'e'); i >= 0 && len(s) > i+3 && s[i+2] == '0' {
			s = s[:i+2] + s[i+3:]
		}
	}
	return s
}

func writeString(b *bytes.Buffer, s string) {
	b.WriteByte('"')
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == '"':
			b.WriteString(`\"`)
		case r == '\\':
			b.WriteString(`\\`)
		case r == '\b':
			b.WriteString(`\b`)
		case r == '\f':
			b.WriteString(`\f`)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r < 0x20:
			b.WriteString(`\u00`)
			b.WriteByte("0123456789abcdef"[r>>4])
			b.WriteByte("0123456789abcdef"[r&0xf])
		default:
			b.WriteString(s[i : i+size])
		}
		i += size
	}
	b.WriteByte('"')
}

// selectFields keeps (include) or drops (exclude) the members named by
// dotted paths ("amount", "card.number") in a decoded JSON value. An
// included path names members as encoding/json binds names to fields,
// level by level: the member whose name is equal to the path's under case
// folding ("Card.Number"), kept under its name as the document has it. An
// excluded path names members exactly.
func selectFields(v any, include, exclude []string) any {
	if len(include) > 0 {
		kept := map[string]any{}
		for _, path := range include {
			names := strings.Split(path, ".")
			if val, ok := lookup(v, names); ok {
				place(kept, names, val)
			}
		}
		v = kept
	}
	for _, path := range exclude {
		remove(v, strings.Split(path, "."))
	}
	return v
}

// lookup returns the member of v that path names under case folding, and
// puts in path the names of it and of the members on the way to it as the
// document has them. There is one such member at most: decodeJSON refuses
// an object with two.
func lookup(v any, path []string) (any, bool) {
	for i, name := range path {
		obj, ok := v.(map[string]any)
		if !ok {
			return nil, false
		}
		if v, ok = obj[name]; ok {
			continue
		}
		for as, val := range obj {
			if strings.EqualFold(as, name) {
				path[i], v, ok = as, val, true
				break
			}
		}
		if !ok {
			return nil, false
		}
	}
	return v, true
}

func place(obj map[string]any, path []string, val any) {
	for _, name := range path[:len(path)-1] {
		next, ok := obj[name].(map[string]any)
		if !ok {
			next = map[string]any{}
			obj[name] = next
		}
		obj = next
	}
	obj[path[len(path)-1]] = val
}

func remove(v any, path []string) {
	obj, ok := v.(map[string]any)
	if !ok {
		return
	}
	if len(path) == 1 {
		delete(obj, path[0])
		return
	}
	remove(obj[path[0]], path[1:])
}
