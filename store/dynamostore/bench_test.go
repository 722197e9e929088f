package dynamostore

import (
	"crypto/rand"
	"encoding/hex"
	"strconv"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/storetest"
)

// The benchmarks run one operation at a time through one client, so ns/op
// is the latency a single caller sees, round trips included; each reports
// its round trips (HTTP requests) per operation. The raw benchmarks do the
// same work with bare requests on a bare table (a partition key and nothing
// else: no index, no TTL), to show what the store adds.

type bench struct {
	store   *Store
	counter *counter
}

func newBench(b *testing.B) bench {
	b.Helper()
	s, c := countingStore(b, 0)
	return bench{store: s, counter: c}
}

func newToken(b *testing.B) string {
	t, err := store.NewToken()
	if err != nil {
		b.Fatal(err)
	}
	return t
}

// BenchmarkAcquireComplete: Acquire of a fresh key, then Finish as
// COMPLETED — what a request that runs costs.
func BenchmarkAcquireComplete(b *testing.B) {
	x := newBench(b)
	storetest.BenchAcquireComplete(b, x.store, x.counter.n.Load)
}

// BenchmarkReplay: Acquire of a completed key — what a retry that replays
// costs.
func BenchmarkReplay(b *testing.B) {
	x := newBench(b)
	storetest.BenchReplay(b, x.store, x.counter.n.Load)
}

// newBareTable creates a table with a string partition key pk and nothing
// else, deleted when the benchmark ends.
func newBareTable(b *testing.B, client *dynamodb.Client) string {
	b.Helper()
	var r [8]byte
	if _, err := rand.Read(r[:]); err != nil {
		b.Fatal(err)
	}
	table := "idem_bare_" + hex.EncodeToString(r[:])
	if _, err := client.CreateTable(ctx, &dynamodb.CreateTableInput{
		TableName:            &table,
		BillingMode:          types.BillingModePayPerRequest,
		AttributeDefinitions: []types.AttributeDefinition{{AttributeName: aws.String("pk"), AttributeType: types.ScalarAttributeTypeS}},
		KeySchema:            []types.KeySchemaElement{{AttributeName: aws.String("pk"), KeyType: types.KeyTypeHash}},
	}); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _, _ = client.DeleteTable(ctx, &dynamodb.DeleteTableInput{TableName: &table}) })
	if err := waitActive(ctx, client, table); err != nil {
		b.Fatal(err)
	}
	return table
}

// BenchmarkRawPutUpdate: the bare requests of a hand-made check on a bare
// table: a PutItem on the condition that the key is new, then an UpdateItem
// on the condition of the token, storing the outcome.
func BenchmarkRawPutUpdate(b *testing.B) {
	x := newBench(b)
	client := x.store.client
	table := newBareTable(b, client)
	resp, err := testkit.BenchResponse().MarshalBinary()
	if err != nil {
		b.Fatal(err)
	}
	testkit.Measure(b, x.counter.n.Load, func(i int) {
		now, tok := time.Now(), newToken(b)
		pk := "1:s:key-" + strconv.Itoa(i)
		if _, err := client.PutItem(ctx, &dynamodb.PutItemInput{
			TableName: &table,
			Item: map[string]types.AttributeValue{"pk": avS(pk), "state": avS("in_progress"), "token": avS(tok),
				"lease": avN(now.Add(idem.DefaultLease).UnixMilli())},
			ConditionExpression: aws.String("attribute_not_exists(pk)"),
		}); err != nil {
			b.Fatal(err)
		}
		if _, err := client.UpdateItem(ctx, &dynamodb.UpdateItemInput{
			TableName:                 &table,
			Key:                       keyOf(pk),
			UpdateExpression:          aws.String("SET #s = :s, #r = :r"),
			ConditionExpression:       aws.String("#t = :t"),
			ExpressionAttributeNames:  map[string]string{"#s": "state", "#r": "resp", "#t": "token"},
			ExpressionAttributeValues: map[string]types.AttributeValue{":s": avS("completed"), ":r": avB(resp), ":t": avS(tok)},
		}); err != nil {
			b.Fatal(err)
		}
	})
}

// BenchmarkRawGet: a bare consistent GetItem of a stored outcome.
func BenchmarkRawGet(b *testing.B) {
	x := newBench(b)
	client := x.store.client
	table := newBareTable(b, client)
	resp, err := testkit.BenchResponse().MarshalBinary()
	if err != nil {
		b.Fatal(err)
	}
	if _, err := client.PutItem(ctx, &dynamodb.PutItemInput{TableName: &table,
		Item: map[string]types.AttributeValue{"pk": avS("1:s:key"), "state": avS("completed"), "resp": avB(resp)}}); err != nil {
		b.Fatal(err)
	}
	testkit.Measure(b, x.counter.n.Load, func(int) {
		out, err := client.GetItem(ctx, &dynamodb.GetItemInput{TableName: &table, Key: keyOf("1:s:key"), ConsistentRead: aws.Bool(true)})
		if err != nil || out.Item == nil {
			b.Fatalf("GetItem = %v, %v", out, err)
		}
	})
}
