package telemetry

import (
	"context"
	"fmt"
	"log/slog"
	"net/url"
	"regexp"
	"strings"

	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel"

	"github.com/idemhq/idem/internal/redact"
)

// SetLogger sends what the OpenTelemetry SDK logs by itself to log: the
// lines of its internal logger (a variable it cannot parse, say) and the
// errors it hands its error handler (a failed export: "traces export: Post
// …"). So a JSON log holds only JSON lines. Any URL in those lines is shown
// without its password (see [redact.URL]), and the SDK's lines about
// OTEL_EXPORTER_OTLP_HEADERS without the headers they quote (a token). The
// SDK's logger and error handler are the process's: the last call wins.
// Without a call, the SDK writes plain text to the standard error.
func SetLogger(log *slog.Logger) {
	if log == nil {
		log = slog.Default()
	}
	sdk := slog.New(redacting{log.Handler()}).With("sdk", "opentelemetry")
	otel.SetLogger(logr.FromSlogHandler(sdk.Handler()))
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		sdk.Warn("the OpenTelemetry SDK failed: traces may be lost", "err", err)
	}))
}

// redacting is a slog.Handler that masks the secrets of what the SDK logs
// before next gets it.
type redacting struct{ next slog.Handler }

func (h redacting) Enabled(ctx context.Context, level slog.Level) bool {
	return h.next.Enabled(ctx, level)
}

func (h redacting) Handle(ctx context.Context, r slog.Record) error {
	// The SDK's lines about the headers variable quote the header (its
	// "input", "key" or "value"): an Authorization header's token.
	headers := strings.Contains(strings.ToLower(r.Message), "header")
	out := slog.NewRecord(r.Time, r.Level, redactText(r.Message), r.PC)
	r.Attrs(func(a slog.Attr) bool {
		out.AddAttrs(redactAttr(a, headers))
		return true
	})
	return h.next.Handle(ctx, out)
}

func (h redacting) WithAttrs(attrs []slog.Attr) slog.Handler {
	for i, a := range attrs {
		attrs[i] = redactAttr(a, false)
	}
	return redacting{h.next.WithAttrs(attrs)}
}

func (h redacting) WithGroup(name string) slog.Handler { return redacting{h.next.WithGroup(name)} }

// redactAttr is a with the URLs in its value redacted; headers masks the
// whole value of every attribute but the error.
func redactAttr(a slog.Attr, headers bool) slog.Attr {
	v := a.Value.Resolve()
	switch {
	case v.Kind() == slog.KindGroup:
		group := v.Group()
		attrs := make([]slog.Attr, len(group))
		for i, g := range group {
			attrs[i] = redactAttr(g, headers)
		}
		return slog.Attr{Key: a.Key, Value: slog.GroupValue(attrs...)}
	case headers && a.Key != "err" && a.Key != "sdk":
		return slog.String(a.Key, "xxxxx")
	case v.Kind() == slog.KindString:
		return slog.String(a.Key, redactText(v.String()))
	case v.Kind() == slog.KindAny:
		switch x := v.Any().(type) {
		case nil:
			return a
		case error:
			return slog.String(a.Key, redactText(x.Error()))
		case *url.URL:
			if x == nil {
				return a
			}
			return slog.String(a.Key, redact.URL(x.String()))
		default:
			return slog.String(a.Key, redactText(fmt.Sprintf("%+v", x)))
		}
	}
	return slog.Attr{Key: a.Key, Value: v} // a number, a time, a duration: no URL
}

// urlInText finds what looks like a URL in a line of text: from its scheme
// to the next space or quote.
var urlInText = regexp.MustCompile(`[A-Za-z][A-Za-z0-9+.-]*://[^\s"'<>]*`)

// redactText is s with every URL in it redacted (see [redact.URL]): one that
// does not parse is shown by its scheme alone.
func redactText(s string) string {
	return urlInText.ReplaceAllStringFunc(s, redact.URL)
}
