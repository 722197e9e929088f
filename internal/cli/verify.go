package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"text/tabwriter"

	"github.com/idemhq/idem/verify"
)

// stringList collects a repeated flag.
type stringList []string

func (s *stringList) String() string     { return fmt.Sprint(*s) }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }

// runVerify checks an endpoint against the idempotency contract, from the
// outside.
func runVerify(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("verify")
	cfg := verify.Config{Header: http.Header{}}
	fs.StringVar(&cfg.URL, "url", "", "`URL` of the endpoint to check (required)")
	fs.StringVar(&cfg.Method, "method", "POST", "the `method`")
	fs.StringVar(&cfg.Body, "body", "", "a request `body` the endpoint accepts (default: a small JSON object)")
	fs.StringVar(&cfg.ChangedBody, "changed-body", "", "another request `body` the endpoint accepts, the 'different payload' (default: the body's first number plus one, or one more JSON member)")
	fs.Var(headerFlags(cfg.Header), "header", "a `header` for every request, 'Name: value' (repeatable)")
	fs.IntVar(&cfg.Concurrency, "concurrency", verify.DefaultConcurrency, "duplicates sent at once")
	fs.BoolVar(&cfg.RequireKey, "require-key", false, "check that a request without a key gets 400")
	fs.StringVar(&cfg.ScopeHeader, "scope-header", "Authorization", "the `header` that tells callers apart")
	fs.StringVar(&cfg.EffectsURL, "effects-url", "", "`URL` of a JSON page that shows the request's side effects (a balance, a count): the concurrent check reads it to see a duplicate that ran but answered like a replay or a 409, and the payload-mismatch check to see another payload that ran before it got 422")
	fs.DurationVar(&cfg.Timeout, "timeout", verify.DefaultTimeout, "the longest `duration` of each request")
	var creds stringList
	fs.Var(&creds, "credential", "a `credential`, a value of --scope-header; give two to check that keys are scoped per caller")
	asJSON := fs.Bool("json", false, "print the report as JSON")
	if err := parseFlagsOnly(fs, args, stdout, stderr); err != nil {
		return exitStatus(err)
	}
	if cfg.URL == "" {
		usageError(stderr, fs.Name(), "--url is required")
		return 2
	}
	// Zero would be verify's default, not what was asked: refused too.
	if cfg.Timeout <= 0 {
		usageError(stderr, fs.Name(), fmt.Sprintf("--timeout %s: want a positive duration, such as 30s", cfg.Timeout))
		return 2
	}
	if cfg.Concurrency <= 0 {
		usageError(stderr, fs.Name(), fmt.Sprintf("--concurrency %d: want a positive number of duplicates, such as %d", cfg.Concurrency, verify.DefaultConcurrency))
		return 2
	}
	cfg.Credentials = creds
	progress := newProgress(stderr, "requests sent")
	cfg.Progress = progress.update
	rep, err := verify.Run(ctx, cfg)
	progress.done()
	if err != nil && len(rep.Checks) == 0 {
		usageError(stderr, fs.Name(), strings.TrimPrefix(err.Error(), "verify: "))
		return 2
	}
	if *asJSON {
		out := struct {
			verify.Report
			Passed bool `json:"passed"`
		}{rep, rep.Passed()}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		enc.Encode(out)
	} else {
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintf(tw, "CHECK\tRESULT\tDETAIL\n")
		for _, c := range rep.Checks {
			fmt.Fprintf(tw, "%s\t%s\t%s\n", c.Name, c.Result, c.Detail)
		}
		tw.Flush()
	}
	switch {
	case errors.Is(err, verify.ErrUnreachable):
		fmt.Fprintf(stderr, "idem verify: %v\nIs the API running, and is --url its address?\n", err)
		return 1
	case errors.Is(err, verify.ErrRefused):
		fmt.Fprintf(stderr, "idem verify: %v, so the checks stop there.\nGive a body it accepts (--body) and the headers it needs (--header).\n", err)
		return 1
	}
	if !rep.Passed() {
		return 1
	}
	return 0
}
