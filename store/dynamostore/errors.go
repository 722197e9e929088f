package dynamostore

import (
	"context"
	"errors"
	"fmt"
	"strings"

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

// unavailableCodes are the error codes of a DynamoDB that is overloaded,
// throttling, or failing: the operation may be retried later.
var unavailableCodes = map[string]bool{
	"ProvisionedThroughputExceededException": true,
	"ThrottlingException":                    true,
	"RequestLimitExceeded":                   true,
	"InternalServerError":                    true,
	"ServiceUnavailable":                     true,
	"TransactionConflictException":           true, // a transaction holds the item
	"ReplicatedWriteConflictException":       true, // a global table's replica is writing it
}

// translate turns an SDK error into the vocabulary of package idem at the
// store's edge. A failure to reach DynamoDB or to get its answer, and a
// DynamoDB that throttles or fails (5xx), wraps [store.ErrUnavailable]; a
// missing table wraps [ErrTableNotFound]; an item over DynamoDB's size limit
// wraps [store.ErrInvalid]. The SDK's error stays in the chain, for logs and
// for errors.Is with context.Canceled and context.DeadlineExceeded.
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
	case unavailable(err):
		return fmt.Errorf("dynamostore: %s: %w: %w", op, store.ErrUnavailable, err)
	case errors.As(err, &api) && api.ErrorCode() == "ValidationException" &&
		strings.Contains(strings.ToLower(api.ErrorMessage()), "item size"):
		return fmt.Errorf("dynamostore: %s: %w: the item would be over DynamoDB's 400 KB limit: %w", op, store.ErrInvalid, err)
	}
	return fmt.Errorf("dynamostore: %s: %w", op, err)
}

// unavailable reports whether err means that DynamoDB could not be reached,
// did not answer, or answered that it cannot serve the request now, so that
// the outcome of the call is not known.
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
		return unavailableCodes[api.ErrorCode()]
	}
	// Not an answer from DynamoDB: the request could not be sent, the
	// connection broke, or the answer could not be read.
	return true
}
