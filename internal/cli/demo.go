package cli

import (
	"cmp"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/console"
	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/proxy"
	"github.com/idemhq/idem/internal/redact"
	"github.com/idemhq/idem/internal/storeopen"
	"github.com/idemhq/idem/internal/telemetry"
	"github.com/idemhq/idem/reconcile"
)

// runDemo serves the reference payments service, a simulated card acquirer
// (unless --acquirer names one) and a reconciler, on loopback.
func runDemo(ctx context.Context, args []string, env Env, stdout, stderr io.Writer) (code int) {
	fs := newFlags("demo")
	listen := fs.String("listen", "127.0.0.1:8080", "`address` of the payments API [$IDEM_LISTEN]")
	acquirerURL := fs.String("acquirer", "", "`URL` of a card acquirer to use instead of starting the simulated one")
	acquirerListen := fs.String("acquirer-listen", "127.0.0.1:8090", "`address` of the simulated acquirer")
	store := fs.String("store", "sqlite:idem-demo.db", "the store, a `DSN`: sqlite:PATH or postgres://… (the ledger lives in the same database) [$IDEM_STORE]")
	lease := fs.Duration("lease", idem.DefaultLease, "lease length [$IDEM_LEASE]")
	grace := fs.Duration("grace", 10*time.Second, "how long past its lease the reconciler leaves a record to its owner; 0s for none")
	every := fs.Duration("reconcile-every", 2*time.Second, "time between reconciler passes")
	admin := fs.String("admin-listen", "127.0.0.1:8091", "`address` of /healthz, /readyz, /metrics (Prometheus) and the console (/console/); empty: none [$IDEM_ADMIN_LISTEN]")
	token := fs.String("admin-token", "", "`token` the console's actions need (default: one made up and printed at start) [$IDEM_ADMIN_TOKEN]")
	auditLog := fs.String("audit-log", "idem-demo-audit.log", "`file` the console's actions are appended to [$IDEM_AUDIT_LOG]")
	journal := fs.String("journal-dir", "idem-demo-journal", "`directory` where outcomes wait while the store is unreachable (none: memory only) [$IDEM_JOURNAL_DIR]")
	newLog := logFlag(fs, stderr)
	if err := parseFlagsOnly(fs, args, stdout, stderr); err != nil {
		return exitStatus(err)
	}
	if err := applyEnv(fs, env); err != nil {
		usageError(stderr, fs.Name(), err.Error())
		return 2
	}
	if err := checkGrace(*grace); err != nil {
		usageError(stderr, fs.Name(), err.Error())
		return 2
	}
	if *every <= 0 {
		usageError(stderr, fs.Name(), fmt.Sprintf("--reconcile-every %s: want a positive duration, such as 2s", *every))
		return 2
	}
	if strings.TrimSpace(*journal) == "" {
		usageError(stderr, fs.Name(), "--journal-dir: "+emptyError("journal_dir").Error())
		return 2
	}
	if k := storeopen.Kind(*store); k != "sqlite" && k != "postgres" {
		// Say the kind only when it is one: a DSN with no scheme (a libpq
		// key=value one) may hold a password anywhere.
		not := "a sqlite: or postgres:// DSN"
		if strings.Contains(*store, ":") && redact.Scheme(*store) != "" {
			not = k
		}
		usageError(stderr, fs.Name(), "--store: the demo keeps its ledger in the store's database, so it takes sqlite:PATH or postgres://…, not "+not)
		return 2
	}
	if *acquirerURL != "" {
		if _, err := payments.ParseAcquirerURL(*acquirerURL); err != nil {
			usageError(stderr, fs.Name(), "--acquirer: "+message(err))
			return 2
		}
	}
	log, err := newLog()
	if err != nil {
		usageError(stderr, fs.Name(), err.Error())
		return 2
	}
	failed := func(err error) int { return fail(stderr, fs.Name(), err) }

	opened, err := storeopen.Open(ctx, *store)
	if err != nil {
		return failed(err)
	}
	defer opened.Close()
	tel, err := telemetry.New(ctx, env)
	if err != nil {
		return failed(err)
	}
	defer tel.Shutdown(context.Background()) // bounded by telemetry.FlushTimeout
	measured := tel.Store(opened.Kind, opened.Store)
	db, err := payments.NewDB(measured)
	if err != nil {
		return failed(err)
	}
	eng, err := idem.New(idem.Config{Store: measured, Lease: *lease, JournalDir: proxy.Config{Engine: idem.Config{JournalDir: *journal}}.JournalDir(), Logger: log})
	if err != nil {
		return failed(err)
	}
	// One deadline from the first signal: /readyz says not ready, the API
	// stops accepting and drains, then the simulated acquirer it calls, then
	// the admin listener; the engine's close gets what is left.
	stop := &proxy.Stop{}
	defer stop.Release()
	defer func() {
		if !closeEngine(stop.Begin(), eng, log) && code == 0 {
			code = 1 // work left: the last log line says what
		}
	}()
	servers := &proxy.Servers{Log: log}
	defer func() { servers.Shutdown(stop.Begin()) }() // when it fails before Run
	// serve names the flag of an address it cannot listen on (a port in
	// use): the demo has three.
	serve := func(listen func(string, http.Handler) (string, error), flag, addr string, h http.Handler) (string, error) {
		got, err := listen(addr, h)
		if err != nil {
			return "", fmt.Errorf("--%s %s: %w", flag, addr, err)
		}
		return "http://" + got, nil
	}
	if *acquirerURL == "" {
		if *acquirerURL, err = serve(servers.ListenBackend, "acquirer-listen", *acquirerListen, payments.NewAcquirer(true, uint64(time.Now().UnixNano()))); err != nil {
			return failed(err)
		}
		fmt.Fprintf(stdout, "simulated card acquirer on %s (switch faults with PUT %s/faults)\n", *acquirerURL, *acquirerURL)
	}
	svc, err := payments.New(payments.Config{Engine: eng, DB: db, AcquirerURL: *acquirerURL, Logger: log, Observe: tel.Observe})
	if err != nil {
		return failed(err)
	}
	if err := svc.Migrate(ctx); err != nil {
		return failed(err)
	}
	h, err := svc.Handler()
	if err != nil {
		return failed(err)
	}
	rec, err := reconcile.New(reconcile.Config{Engine: eng, Resolver: svc, Grace: graceOf(*grace), Interval: *every, Logger: log, OnPass: tel.OnPass})
	if err != nil {
		return failed(err)
	}
	rec.Start(ctx)
	defer rec.Stop()
	api, err := serve(servers.Listen, "listen", *listen, tel.Wrap(h))
	if err != nil {
		return failed(err)
	}
	if *admin != "" {
		made := *token == ""
		secret := cmp.Or(*token, rand.Text())
		con, err := newConsole(eng, tel, console.Config{Token: secret}, *auditLog, log)
		if err != nil {
			return failed(err)
		}
		health := watchHealth(ctx, eng, opened, tel, log)
		servers.OnStop = health.SetStopping
		url, err := serve(servers.ListenAdmin, "admin-listen", proxy.LoopbackByDefault(*admin), proxy.Admin(health, tel.Metrics(), con))
		if err != nil {
			return failed(err)
		}
		fmt.Fprintf(stdout, "admin on %s (/healthz, /readyz, /metrics)\n", url)
		if made {
			fmt.Fprintf(stdout, "console on %s/console/ (admin token for its actions: %s)\n", url, secret)
		} else {
			fmt.Fprintf(stdout, "console on %s/console/ (its actions take the admin token you set)\n", url)
		}
	}
	fmt.Fprintf(stdout, "payments API listening on %s (store %s)\n", api, storeopen.Redact(*store))
	fmt.Fprintf(stdout, "try: curl -i -X POST %s/v1/charges -H 'Authorization: Bearer sk_demo' -H 'Idempotency-Key: order-1' -d '{\"amount\":1000,\"currency\":\"eur\",\"customer\":\"cus_1\"}'\n", api)
	served := servers.Run(ctx, stop)
	if err := proxy.Failure(served); err != nil {
		return failed(err)
	}
	return 0
}
