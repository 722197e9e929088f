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
// parse as a URL is shown by its scheme alone ("postgres://…"), since any
// part of it may be the password.
func URL(s string) string {
	scheme := Scheme(s)
	u, err := url.Parse(s)
	if err != nil || u.Scheme == "" || u.Opaque != "" && strings.ContainsAny(u.Opaque, "@=") {
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
