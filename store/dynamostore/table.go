package dynamostore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/idemhq/idem/store"
)

// createTimeout bounds how long CreateTable waits for the table to become
// ACTIVE when ctx has no earlier deadline.
const createTimeout = 5 * time.Minute

// CreateTable creates the table a [Store] needs, with the schema of the
// package documentation (on-demand capacity), waits until it and its index
// are ACTIVE, and turns on its TTL on the ttl attribute. An empty table name
// means [DefaultTable].
//
// It is idempotent: a table that already exists is not an error (its
// schema is not checked), and neither is TTL already on. A server that does
// not implement TTL (dynalite, for one) answers UpdateTimeToLive with
// UnknownOperationException; CreateTable accepts that, and such a server
// keeps expired records, which the store's reads treat as absent. TTL on
// another attribute is an error: DynamoDB allows one per table.
//
// It waits at most 5 minutes, or until ctx is done if that is sooner.
func CreateTable(ctx context.Context, client *dynamodb.Client, table string) error {
	if client == nil {
		return fmt.Errorf("dynamostore: create table: %w: no client", store.ErrInvalid)
	}
	if table == "" {
		table = DefaultTable
	}
	if !tableName.MatchString(table) {
		return fmt.Errorf("dynamostore: create table: %w: table name %q is not 3 to 255 of a-z, A-Z, 0-9, '_', '-' and '.'", store.ErrInvalid, table)
	}
	ctx, cancel := context.WithTimeout(ctx, createTimeout)
	defer cancel()
	_, err := client.CreateTable(ctx, &dynamodb.CreateTableInput{
		TableName:   &table,
		BillingMode: types.BillingModePayPerRequest,
		AttributeDefinitions: []types.AttributeDefinition{
			{AttributeName: aws.String(attrPK), AttributeType: types.ScalarAttributeTypeS},
			{AttributeName: aws.String(attrShard), AttributeType: types.ScalarAttributeTypeS},
			{AttributeName: aws.String(attrStaleAt), AttributeType: types.ScalarAttributeTypeN},
		},
		KeySchema: []types.KeySchemaElement{{AttributeName: aws.String(attrPK), KeyType: types.KeyTypeHash}},
		GlobalSecondaryIndexes: []types.GlobalSecondaryIndex{{
			IndexName: aws.String(staleIndex),
			KeySchema: []types.KeySchemaElement{
				{AttributeName: aws.String(attrShard), KeyType: types.KeyTypeHash},
				{AttributeName: aws.String(attrStaleAt), KeyType: types.KeyTypeRange},
			},
			Projection: &types.Projection{ProjectionType: types.ProjectionTypeAll},
		}},
	})
	var inUse *types.ResourceInUseException
	if err != nil && !errors.As(err, &inUse) {
		return translate(table, "create table", err)
	}
	if err := waitActive(ctx, client, table); err != nil {
		return err
	}
	return enableTTL(ctx, client, table)
}

// waitActive polls until the table and its indexes are ACTIVE.
func waitActive(ctx context.Context, client *dynamodb.Client, table string) error {
	delay := 20 * time.Millisecond
	for {
		out, err := client.DescribeTable(ctx, &dynamodb.DescribeTableInput{TableName: &table})
		var notFound *types.ResourceNotFoundException
		switch {
		case errors.As(err, &notFound):
			// Just created: DescribeTable may not see it yet.
		case err != nil:
			return translate(table, "create table", err)
		case out.Table.TableStatus == types.TableStatusDeleting:
			return fmt.Errorf("dynamostore: create table: table %q is being deleted", table)
		case out.Table.TableStatus == types.TableStatusActive && indexesActive(out.Table):
			return nil
		}
		if err := sleep(ctx, delay); err != nil {
			return fmt.Errorf("dynamostore: create table: waiting for table %q to become active: %w", table, err)
		}
		delay = min(2*delay, 2*time.Second)
	}
}

func indexesActive(t *types.TableDescription) bool {
	for _, ix := range t.GlobalSecondaryIndexes {
		if ix.IndexStatus != types.IndexStatusActive {
			return false
		}
	}
	return true
}

// enableTTL turns on the table's TTL on the ttl attribute unless it is on.
func enableTTL(ctx context.Context, client *dynamodb.Client, table string) error {
	out, err := client.DescribeTimeToLive(ctx, &dynamodb.DescribeTimeToLiveInput{TableName: &table})
	if err != nil {
		return translate(table, "create table: describing TTL", err)
	}
	if d := out.TimeToLiveDescription; d != nil {
		switch d.TimeToLiveStatus {
		case types.TimeToLiveStatusEnabled, types.TimeToLiveStatusEnabling:
			if aws.ToString(d.AttributeName) == attrTTL {
				return nil
			}
			return fmt.Errorf("dynamostore: create table: table %q has TTL on attribute %q; the store needs it on %q",
				table, aws.ToString(d.AttributeName), attrTTL)
		}
	}
	_, err = client.UpdateTimeToLive(ctx, &dynamodb.UpdateTimeToLiveInput{
		TableName:               &table,
		TimeToLiveSpecification: &types.TimeToLiveSpecification{AttributeName: aws.String(attrTTL), Enabled: aws.Bool(true)},
	})
	var api apiError
	if errors.As(err, &api) && api.ErrorCode() == "UnknownOperationException" {
		return nil // a local server without TTL; see CreateTable
	}
	if err != nil {
		return translate(table, "create table: enabling TTL", err)
	}
	return nil
}
