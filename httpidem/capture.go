package httpidem

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"slices"
	"strings"
)

// neverStored are headers a replay must not repeat: credentials, cookies,
// hop-by-hop headers (RFC 9110 §7.6.1) and per-response ones. Trailer is
// stored apart (storedHeader), with the trailers it declares.
var neverStored = map[string]bool{
	"Set-Cookie": true, "Authorization": true, "Proxy-Authenticate": true, "Proxy-Authorization": true,
	"Connection": true, "Keep-Alive": true, "Te": true, "Trailer": true, "Transfer-Encoding": true,
	"Upgrade": true, "Proxy-Connection": true, "Date": true, HeaderReplayed: true,
}

// StoredHeader returns the headers of h that idem stores for a replay, as
// it stores a handler's: names in canonical form (values under names that
// differ only in case are merged), without credentials, cookies,
// hop-by-hop and per-response headers. A Trailer header is kept, naming
// the trailers kept: their values, in h with the headers, are replayed as
// trailers. For outcomes that come from elsewhere than a handler: a
// resolver's, an operator's.
func StoredHeader(h http.Header) http.Header { return storedHeader(h, nil) }

// storedHeader returns the headers of h a replay may repeat, under their
// canonical names: all but the never-stored ones, or only those in allow
// when it is set. A handler may set a header under any name
// (w.Header()["set-cookie"]), which net/http sends as it is: judged by its
// canonical name, it is never stored either.
func storedHeader(h http.Header, allow map[string]bool) http.Header {
	for name := range h {
		if http.CanonicalHeaderKey(name) != name {
			c := make(http.Header, len(h))
			for name, values := range h {
				for _, v := range values {
					c.Add(name, v)
				}
			}
			h = c
			break
		}
	}
	var drop map[string]bool
	for _, c := range h.Values("Connection") { // headers named by Connection are hop-by-hop too
		for _, name := range strings.Split(c, ",") {
			if drop == nil {
				drop = map[string]bool{}
			}
			drop[http.CanonicalHeaderKey(strings.TrimSpace(name))] = true
		}
	}
	kept := func(name string) bool {
		// A trailer set under http.TrailerPrefix is judged by its own name.
		if len(name) > len(http.TrailerPrefix) && strings.EqualFold(name[:len(http.TrailerPrefix)], http.TrailerPrefix) {
			name = http.CanonicalHeaderKey(name[len(http.TrailerPrefix):])
		}
		return !neverStored[name] && !drop[name] && (allow == nil || allow[name])
	}
	n, values := 0, 0
	for name, vs := range h {
		if kept(name) {
			n, values = n+1, values+len(vs)
		}
	}
	// One array holds every value: the copy is two allocations, not one a
	// header.
	all := make([]string, 0, values)
	out := make(http.Header, n)
	for name, vs := range h {
		if kept(name) {
			all = append(all, vs...)
			out[name] = all[len(all)-len(vs) : len(all) : len(all)]
		}
	}
	// The trailers declared and kept, declared again: a replay sends their
	// values after the body, as the handler did.
	var trailers []string
	for name := range declared(h) {
		if kept(name) {
			trailers = append(trailers, name)
		}
	}
	if len(trailers) > 0 {
		slices.Sort(trailers)
		out["Trailer"] = []string{strings.Join(trailers, ", ")}
	}
	return out
}

// declared returns the names of the trailers h declares in its Trailer
// header, in canonical form (nil when none).
func declared(h http.Header) map[string]bool {
	var names map[string]bool
	for _, v := range h["Trailer"] {
		for _, name := range strings.Split(v, ",") {
			if name = strings.TrimSpace(name); name != "" {
				if names == nil {
					names = map[string]bool{}
				}
				names[http.CanonicalHeaderKey(name)] = true
			}
		}
	}
	return names
}

// send writes a response with header h to w: the header, then body, then
// the values of the trailers h declares, as trailers (a handler sets them
// once the body is written; net/http would send them as headers too if
// they were there before).
func send(w http.ResponseWriter, h http.Header, status int, body []byte) {
	trailers := declared(h)
	dst := w.Header()
	for name, values := range h {
		if !trailers[name] {
			dst[name] = values
		}
	}
	w.WriteHeader(status)
	w.Write(body)
	for name := range trailers {
		if values, ok := h[name]; ok {
			dst[name] = values
		}
	}
}

// capture buffers a handler's response so that its outcome can be stored
// before the client sees it. A response that outgrows the limit, is flushed
// (streamed) or hijacked is passed through from then on and marked omitted:
// it is delivered once and cannot be replayed.
type capture struct {
	w        http.ResponseWriter
	header   http.Header
	status   int
	body     bytes.Buffer
	limit    int64
	passing  bool // the response is going straight to the client
	hijacked bool
	// clientGone: a write of the response passed through to the client
	// failed. The response (its status) was the outcome.
	clientGone bool
	// call, when set, gives the Idempotency-Expires of a response passed
	// through: its record is made once the handler is done.
	call *call
}

var (
	_ http.Flusher  = (*capture)(nil)
	_ http.Hijacker = (*capture)(nil)
	_ io.ReaderFrom = (*capture)(nil)
)

func newCapture(w http.ResponseWriter, limit int64) *capture {
	return &capture{w: w, header: http.Header{}, limit: limit}
}

// Header is the handler's header map, the same one for the whole response
// (as net/http's): a handler may keep it and set its trailers there once
// the body is written, after the response was passed through too.
func (c *capture) Header() http.Header { return c.header }

// WriteHeader panics on a status that is not three digits, as net/http's
// does: the handler stops there, and its outcome is unknown.
func (c *capture) WriteHeader(status int) {
	if c.status != 0 || c.hijacked {
		return // superfluous, whatever the code, as net/http's
	}
	if status < 100 || status > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", status))
	}
	if status >= 100 && status < 200 && status != http.StatusSwitchingProtocols {
		c.inform(status)
		return
	}
	c.status = status
	if c.passing {
		c.w.WriteHeader(status)
	}
}

// inform sends an informational answer (103 Early Hints) straight
// through, not as the outcome, with the headers as they are now, as net/http
// sends a 1xx with its header map: the writer's with the handler's in
// place. The writer's are as they were afterwards: the handler's reach it
// with the final answer, as the handler leaves them.
func (c *capture) inform(status int) {
	h := c.w.Header()
	before := maps.Clone(h)
	maps.Copy(h, c.header)
	c.w.WriteHeader(status)
	clear(h)
	maps.Copy(h, before)
}

func (c *capture) Write(p []byte) (int, error) {
	if c.hijacked {
		return 0, http.ErrHijacked
	}
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	if !c.passing && int64(c.body.Len()+len(p)) > c.limit {
		c.passThrough()
	}
	if c.passing {
		n, err := c.w.Write(p)
		c.clientGone = c.clientGone || err != nil
		return n, err
	}
	return c.body.Write(p)
}

// ReadFrom keeps io.Copy efficient while the response is buffered.
func (c *capture) ReadFrom(r io.Reader) (int64, error) {
	var n int64
	buf := make([]byte, 32*1024)
	for {
		m, err := r.Read(buf)
		if m > 0 {
			w, werr := c.Write(buf[:m])
			n += int64(w)
			if werr != nil {
				return n, werr
			}
		}
		if errors.Is(err, io.EOF) {
			return n, nil
		}
		if err != nil {
			return n, err
		}
	}
}

// Flush streams: what was buffered goes out, and so does everything after.
func (c *capture) Flush() {
	if c.hijacked {
		return
	}
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	c.passThrough()
	http.NewResponseController(c.w).Flush()
}

func (c *capture) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	conn, rw, err := http.NewResponseController(c.w).Hijack()
	if err == nil {
		c.hijacked = true
		if c.status == 0 {
			c.status = http.StatusSwitchingProtocols
		}
	}
	return conn, rw, err
}

// Unwrap lets http.ResponseController reach the underlying writer.
func (c *capture) Unwrap() http.ResponseWriter { return c.w }

func (c *capture) passThrough() {
	if c.passing {
		return
	}
	c.passing = true
	h := c.w.Header()
	for name, values := range c.header {
		h[name] = values
	}
	// The promise of a replay (here a 409: a streamed response is not
	// kept) until the record expires, unless what is known now releases
	// the key or leaves the record UNKNOWN, which never expires.
	if c.call != nil {
		if v := c.call.verdict.Load(); v == verdictDefault && !c.call.m.releases(v, c.status) {
			h.Set(HeaderExpires, c.call.expires())
		}
	}
	c.w.WriteHeader(c.status)
	if _, err := c.w.Write(c.body.Bytes()); err != nil {
		c.clientGone = true
	}
	c.body = bytes.Buffer{}
}

// omitted reports whether the response was delivered without being kept.
func (c *capture) omitted() bool { return c.passing || c.hijacked }

// deliver sends a buffered response to the client, with an
// Idempotency-Expires header when expires is not empty.
func (c *capture) deliver(expires string) {
	if c.passing {
		// The trailers the handler set after the response went through:
		// net/http sends them from the writer's map once the handler
		// returns.
		h := c.w.Header()
		for name := range declared(c.header) {
			if v, ok := c.header[name]; ok {
				h[name] = v
			}
		}
		for name, v := range c.header {
			if strings.HasPrefix(name, http.TrailerPrefix) {
				h[name] = v
			}
		}
	}
	if c.omitted() {
		return
	}
	if c.status == 0 {
		c.status = http.StatusOK
	}
	if expires != "" {
		c.header.Set(HeaderExpires, expires)
	}
	send(c.w, c.header, c.status, c.body.Bytes())
}
