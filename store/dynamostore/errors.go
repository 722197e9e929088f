package dynamostore

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/idemhq/idem/store"
)

// ErrTableNotFound: the store's table does not exist (or not in the region
// and account the client talks to). [CreateTable] creates it.
var ErrTableNotFound = errors.New("dynamostore: table not found")

// apiError is what the SDK's errors that DynamoDB answered with implement
// (smithy.APIError), named here so that no SDK type is part of the API.
type apiError interface {
	error
	ErrorCode() string
	ErrorMessage() string
}

// httpStatusError is what the SDK's errors that carry an HTTP response
// implement.
type httpStatusError interface {
	error
	HTTPStatusCode() int
}

// finalCodes are the error codes of DynamoDB's verdicts on a request
// itself: sent again unchanged, it would get the same answer, so it is not
// a failure of the store to serve it. Every other answer (throttling,
// overload, a 5xx, a transaction or replica holding the item, denied or
// expired credentials, a credential source that failed before the request
// could be signed) says nothing about the request and wraps
// [store.ErrUnavailable]: DynamoDB's and STS's lists of codes grow, and a
// code taken for a verdict by mistake drops an outcome that the engine
// would have kept for later.
var finalCodes = map[string]bool{
	"ValidationException":                      true, // a malformed request, or an item over 400 KB
	"SerializationException":                   true, // a malformed request
	"ResourceNotFoundException":                true, // no such table: ErrTableNotFound
	"ConditionalCheckFailedException":          true, // the condition is false; callers read the item
	"ItemCollectionSizeLimitExceededException": true, // a local index's 10 GB (the table has none)
}

// deniedCodes are the codes of DynamoDB refusing the request's credentials
// or permissions.
var deniedCodes = map[string]bool{
	"AccessDeniedException":               true,
	"UnrecognizedClientException":         true,
	"InvalidSignatureException":           true,
	"MissingAuthenticationTokenException": true,
	"IncompleteSignatureException":        true,
	"ExpiredTokenException":               true,
}

// denied reports whether err is DynamoDB itself refusing the request's
// credentials or permissions: it was reached, and may hold the record (see
// [store.ErrDenied]). A credential source that failed (STS) before the
// request could be signed never reached DynamoDB, and is not.
func denied(err error) bool {
	var api apiError
	if !errors.As(err, &api) || !deniedCodes[api.ErrorCode()] {
		return false
	}
	for e := err; e != nil; e = errors.Unwrap(e) {
		if op, ok := e.(interface{ Service() string }); ok && op.Service() != dynamodb.ServiceID {
			return false // the refusal of another service (STS), on the way to DynamoDB
		}
	}
	return true
}

// translate turns an SDK error into the vocabulary of package idem at the
// store's edge. An answer that is DynamoDB's verdict on the request itself
// (finalCodes) is final: a missing table wraps [ErrTableNotFound], an item
// over DynamoDB's size limit wraps [store.ErrInvalid]. Anything else — a
// failure to reach DynamoDB or to get its answer, a DynamoDB that throttles
// or fails, credentials that cannot be had — wraps [store.ErrUnavailable].
// The SDK's error stays in the chain, for logs and for errors.Is with
// context.Canceled and context.DeadlineExceeded.
func (s *Store) translate(op string, err error) error {
	return translate(s.table, op, err)
}

func translate(table, op string, err error) error {
	var notFound *types.ResourceNotFoundException
	var api apiError
	switch {
	case errors.Is(err, context.Canceled):
		// The caller gave up; that says nothing about the store.
		return fmt.Errorf("dynamostore: %s: %w", op, err)
	case errors.As(err, &notFound):
		return fmt.Errorf("%w: %q (%s; create it with dynamostore.CreateTable): %w", ErrTableNotFound, table, op, err)
	case denied(err):
		return fmt.Errorf("dynamostore: %s: %w", op, store.Denied(err))
	case unavailable(err):
		return fmt.Errorf("dynamostore: %s: %w: %w", op, store.ErrUnavailable, err)
	case errors.As(err, &api) && api.ErrorCode() == "ValidationException" &&
		strings.Contains(strings.ToLower(api.ErrorMessage()), "item size"):
		return fmt.Errorf("dynamostore: %s: %w: the item would be over DynamoDB's 400 KB limit: %w", op, store.ErrInvalid, err)
	}
	return fmt.Errorf("dynamostore: %s: %w", op, err)
}

// unavailable reports whether err leaves the outcome of the call unknown
// or the call undone for a reason that may pass: anything but an answer
// from DynamoDB that is a verdict on the request itself (finalCodes). That
// covers the failures to send the request or to read its answer (no API
// error in the chain), the codes of a DynamoDB that throttles or fails, and
// those of a credential source (STS throttling, an identity provider out
// of reach, expired credentials), whose error the SDK wraps in the call's.
func unavailable(err error) bool {
	if errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	var status httpStatusError
	if errors.As(err, &status) && status.HTTPStatusCode() >= 500 {
		return true
	}
	var api apiError
	if errors.As(err, &api) {
		return !finalCodes[api.ErrorCode()]
	}
	// Not an answer from DynamoDB: the request could not be sent, the
	// connection broke, or the answer could not be read.
	return true
}
