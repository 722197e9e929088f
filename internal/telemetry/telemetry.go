// Package telemetry gives `idem proxy` and `idem demo` their Prometheus
// metrics and OpenTelemetry traces.
//
// Metrics (served at /metrics on the admin listener):
//
//	idem_requests_total{outcome}                          what became of each covered request (httpidem.Observed*)
//	idem_store_operation_duration_seconds{store,operation,result}  store latency: result ok, lease_lost, not_found, unavailable, error
//	idem_leases_lost_total                                writes refused because the lease was lost
//	idem_reconciler_records{kind}                         the last reconciler pass: stale, waiting, unknown
//	idem_reconciler_settled_total{outcome}                records the reconciler settled: completed, failed
//
// Traces are off unless the standard OpenTelemetry variables ask for them
// (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, with
// OTEL_TRACES_EXPORTER unset or "otlp"; OTEL_SERVICE_NAME names the
// service). Then each request is a span, each store operation a child span.
// An endpoint variable that is set must be an http:// or https:// URL with
// a host (a / ? # @ : or % in its password percent-encoded, and so an @ in
// the path of one with a port): [New] refuses it otherwise, naming the
// variable, never its password. [SetLogger] sends
// the OpenTelemetry SDK's own log lines to the process's logger.
package telemetry

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/redact"
	"github.com/idemhq/idem/reconcile"
	"github.com/idemhq/idem/store"
)

// Telemetry holds a process's metrics and tracer.
type Telemetry struct {
	registry   *prometheus.Registry
	requests   *prometheus.CounterVec
	storeOps   *prometheus.HistogramVec
	leasesLost prometheus.Counter
	records    *prometheus.GaugeVec
	settled    *prometheus.CounterVec
	tracer     trace.Tracer
	shutdown   func(context.Context) error
}

// New sets up metrics, and traces when the environment (getenv) asks for them.
func New(ctx context.Context, getenv func(string) string) (*Telemetry, error) {
	t := &Telemetry{
		registry: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "idem_requests_total",
			Help: "Covered requests by what became of them."}, []string{"outcome"}),
		storeOps: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "idem_store_operation_duration_seconds",
			Help: "Store operation latency.", Buckets: prometheus.ExponentialBuckets(0.0001, 2.5, 14)},
			[]string{"store", "operation", "result"}),
		leasesLost: prometheus.NewCounter(prometheus.CounterOpts{Name: "idem_leases_lost_total",
			Help: "Writes refused because the lease was lost (taken over, settled elsewhere, or expired)."}),
		records: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "idem_reconciler_records",
			Help: "Records seen by the last reconciler pass."}, []string{"kind"}),
		settled: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "idem_reconciler_settled_total",
			Help: "Records the reconciler settled."}, []string{"outcome"}),
		tracer:   noop.NewTracerProvider().Tracer("idem"),
		shutdown: func(context.Context) error { return nil },
	}
	t.registry.MustRegister(t.requests, t.storeOps, t.leasesLost, t.records, t.settled,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	endpoint, err := tracesEndpoint(getenv)
	if err != nil {
		return nil, err
	}
	if endpoint == "" {
		return t, nil
	}
	exp, err := otlptracehttp.New(ctx, otlptracehttp.WithEndpointURL(endpoint))
	if err != nil {
		return nil, err
	}
	name := getenv("OTEL_SERVICE_NAME")
	if name == "" {
		name = "idem"
	}
	res, err := resource.Merge(resource.Default(), resource.NewSchemaless(semconv.ServiceName(name)))
	if err != nil {
		return nil, err
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	t.tracer, t.shutdown = tp.Tracer("github.com/idemhq/idem"), tp.Shutdown
	return t, nil
}

// tracesEndpoint is the URL the traces go to, as the environment (getenv)
// says, or "" when traces are off. The endpoint variables are checked here,
// before the SDK reads them (it reads the process's environment too): the
// SDK logs a URL it cannot parse whole, password included, and then sends
// the traces to its default, https://localhost:4318. A variable that is set
// and is no http:// or https:// URL with a host is refused, with an error
// that names it and shows its value without its password.
func tracesEndpoint(getenv func(string) string) (string, error) {
	if exporter := getenv("OTEL_TRACES_EXPORTER"); exporter != "" && exporter != "otlp" {
		return "", nil
	}
	for _, name := range []string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"} {
		if err := checkEndpoint(name, getenv(name)); err != nil {
			return "", err
		}
	}
	if endpoint := getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"); endpoint != "" {
		return endpoint, nil
	}
	if base := getenv("OTEL_EXPORTER_OTLP_ENDPOINT"); base != "" {
		return strings.TrimSuffix(base, "/") + "/v1/traces", nil
	}
	return "", nil
}

// checkEndpoint checks the value v of the endpoint variable name, when set.
// Its error never quotes url's, which may hold part of the password (a / in
// a password makes url read what follows the : as a port).
func checkEndpoint(name, v string) error {
	if v == "" {
		return nil
	}
	u, err := url.Parse(v)
	if err != nil || redact.HiddenUserInfo(v) { // a password read as a port and a path: see redact.HiddenUserInfo
		return fmt.Errorf("%w: $%s: %s is not a valid URL (%s)", idem.ErrInvalid, name, redact.URL(v), redact.PercentEncode)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("%w: $%s: %s: want an http:// or https:// URL with a host (OTLP/HTTP), such as http://collector:4318",
			idem.ErrInvalid, name, redact.URL(v))
	}
	return nil
}

// FlushTimeout bounds the flushing of the traces at exit: a collector that
// accepts connections and never answers must not hold the process past its
// shutdown for long (spans not flushed by then are dropped).
const FlushTimeout = 3 * time.Second

// Shutdown flushes the traces, for at most FlushTimeout (less when ctx ends
// sooner).
func (t *Telemetry) Shutdown(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, FlushTimeout)
	defer cancel()
	return t.shutdown(ctx)
}

// Metrics serves the Prometheus metrics.
func (t *Telemetry) Metrics() http.Handler {
	return promhttp.HandlerFor(t.registry, promhttp.HandlerOpts{})
}

// Counts are the counters of a process since it started, as /metrics
// serves them, for the console.
type Counts struct {
	// Requests counts covered requests by outcome (httpidem.Observed*).
	Requests map[string]float64 `json:"requests"`
	// StoreCalls is the number of store operations, StoreSeconds their
	// total duration and StoreErrors those that failed (unavailable or
	// error; a lost lease or a missing record is an answer).
	StoreCalls   float64 `json:"store_calls"`
	StoreSeconds float64 `json:"store_seconds"`
	StoreErrors  float64 `json:"store_errors"`
	// Reconciled counts the records the reconciler settled, by outcome
	// (completed, failed); LastPass is what its last pass saw, by kind
	// (stale, waiting, unknown). Empty where no reconciler runs.
	Reconciled map[string]float64 `json:"reconciled,omitempty"`
	LastPass   map[string]float64 `json:"last_pass,omitempty"`
}

// Counts reads the counters.
func (t *Telemetry) Counts() Counts {
	c := Counts{Requests: map[string]float64{}}
	families, err := t.registry.Gather()
	if err != nil {
		return c
	}
	add := func(m *map[string]float64, k string, v float64) {
		if *m == nil {
			*m = map[string]float64{}
		}
		(*m)[k] += v
	}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			switch f.GetName() {
			case "idem_requests_total":
				c.Requests[label(m, "outcome")] += m.GetCounter().GetValue()
			case "idem_store_operation_duration_seconds":
				h := m.GetHistogram()
				n := float64(h.GetSampleCount())
				c.StoreCalls += n
				c.StoreSeconds += h.GetSampleSum()
				if r := label(m, "result"); r == "unavailable" || r == "error" {
					c.StoreErrors += n
				}
			case "idem_reconciler_settled_total":
				add(&c.Reconciled, label(m, "outcome"), m.GetCounter().GetValue())
			case "idem_reconciler_records":
				add(&c.LastPass, label(m, "kind"), m.GetGauge().GetValue())
			}
		}
	}
	return c
}

func label(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// Health registers the gauges of a store's health, read from status at
// each scrape: idem_store_up, idem_store_crash_safe,
// idem_store_restarts_total and idem_journal_pending.
func (t *Telemetry) Health(store string, status func() (up, crashSafe bool, restarts, pending int)) {
	labels := prometheus.Labels{"store": store}
	b := func(v bool) float64 {
		if v {
			return 1
		}
		return 0
	}
	t.registry.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "idem_store_up", ConstLabels: labels,
			Help: "1 when the store answered the last health check."}, func() float64 {
			up, _, _, _ := status()
			return b(up)
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "idem_store_crash_safe", ConstLabels: labels,
			Help: "1 when the store's server keeps every acknowledged write across a crash (from its settings); 0 when a crash loses records."}, func() float64 {
			_, safe, _, _ := status()
			return b(safe)
		}),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "idem_store_restarts_total", ConstLabels: labels,
			Help: "Restarts (or failovers) of the store's server seen since start."}, func() float64 {
			_, _, restarts, _ := status()
			return float64(restarts)
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "idem_journal_pending",
			Help: "Outcomes waiting in the journal for the store to take them."}, func() float64 {
			_, _, _, pending := status()
			return float64(pending)
		}),
	)
}

// Observe counts what became of a request, for httpidem.Config.Observe, and
// labels its span.
func (t *Telemetry) Observe(r *http.Request, outcome string) {
	t.requests.WithLabelValues(outcome).Inc()
	trace.SpanFromContext(r.Context()).SetAttributes(attribute.String("idem.outcome", outcome))
}

// OnPass records a reconciler pass, for reconcile.Config.OnPass.
func (t *Telemetry) OnPass(rep reconcile.Report) {
	t.records.WithLabelValues("stale").Set(float64(rep.Stale))
	t.records.WithLabelValues("waiting").Set(float64(rep.Waiting))
	t.records.WithLabelValues("unknown").Set(float64(rep.Unknown))
	t.settled.WithLabelValues("completed").Add(float64(rep.Completed))
	t.settled.WithLabelValues("failed").Add(float64(rep.Failed))
}

// Wrap makes each request a span, continuing a trace the caller propagated.
func (t *Telemetry) Wrap(h http.Handler) http.Handler {
	prop := propagation.TraceContext{}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := prop.Extract(r.Context(), propagation.HeaderCarrier(r.Header))
		ctx, span := t.tracer.Start(ctx, r.Method+" "+r.URL.Path, trace.WithSpanKind(trace.SpanKindServer),
			trace.WithAttributes(attribute.String("http.request.method", r.Method), attribute.String("url.path", r.URL.Path)))
		defer span.End()
		h.ServeHTTP(w, r.WithContext(ctx))
	})
}

// Store instruments s: a latency observation and a span per operation.
// name labels it (sqlite, postgres, redis, memory).
func (t *Telemetry) Store(name string, s idem.Store) idem.Store {
	return &measured{t: t, name: name, next: s}
}

type measured struct {
	t    *Telemetry
	name string
	next idem.Store
}

var (
	_ idem.Store        = (*measured)(nil)
	_ store.BodyLimiter = (*measured)(nil)
	_ store.TxFinisher  = (*measured)(nil)
)

// Unwrap returns the measured store.
func (s *measured) Unwrap() store.Store { return s.next }

// FinishTx passes a transactional finish on to the wrapped store, measured
// like the other operations; a store that has none gives ErrInvalid.
func (s *measured) FinishTx(ctx context.Context, tx any, p idem.FinishParams) (err error) {
	f, ok := s.next.(store.TxFinisher)
	if !ok {
		return fmt.Errorf("%w: a %s store cannot settle a record in a transaction", idem.ErrInvalid, s.name)
	}
	s.observe(ctx, "finish_tx", func(ctx context.Context) error { err = f.FinishTx(ctx, tx, p); return err })
	return err
}

// MaxBody passes on the wrapped store's limit.
func (s *measured) MaxBody() int { return store.MaxBody(s.next) }

func result(err error) string {
	switch {
	case err == nil:
		return "ok"
	case errors.Is(err, idem.ErrLeaseLost):
		return "lease_lost"
	case errors.Is(err, idem.ErrNotFound):
		return "not_found"
	case errors.Is(err, idem.ErrUnavailable):
		return "unavailable"
	}
	return "error"
}

func (s *measured) observe(ctx context.Context, op string, fn func(context.Context) error) {
	ctx, span := s.t.tracer.Start(ctx, "idem.store."+op, trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attribute.String("idem.store", s.name)))
	start := time.Now()
	err := fn(ctx)
	res := result(err)
	s.t.storeOps.WithLabelValues(s.name, op, res).Observe(time.Since(start).Seconds())
	if res == "lease_lost" {
		s.t.leasesLost.Inc()
	}
	span.SetAttributes(attribute.String("idem.result", res))
	if res == "unavailable" || res == "error" {
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

func (s *measured) Acquire(ctx context.Context, p store.AcquireParams) (r idem.Record, err error) {
	s.observe(ctx, "acquire", func(ctx context.Context) error { r, err = s.next.Acquire(ctx, p); return err })
	return r, err
}

func (s *measured) Renew(ctx context.Context, p store.RenewParams) (err error) {
	s.observe(ctx, "renew", func(ctx context.Context) error { err = s.next.Renew(ctx, p); return err })
	return err
}

func (s *measured) Checkpoint(ctx context.Context, p store.CheckpointParams) (err error) {
	s.observe(ctx, "checkpoint", func(ctx context.Context) error { err = s.next.Checkpoint(ctx, p); return err })
	return err
}

func (s *measured) Finish(ctx context.Context, p idem.FinishParams) (err error) {
	s.observe(ctx, "finish", func(ctx context.Context) error { err = s.next.Finish(ctx, p); return err })
	return err
}

func (s *measured) Get(ctx context.Context, p store.GetParams) (r idem.Record, err error) {
	s.observe(ctx, "get", func(ctx context.Context) error { r, err = s.next.Get(ctx, p); return err })
	return r, err
}

func (s *measured) Scan(ctx context.Context, p store.ScanParams) (r idem.ScanResult, err error) {
	s.observe(ctx, "scan", func(ctx context.Context) error { r, err = s.next.Scan(ctx, p); return err })
	return r, err
}

func (s *measured) List(ctx context.Context, p store.ListParams) (r idem.ScanResult, err error) {
	s.observe(ctx, "list", func(ctx context.Context) error { r, err = s.next.List(ctx, p); return err })
	return r, err
}

func (s *measured) Prune(ctx context.Context, p store.PruneParams) (n int, err error) {
	s.observe(ctx, "prune", func(ctx context.Context) error { n, err = s.next.Prune(ctx, p); return err })
	return n, err
}
