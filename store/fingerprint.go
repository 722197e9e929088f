package store

import "strings"

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
