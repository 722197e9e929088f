// Package redact shows URLs and DSNs fit for a message or a log line: the
// one rule every face of idem follows, since a store's DSN, a resolver's or
// an upstream's URL, and a URL given to idem verify may carry a password
// or a token.
package redact

import (
	"errors"
	"net/url"
	"regexp"
	"strings"
)

// URL returns s without the password of its user-info nor the values of
// its query options that hold secrets (password=, sslpassword=, a token, a
// key…), and, for an http or https URL, without a user name alone (an API's
// key sent as the user name, as Stripe's are). A string that does not
// parse as a URL, or whose user-info url.Parse does not read as such (see
// [HiddenUserInfo]), is shown by its scheme alone ("postgres://…"), since
// any part of it may be the password.
func URL(s string) string {
	scheme := Scheme(s)
	u, err := url.Parse(s)
	if err != nil || u.Scheme == "" || u.Opaque != "" && strings.ContainsAny(u.Opaque, "@=") || HiddenUserInfo(s) {
		if scheme == "" {
			return "(not a URL)"
		}
		return scheme + "://…"
	}
	if u.User != nil {
		if _, ok := u.User.Password(); ok {
			u.User = url.UserPassword(u.User.Username(), "xxxxx")
		} else if u.Scheme == "http" || u.Scheme == "https" {
			u.User = url.User("xxxxx")
		}
	}
	if u.RawQuery != "" {
		parts := strings.Split(u.RawQuery, "&")
		for i, p := range parts {
			if k, _, ok := strings.Cut(p, "="); ok && SecretOption(k) {
				parts[i] = k + "=xxxxx"
			}
		}
		u.RawQuery = strings.Join(parts, "&")
	}
	u.Fragment, u.RawFragment = "", ""
	return u.String()
}

// PercentEncode is what a message refusing a URL that does not parse, or
// whose user-info url.Parse does not read as such, asks for.
const PercentEncode = "a / ? # @ : or % in the user name or password must be percent-encoded, and an @ after the host written %40"

// HiddenUserInfo reports whether s, a URL, may hold a user-info (a
// password) that url.Parse does not read as one, and puts in the host, the
// path, the query or the fragment instead: an unencoded / ? or # in a
// password ends the authority early. When what comes before it reads as a
// host and a port (user "app" and a password "/hunter2", "2024/hunter2" or
// "?hunter2" make "app:" or "app:2024" the host), url.Parse succeeds, with
// no user-info, and the rest of the password, up to the @, in the path or
// the query. Such a URL has no user-info, an @ after its authority, and
// an authority of the shape NAME:DIGITS (or NAME:, an empty port); or, for
// a / in the user name, a path with a : before its first @. It is not told
// apart from a URL with a port whose path or query holds an @ of its own
// (http://api:8080/users/@me): that one is reported too, and is written
// unambiguously with the @ percent-encoded (%40). An @ after the authority
// of a URL without a port (http://api/users/@me), or of one whose
// user-info url.Parse reads, is not reported.
func HiddenUserInfo(s string) bool {
	scheme := Scheme(s)
	rest, ok := strings.CutPrefix(s, scheme+"://")
	if !ok || scheme == "" {
		return false
	}
	end := strings.IndexAny(rest, "/?#")
	if end < 0 {
		return false
	}
	authority, tail := rest[:end], rest[end:]
	at := strings.IndexByte(tail, '@')
	if at < 0 || strings.Contains(authority, "@") { // none, or read as one
		return false
	}
	if !strings.HasPrefix(authority, "[") { // an IPv6 literal is no user name
		if colon := strings.LastIndexByte(authority, ':'); colon >= 0 && allDigits(authority[colon+1:]) {
			return true
		}
	}
	path, _, _ := strings.Cut(tail[:at], "?")
	path, _, _ = strings.Cut(path, "#")
	return len(path) == len(tail[:at]) && strings.Contains(path, ":")
}

// allDigits reports whether s holds nothing but ASCII digits (or nothing).
func allDigits(s string) bool {
	for _, c := range s {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// Err returns err without what a *url.Error adds to it: the URL it failed
// on, quoted whole (an http.Client's error names the request's URL, query
// included).
func Err(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err
	}
	return err
}

// urlScheme is what may begin a URL: its scheme.
var urlScheme = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9+.-]*$`)

// Scheme is the scheme of s, or "" when what comes before its first colon
// is no scheme (and may be a secret).
func Scheme(s string) string {
	scheme, _, _ := strings.Cut(s, ":")
	if !urlScheme.MatchString(scheme) {
		return ""
	}
	return scheme
}

// SecretOption reports whether a query option's name holds a secret.
func SecretOption(name string) bool {
	name = strings.ToLower(name)
	for _, s := range []string{"password", "passwd", "secret", "token", "key", "signature", "auth"} {
		if strings.Contains(name, s) {
			return true
		}
	}
	return false
}
