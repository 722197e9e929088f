// Package interop holds tests that run real clients — Stripe's official Go
// SDK, unchanged — against `idem proxy`, with faults injected, and check
// what their callers see. It is a module of its own, so that users of idem
// do not inherit the SDKs.
package interop
