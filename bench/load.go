package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// requestBody is what every request sends: 349 bytes of JSON.
var requestBody = []byte(`{"amount":1000,"currency":"eur","customer":"cus_42","source":"tok_visa","description":"bench charge","metadata":{"order_id":"6735","channel":"web","campaign":"winter-2026","note":"a request body of the size payment APIs see"},"capture":true,"statement_descriptor":"IDEM BENCH","receipt_email":"jenny.rosen@example.com"}`)

// result is what one run of a workload against a target measured.
type result struct {
	Requests  int64
	Errors    int64
	Seconds   float64
	RPS       float64
	P50, P99  time.Duration
	StoreOps  float64 // store calls per request, counted by the target
	ServerOps float64 // server-side operations per request (Redis commands, PostgreSQL WAL bytes…)
	// CPU time per request, in microseconds, of the target's process, of
	// the store's server processes (PostgreSQL, Redis) and of the load
	// client: on a machine whose cores they share, throughput follows
	// their sum.
	CPUTarget, CPUStore, CPUClient float64
}

// workload is how the client picks keys.
type workload string

const (
	fresh  workload = "fresh"  // a new key every request
	replay workload = "replay" // each connection repeats one completed key
)

// load sends requests to url on conns keep-alive connections for d and
// measures them.
func load(ctx context.Context, url string, w workload, conns int, d time.Duration, run string) result {
	tr := &http.Transport{MaxIdleConnsPerHost: conns, MaxConnsPerHost: conns, DisableCompression: true}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	var n, errs atomic.Int64
	lat := make([][]time.Duration, conns)
	stop := time.Now().Add(d)
	var wg sync.WaitGroup
	for c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			key := run + "-c" + strconv.Itoa(c)
			if w == replay { // the first request of each connection runs; the rest replay it
				if send(ctx, client, url, key) != nil {
					errs.Add(1)
				}
			}
			for i := 0; time.Now().Before(stop) && ctx.Err() == nil; i++ {
				k := key
				if w == fresh {
					k = key + "-" + strconv.Itoa(i)
				}
				start := time.Now()
				if err := send(ctx, client, url, k); err != nil {
					errs.Add(1)
					continue
				}
				lat[c] = append(lat[c], time.Since(start))
				n.Add(1)
			}
		}()
	}
	wg.Wait()
	all := slices.Concat(lat...)
	slices.Sort(all)
	r := result{Requests: n.Load(), Errors: errs.Load(), Seconds: d.Seconds()}
	r.RPS = float64(r.Requests) / r.Seconds
	if len(all) > 0 {
		r.P50, r.P99 = all[len(all)/2], all[len(all)*99/100]
	}
	return r
}

// send makes one request and checks its answer.
func send(ctx context.Context, client *http.Client, url, key string) error {
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/charges", bytes.NewReader(requestBody))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer sk_test_bench")
	req.Header.Set("Idempotency-Key", key)
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	io.Copy(io.Discard, resp.Body)
	if resp.StatusCode != http.StatusCreated {
		return fmt.Errorf("status %d", resp.StatusCode)
	}
	return nil
}

// storm sends n duplicates of one key at once and reports how many answers
// were the outcome and how long the last took.
func storm(ctx context.Context, url string, n int, run string) (ok int, took time.Duration) {
	tr := &http.Transport{MaxIdleConnsPerHost: n, MaxConnsPerHost: n}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: time.Minute}
	var good atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if send(ctx, client, url, run+"-storm") == nil {
				good.Add(1)
			}
		}()
	}
	wg.Wait()
	return int(good.Load()), time.Since(start)
}
