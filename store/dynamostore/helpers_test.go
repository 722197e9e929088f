package dynamostore

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testkit"
)

// envURL names the variable that points the tests at a DynamoDB endpoint.
const envURL = "IDEM_TEST_DYNAMODB_URL"

func TestMain(m *testing.M) { testkit.Main(m) }

var ctx = context.Background()

// endpoint returns the test server's URL, or skips the test.
func endpoint(tb testing.TB) string {
	tb.Helper()
	return testkit.Server(tb, envURL)
}

// counter is an HTTP client that counts the requests it sends: each is one
// round trip to DynamoDB (SDK retries included).
type counter struct {
	n    atomic.Int64
	next *http.Client
}

func (c *counter) Do(r *http.Request) (*http.Response, error) {
	c.n.Add(1)
	return c.next.Do(r)
}

// newClient returns a client for url with static dummy credentials in
// us-east-1, whose requests the returned counter counts.
func newClient(url string, opts ...func(*dynamodb.Options)) (*dynamodb.Client, *counter) {
	c := &counter{next: &http.Client{Transport: &http.Transport{
		MaxIdleConns:        256,
		MaxIdleConnsPerHost: 256, // the suite races 200 goroutines on one key
		IdleConnTimeout:     30 * time.Second,
	}}}
	o := dynamodb.Options{
		Region:       "us-east-1",
		Credentials:  credentials.NewStaticCredentialsProvider("idem", "idem", ""),
		BaseEndpoint: aws.String(url),
		HTTPClient:   c,
	}
	for _, f := range opts {
		f(&o)
	}
	return dynamodb.New(o), c
}

var shared struct {
	once   sync.Once
	client *dynamodb.Client
}

// sharedClient returns a client that the tests share, or skips.
func sharedClient(tb testing.TB) *dynamodb.Client {
	tb.Helper()
	url := endpoint(tb)
	shared.once.Do(func() { shared.client, _ = newClient(url) })
	return shared.client
}

// newTable creates a table no other test uses and deletes it when the test
// ends.
func newTable(tb testing.TB) string {
	tb.Helper()
	client := sharedClient(tb)
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		tb.Fatal(err)
	}
	table := "idem_test_" + hex.EncodeToString(b[:])
	if err := CreateTable(ctx, client, table); err != nil {
		tb.Fatalf("CreateTable: %v", err)
	}
	tb.Cleanup(func() {
		if _, err := client.DeleteTable(context.Background(), &dynamodb.DeleteTableInput{TableName: &table}); err != nil {
			tb.Errorf("deleting table %s: %v", table, err)
		}
	})
	return table
}

// newTestStore returns a store on a table of its own, through client (the
// shared one when nil).
func newTestStore(tb testing.TB, client *dynamodb.Client, shards int) *Store {
	tb.Helper()
	table := newTable(tb)
	if client == nil {
		client = sharedClient(tb)
	}
	s, err := New(Config{Client: client, Table: table, Shards: shards})
	if err != nil {
		tb.Fatal(err)
	}
	return s
}

// countingStore returns a store on a table of its own through a client of
// its own, and that client's request counter.
func countingStore(tb testing.TB, shards int) (*Store, *counter) {
	tb.Helper()
	client, c := newClient(endpoint(tb))
	return newTestStore(tb, client, shards), c
}

func fp(body string) idem.Fingerprint {
	return idem.NewFingerprint(idem.Payload{Method: "POST", Path: "/v1/charges", Body: []byte(body)})
}

// rawItem reads an item as it is stored, expired or not.
func rawItem(tb testing.TB, s *Store, scope, key string) map[string]types.AttributeValue {
	tb.Helper()
	out, err := s.client.GetItem(ctx, &dynamodb.GetItemInput{TableName: &s.table, Key: keyOf(pkOf(scope, key)), ConsistentRead: aws.Bool(true)})
	if err != nil {
		tb.Fatalf("GetItem: %v", err)
	}
	return out.Item
}
