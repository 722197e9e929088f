package dynamostore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/idemhq/idem/store"
)

var (
	_ store.Store       = (*Store)(nil)
	_ store.BodyLimiter = (*Store)(nil)
)

// Defaults for [Config].
const (
	// DefaultTable is the name of the table records are kept in.
	DefaultTable = "idem_records"
	// DefaultShards is the number of partitions of the stale-record index.
	DefaultShards = 16
	// MaxShards is the largest number of partitions of the stale-record index.
	MaxShards = 1024
)

// maxRequestItems bounds the items one Query or Scan request asks for, so
// that a page size of any size fits DynamoDB's Limit (an int32).
const maxRequestItems = 1000

// maxAttempts bounds the read-decide-write rounds of one call that loses
// races to concurrent writers of the same item; past it the call gives up
// with [store.ErrUnavailable].
const maxAttempts = 16

// Config configures a [Store]. The zero value of every field but Client is a
// sensible default.
type Config struct {
	// Client talks to DynamoDB. Required: the caller builds it (region,
	// credentials, retries, endpoint) and owns it.
	Client *dynamodb.Client
	// Table is the table records are kept in, made by [CreateTable] or with
	// the schema of the package documentation. Defaults to [DefaultTable].
	Table string
	// Shards is the number of partitions of the index that lists unsettled
	// records for [Store.Scan], 1 to [MaxShards]. On DynamoDB one partition
	// key value takes at most 1,000 writes a second, and every acquire, renew
	// and finish writes the index, so Shards bounds that rate (16 shards:
	// about 16,000 a second); but a scan runs at least one Query per shard.
	// A record's shard is stored in its item, so Shards may grow for a
	// deployment, but must never shrink: a store with fewer shards does not
	// scan the others. Defaults to [DefaultShards].
	Shards int
}

// Store is an [store.Store] on DynamoDB. It is safe for concurrent use, and
// any number of processes may share one table through stores with the same
// Shards. Make one with [New].
type Store struct {
	client *dynamodb.Client
	table  string
	shards uint32
}

var tableName = regexp.MustCompile(`^[a-zA-Z0-9_.-]{3,255}$`)

// New returns a store for cfg. The error wraps [store.ErrInvalid] when cfg is
// not valid. New does not contact DynamoDB.
func New(cfg Config) (*Store, error) {
	if cfg.Client == nil {
		return nil, fmt.Errorf("dynamostore: %w: config has no client", store.ErrInvalid)
	}
	table := cfg.Table
	if table == "" {
		table = DefaultTable
	}
	if !tableName.MatchString(table) {
		return nil, fmt.Errorf("dynamostore: %w: table name %q is not 3 to 255 of a-z, A-Z, 0-9, '_', '-' and '.'", store.ErrInvalid, table)
	}
	shards := cfg.Shards
	if shards == 0 {
		shards = DefaultShards
	}
	if shards < 1 || shards > MaxShards {
		return nil, fmt.Errorf("dynamostore: %w: shards must be 1 to %d, not %d", store.ErrInvalid, MaxShards, shards)
	}
	return &Store{client: cfg.Client, table: table, shards: uint32(shards)}, nil
}

// MaxBody implements [store.BodyLimiter]: [MaxBodyBytes]. A Finish with a
// larger body stores the response with the body omitted.
func (s *Store) MaxBody() int { return MaxBodyBytes }

// shardOf is the index partition of the item with partition key pk.
func (s *Store) shardOf(pk string) string {
	return strconv.FormatUint(uint64(crc32.ChecksumIEEE([]byte(pk))%s.shards), 10)
}

func keyOf(pk string) map[string]types.AttributeValue {
	return map[string]types.AttributeValue{attrPK: avS(pk)}
}

// expr collects the names and values of a request's expressions: DynamoDB
// rejects placeholders that no expression uses, so each request has its own.
type expr struct {
	names  map[string]string
	values map[string]types.AttributeValue
}

func newExpr() *expr {
	return &expr{names: map[string]string{}, values: map[string]types.AttributeValue{}}
}

// n returns the placeholder of an attribute name. Every name goes through a
// placeholder, so none can collide with DynamoDB's reserved words.
func (e *expr) n(attr string) string {
	p := "#" + strings.ReplaceAll(attr, "_", "")
	e.names[p] = attr
	return p
}

// v binds a value to the placeholder p and returns p.
func (e *expr) v(p string, v types.AttributeValue) string {
	e.values[p] = v
	return p
}

func (e *expr) valueMap() map[string]types.AttributeValue {
	if len(e.values) == 0 {
		return nil
	}
	return e.values
}

// isConditionFailed returns the exception when err is a failed condition.
func isConditionFailed(err error) (*types.ConditionalCheckFailedException, bool) {
	var ccf *types.ConditionalCheckFailedException
	ok := errors.As(err, &ccf)
	return ccf, ok
}

// current returns the item whose condition failed: the one DynamoDB sent
// back with the exception (ReturnValuesOnConditionCheckFailure), or, from a
// server that does not send it, the one a consistent read finds (one more
// round trip). It is nil when there is no item.
func (s *Store) current(ctx context.Context, op, pk string, ccf *types.ConditionalCheckFailedException) (*stored, error) {
	item := ccf.Item
	if item == nil {
		out, err := s.client.GetItem(ctx, &dynamodb.GetItemInput{TableName: &s.table, Key: keyOf(pk), ConsistentRead: aws.Bool(true)})
		if err != nil {
			return nil, s.translate(op, err)
		}
		item = out.Item
	}
	if item == nil {
		return nil, nil
	}
	st, err := decode(item)
	if err != nil {
		return nil, fmt.Errorf("dynamostore: %s: stored item: %w", op, err)
	}
	return st, nil
}

// update runs a conditional UpdateItem. It reports done when the update was
// made; when the condition failed it returns the item as it now stands (nil
// when there is none), sent back with the failure or read again.
func (s *Store) update(ctx context.Context, op, pk string, e *expr, update, cond string) (cur *stored, done bool, err error) {
	_, err = s.client.UpdateItem(ctx, &dynamodb.UpdateItemInput{
		TableName:                           &s.table,
		Key:                                 keyOf(pk),
		UpdateExpression:                    &update,
		ConditionExpression:                 &cond,
		ExpressionAttributeNames:            e.names,
		ExpressionAttributeValues:           e.valueMap(),
		ReturnValuesOnConditionCheckFailure: types.ReturnValuesOnConditionCheckFailureAllOld,
	})
	if err == nil {
		return nil, true, nil
	}
	ccf, ok := isConditionFailed(err)
	if !ok {
		return nil, false, s.translate(op, err)
	}
	cur, err = s.current(ctx, op, pk, ccf)
	return cur, false, err
}

// Acquire implements [store.Store]. It puts a new item on the condition that
// none exists: one round trip. When one exists, DynamoDB sends it back with
// the failed condition and [store.AcquireParams.Apply] decides in Go; a
// replay, a mismatch or an in-flight answer costs nothing more. A transition
// (re-creation over an expired or FAILED record, a takeover, the UNKNOWN
// mark) is one more PutItem on the condition that the item is still the
// version that was read (same token and version), repeated on a lost race.
// A server that does not send the item back with a failed condition costs
// one consistent GetItem more.
//
// Once DynamoDB has shown that the record exists (a failed condition), a
// call of the same Acquire that fails for a reason that may pass
// (throttling, a transaction holding the item, a 5xx, a broken
// connection, a deadline, the item changing under every attempt) wraps
// [store.ErrRefused] as well as [store.ErrUnavailable]: DynamoDB holds the
// record, which may say the request ran (a lease that ran out must become
// UNKNOWN), so it is no reason to fail open. Before that (the put of a new
// key), such a failure wraps [store.ErrUnavailable] alone.
func (s *Store) Acquire(ctx context.Context, p store.AcquireParams) (store.Record, error) {
	if err := store.Ready(ctx, "dynamostore", "acquire", p); err != nil {
		return store.Record{}, err
	}
	r, seen, err := s.acquire(ctx, p)
	if seen && errors.Is(err, store.ErrUnavailable) && !errors.Is(err, store.ErrRefused) && !errors.Is(err, store.ErrDenied) {
		err = fmt.Errorf("%w (the record exists): %w", store.ErrRefused, err)
	}
	return r, err
}

// acquire is [Store.Acquire] once p is ready; seen reports whether
// DynamoDB showed that the record exists (a failed condition) before err.
func (s *Store) acquire(ctx context.Context, p store.AcquireParams) (_ store.Record, seen bool, _ error) {
	p.Now, p.LeaseExpires = trunc(p.Now), trunc(p.LeaseExpires)
	pk := pkOf(p.Scope, p.Key)
	var cur *stored
	for range maxAttempts {
		var existing *store.Record
		if cur != nil {
			existing = &cur.Record
		}
		next, write := p.Apply(existing)
		if !write {
			return next, seen, nil
		}
		e := newExpr()
		var cond string
		ver := int64(1)
		if cur == nil {
			cond = "attribute_not_exists(" + e.n(attrPK) + ")"
		} else {
			ver = cur.ver + 1
			cond = e.n(attrToken) + " = " + e.v(":tok", avS(cur.Token)) + " AND " +
				e.n(attrVersion) + " = " + e.v(":ver", avN(cur.ver))
		}
		item, err := s.encode(&next, ver)
		if err != nil {
			return store.Record{}, seen, fmt.Errorf("dynamostore: acquire: %w", err)
		}
		_, err = s.client.PutItem(ctx, &dynamodb.PutItemInput{
			TableName:                           &s.table,
			Item:                                item,
			ConditionExpression:                 &cond,
			ExpressionAttributeNames:            e.names,
			ExpressionAttributeValues:           e.valueMap(),
			ReturnValuesOnConditionCheckFailure: types.ReturnValuesOnConditionCheckFailureAllOld,
		})
		if err == nil {
			return next, seen, nil
		}
		ccf, ok := isConditionFailed(err)
		if !ok {
			return store.Record{}, seen, s.translate("acquire", err)
		}
		seen = true // the condition failed: the item exists
		if cur, err = s.current(ctx, "acquire", pk, ccf); err != nil {
			return store.Record{}, seen, err
		}
	}
	return store.Record{}, seen, fmt.Errorf("dynamostore: acquire: %w: the item kept changing under %d attempts", store.ErrUnavailable, maxAttempts)
}

// Renew implements [store.Store]: one conditional UpdateItem.
func (s *Store) Renew(ctx context.Context, p store.RenewParams) error {
	if err := store.Ready(ctx, "dynamostore", "renew", p); err != nil {
		return err
	}
	e := newExpr()
	now, lease := e.v(":now", avN(ms(p.Now))), e.v(":lease", avN(ms(p.LeaseExpires)))
	update := "SET " + e.n(attrLease) + " = " + lease + ", " + e.n(attrStaleAt) + " = " + lease + ", " +
		e.n(attrUpdated) + " = " + now + " ADD " + e.n(attrVersion) + " " + e.v(":one", avN(1))
	cond := e.n(attrToken) + " = " + e.v(":tok", avS(p.Token)) + " AND " +
		e.n(attrState) + " = " + e.v(":ip", avS(string(store.StateInProgress))) + " AND " +
		e.n(attrLease) + " > " + now
	_, err := s.client.UpdateItem(ctx, &dynamodb.UpdateItemInput{
		TableName:                 &s.table,
		Key:                       keyOf(pkOf(p.Scope, p.Key)),
		UpdateExpression:          &update,
		ConditionExpression:       &cond,
		ExpressionAttributeNames:  e.names,
		ExpressionAttributeValues: e.valueMap(),
	})
	if _, ok := isConditionFailed(err); ok {
		return store.ErrLeaseLost
	}
	if err != nil {
		return s.translate("renew", err)
	}
	return nil
}

// Checkpoint implements [store.Store]: one conditional UpdateItem that
// appends the checkpoint to the item's list (list_append). The same
// checkpoint (name, data and time) is not appended twice, so a request the
// SDK retried after it had landed changes nothing. A checkpoint that would
// take the record's checkpoints past [MaxCheckpointBytes] fails with an
// error wrapping [store.ErrInvalid].
func (s *Store) Checkpoint(ctx context.Context, p store.CheckpointParams) error {
	if err := store.Ready(ctx, "dynamostore", "checkpoint", p); err != nil {
		return err
	}
	pk := pkOf(p.Scope, p.Key)
	line := store.AppendCheckpoint(nil, p.Checkpoint())
	room := int64(MaxCheckpointBytes - len(line) - 1)
	for range maxAttempts {
		e := newExpr()
		cps, cpsBytes, now := e.n(attrCps), e.n(attrCpsBytes), e.v(":now", avN(ms(p.Now)))
		newLine := e.v(":line", avB(line))
		update := "SET " + cps + " = list_append(if_not_exists(" + cps + ", " + e.v(":empty", &types.AttributeValueMemberL{Value: []types.AttributeValue{}}) + "), " +
			e.v(":cp", &types.AttributeValueMemberL{Value: []types.AttributeValue{avB(line)}}) + "), " +
			e.n(attrTakeover) + " = " + e.v(":false", avBool(false)) + ", " + e.n(attrUpdated) + " = " + now +
			" ADD " + e.n(attrVersion) + " " + e.v(":one", avN(1)) + ", " + cpsBytes + " " + e.v(":size", avN(int64(len(line)+1)))
		cond := e.n(attrToken) + " = " + e.v(":tok", avS(p.Token)) + " AND " +
			e.n(attrState) + " = " + e.v(":ip", avS(string(store.StateInProgress))) + " AND " +
			e.n(attrLease) + " > " + now + " AND " +
			"(attribute_not_exists(" + cpsBytes + ") OR " + cpsBytes + " <= " + e.v(":room", avN(room)) + ") AND " +
			"(attribute_not_exists(" + cps + ") OR NOT contains(" + cps + ", " + newLine + "))"
		cur, done, err := s.update(ctx, "checkpoint", pk, e, update, cond)
		if err != nil || done {
			return err
		}
		switch {
		case cur == nil || cur.Token != p.Token || cur.State != store.StateInProgress || !p.Now.Before(cur.LeaseExpires):
			return store.ErrLeaseLost
		case cur.hasLine(line):
			return nil // already recorded, by an earlier attempt of this request
		case cur.cpsSize > room:
			return fmt.Errorf("dynamostore: checkpoint: %w: the record's checkpoints would take %d bytes, over the %d an item keeps",
				store.ErrInvalid, cur.cpsSize+int64(len(line)+1), MaxCheckpointBytes)
		}
		// The item changed between the write and the read; try again.
	}
	return fmt.Errorf("dynamostore: checkpoint: %w: the item kept changing under %d attempts", store.ErrUnavailable, maxAttempts)
}

// Finish implements [store.Store]: one conditional UpdateItem. A COMPLETED
// or FAILED record gets its expiry and the ttl attribute, and leaves the
// stale-record index (its index attributes are removed). A response body
// over [MaxBodyBytes] is not stored: the response is stored with
// BodyOmitted. The response as a whole, status and headers encoded and
// body, has the room of both [MaxHeaderBytes] and [MaxBodyBytes]: a body
// that does not fit beside large headers is omitted the same way, and only
// a response whose status and headers alone take more fails, with an error
// wrapping [store.ErrInvalid], before anything is written.
//
// A record marked UNKNOWN stays in the index, scored at the earlier of its
// score and p.Now, so that a scan finds it at once: one round trip when
// its score is later than p.Now (the owner marks it while its lease runs,
// the usual case), two when not (DynamoDB cannot take a minimum in an
// update, so the first attempt's condition picks the case and a failed one
// is followed by the other).
func (s *Store) Finish(ctx context.Context, p store.FinishParams) error {
	if err := p.Validate(); err != nil {
		return err
	}
	var meta, body []byte
	if p.Response != nil {
		resp := p.Response
		if len(resp.Body) > MaxBodyBytes {
			resp = resp.WithoutBody()
		}
		var err error
		if meta, body, err = encodeResponse(resp); err != nil {
			return fmt.Errorf("dynamostore: finish: %w", err)
		}
		if len(meta)+len(body) > maxResponseBytes && len(body) > 0 {
			// Headers over MaxHeaderBytes took the body's room: keep the
			// outcome without it. The choice depends on the response
			// alone, so a repeat of this Finish finds what it wrote.
			resp = resp.WithoutBody()
			if meta, body, err = encodeResponse(resp); err != nil {
				return fmt.Errorf("dynamostore: finish: %w", err)
			}
		}
		if len(meta) > maxResponseBytes {
			return fmt.Errorf("dynamostore: finish: %w: the response's status and headers take %d bytes encoded, over the %d an item keeps",
				store.ErrInvalid, len(meta), maxResponseBytes)
		}
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("dynamostore: finish: %w", err)
	}
	pk := pkOf(p.Scope, p.Key)
	if p.State == store.StateUnknown {
		return s.markUnknown(ctx, pk, p)
	}
	e := newExpr()
	set := []string{
		e.n(attrState) + " = " + e.v(":st", avS(string(p.State))),
		e.n(attrUpdated) + " = " + e.v(":now", avN(ms(p.Now))),
		e.n(attrExpires) + " = " + e.v(":exp", avN(ms(p.Expires))),
		e.n(attrTTL) + " = " + e.v(":ttl", avN(ttlSeconds(p.Expires))),
	}
	if meta != nil {
		set = append(set, e.n(attrResp)+" = "+e.v(":resp", avB(meta)))
		if len(body) > 0 {
			set = append(set, e.n(attrBody)+" = "+e.v(":body", avB(body)))
		}
	}
	update := "SET " + strings.Join(set, ", ") +
		" REMOVE " + e.n(attrShard) + ", " + e.n(attrStaleAt) +
		" ADD " + e.n(attrVersion) + " " + e.v(":one", avN(1))
	cond := e.n(attrToken) + " = " + e.v(":tok", avS(p.Token)) + " AND " +
		e.n(attrState) + " IN (" + e.v(":ip", avS(string(store.StateInProgress))) + ", " + e.v(":unk", avS(string(store.StateUnknown))) + ")"
	cur, done, err := s.update(ctx, "finish", pk, e, update, cond)
	if err != nil || done {
		return err
	}
	if cur != nil && cur.landed(p, meta, body) {
		return nil // settled by an earlier attempt of this request, which the SDK retried
	}
	return store.ErrLeaseLost
}

// landed reports whether the record holds exactly what Finish(p) writes, with
// response meta and body: the write has already been made, by an earlier
// attempt of the same request (the SDK retries a request whose answer was
// lost, and the engine sends its own again), so the lease was not lost to
// anyone else. Only a write marked p.Repeat may count as landed: two writers
// borrowing one token must not both succeed.
func (st *stored) landed(p store.FinishParams, meta, body []byte) bool {
	if !p.Repeat || st.Token != p.Token || st.State != p.State {
		return false
	}
	if st.Response == nil || meta == nil {
		return st.Response == nil && meta == nil
	}
	stMeta, stBody, err := encodeResponse(st.Response)
	return err == nil && bytes.Equal(stMeta, meta) && bytes.Equal(stBody, body)
}

// markUnknown is Finish to UNKNOWN; see [Store.Finish].
func (s *Store) markUnknown(ctx context.Context, pk string, p store.FinishParams) error {
	lower := true // the first guess: the score is later than now
	for range maxAttempts {
		e := newExpr()
		now := e.v(":now", avN(ms(p.Now)))
		set := e.n(attrState) + " = " + e.v(":unk", avS(string(store.StateUnknown))) + ", " + e.n(attrUpdated) + " = " + now
		cond := e.n(attrToken) + " = " + e.v(":tok", avS(p.Token)) + " AND " +
			e.n(attrState) + " IN (" + e.v(":ip", avS(string(store.StateInProgress))) + ", :unk) AND " + e.n(attrStaleAt)
		if lower {
			set += ", " + e.n(attrStaleAt) + " = " + now
			cond += " > " + now
		} else {
			cond += " <= " + now
		}
		update := "SET " + set + " ADD " + e.n(attrVersion) + " " + e.v(":one", avN(1))
		cur, done, err := s.update(ctx, "finish", pk, e, update, cond)
		if err != nil || done {
			return err
		}
		if cur == nil || cur.Token != p.Token || (cur.State != store.StateInProgress && cur.State != store.StateUnknown) {
			return store.ErrLeaseLost
		}
		if cur.staleAt < 0 {
			return fmt.Errorf("dynamostore: finish: a stored item is unsettled but has no %s attribute", attrStaleAt)
		}
		lower = cur.staleAt > ms(p.Now)
	}
	return fmt.Errorf("dynamostore: finish: %w: the item kept changing under %d attempts", store.ErrUnavailable, maxAttempts)
}

// Get implements [store.Store]: one consistent GetItem. A record past its
// expiry is not found, even while DynamoDB has not yet deleted it.
func (s *Store) Get(ctx context.Context, p store.GetParams) (store.Record, error) {
	if err := store.Ready(ctx, "dynamostore", "get", p); err != nil {
		return store.Record{}, err
	}
	pk := pkOf(p.Scope, p.Key)
	out, err := s.client.GetItem(ctx, &dynamodb.GetItemInput{TableName: &s.table, Key: keyOf(pk), ConsistentRead: aws.Bool(true)})
	if err != nil {
		return store.Record{}, s.translate("get", err)
	}
	if out.Item == nil {
		return store.Record{}, store.ErrNotFound
	}
	st, err := decode(out.Item)
	if err != nil {
		return store.Record{}, fmt.Errorf("dynamostore: get: stored item: %w", err)
	}
	if !st.Live(p.Now) {
		return store.Record{}, store.ErrNotFound
	}
	return st.Record, nil
}

// position is where a scan stands: in a shard, after the index entry last
// (nil at the shard's start).
type position struct {
	shard uint32
	last  map[string]types.AttributeValue
}

// Scan implements [store.Store]. It queries the stale-record index one shard
// after the other, each for the entries scored at or before p.Now, in score
// order; the cursor is the shard and the last entry examined
// (LastEvaluatedKey), so every stale record that does not change during a
// scan is returned exactly once. A page costs one Query per shard it
// touches: at least one, at most Shards when stale records are few. The
// index is eventually consistent: a record written a moment ago may be
// missing, or seen as it was; the reconciler settles records with
// conditional writes, so a stale view costs it nothing but a retry.
func (s *Store) Scan(ctx context.Context, p store.ScanParams) (store.ScanResult, error) {
	if err := store.Ready(ctx, "dynamostore", "scan", p); err != nil {
		return store.ScanResult{}, err
	}
	pos, err := s.decodeCursor(p.Cursor)
	if err != nil {
		return store.ScanResult{}, err
	}
	size := p.PageSize()
	var res store.ScanResult
	for pos.shard < s.shards && len(res.Records) < size {
		e := newExpr()
		cond := e.n(attrShard) + " = " + e.v(":shard", avS(strconv.FormatUint(uint64(pos.shard), 10))) + " AND " +
			e.n(attrStaleAt) + " <= " + e.v(":now", avN(ms(p.Now)))
		out, err := s.client.Query(ctx, &dynamodb.QueryInput{
			TableName:                 &s.table,
			IndexName:                 aws.String(staleIndex),
			KeyConditionExpression:    &cond,
			ExpressionAttributeNames:  e.names,
			ExpressionAttributeValues: e.valueMap(),
			ExclusiveStartKey:         pos.last,
			Limit:                     aws.Int32(int32(min(size-len(res.Records), maxRequestItems))),
		})
		if err != nil {
			return store.ScanResult{}, s.translate("scan", err)
		}
		for _, item := range out.Items {
			st, err := decode(item)
			if err != nil {
				return store.ScanResult{}, fmt.Errorf("dynamostore: scan: %w", err)
			}
			if st.Live(p.Now) && st.Stale(p.Now) {
				res.Records = append(res.Records, st.Record)
			}
		}
		if len(out.LastEvaluatedKey) > 0 {
			pos.last = out.LastEvaluatedKey
		} else {
			pos = position{shard: pos.shard + 1}
		}
	}
	if pos.shard < s.shards {
		if res.Cursor, err = s.encodeCursor(pos); err != nil {
			return store.ScanResult{}, err
		}
	}
	return res, nil
}

// owner names this store in its cursors: its table and number of shards.
func (s *Store) owner() string {
	return "dynamostore:" + s.table + ":" + strconv.FormatUint(uint64(s.shards), 10)
}

// encodeCursor encodes a position: its shard and, within it, the index's
// last evaluated score and key (empty at the shard's start).
func (s *Store) encodeCursor(pos position) (string, error) {
	score, pk := "", ""
	if pos.last != nil {
		n, ok1 := pos.last[attrStaleAt].(*types.AttributeValueMemberN)
		k, ok2 := pos.last[attrPK].(*types.AttributeValueMemberS)
		if !ok1 || !ok2 {
			return "", fmt.Errorf("dynamostore: scan: the index's LastEvaluatedKey has no %s and %s", attrStaleAt, attrPK)
		}
		score, pk = n.Value, k.Value
	}
	return store.EncodeCursor(s.owner(), strconv.FormatUint(uint64(pos.shard), 10), score, pk), nil
}

func (s *Store) decodeCursor(c string) (position, error) {
	if c == "" {
		return position{}, nil
	}
	f, err := store.DecodeCursor(c, s.owner(), 3)
	if err != nil {
		return position{}, fmt.Errorf("dynamostore: scan: %w", err)
	}
	bad := fmt.Errorf("dynamostore: scan: %w: the cursor names a position this store does not have", store.ErrInvalid)
	shard, err := strconv.ParseUint(f[0], 10, 32)
	if err != nil || shard >= uint64(s.shards) {
		return position{}, bad
	}
	pos := position{shard: uint32(shard)}
	if f[1] != "" || f[2] != "" {
		if _, err := strconv.ParseInt(f[1], 10, 64); err != nil {
			return position{}, bad
		}
		if _, _, err := parsePK(f[2]); err != nil {
			return position{}, bad
		}
		pos.last = map[string]types.AttributeValue{
			attrShard:   avS(f[0]),
			attrStaleAt: &types.AttributeValueMemberN{Value: f[1]},
			attrPK:      avS(f[2]),
		}
	}
	return pos, nil
}

// List implements [store.Store]: one strongly consistent Scan of the table
// per page, which reads at most p.PageSize() items (and at most 1,000, or
// 1 MB). DynamoDB's Limit counts the items read before its filter, so a
// page holds the matches among the items it read: at most p.Limit, often
// fewer or none while the cursor (the table's LastEvaluatedKey) is not
// empty. The filter expression built from p only spares sending items that
// cannot match; [store.ListParams.Match] decides on what comes back. A
// whole listing reads the whole table, in DynamoDB's order; see Listing in
// the package documentation for its cost.
func (s *Store) List(ctx context.Context, p store.ListParams) (store.ScanResult, error) {
	if err := store.Ready(ctx, "dynamostore", "list", p); err != nil {
		return store.ScanResult{}, err
	}
	start, err := s.decodeListCursor(p.Cursor)
	if err != nil {
		return store.ScanResult{}, err
	}
	e := newExpr()
	filter := listFilter(e, p)
	out, err := s.client.Scan(ctx, &dynamodb.ScanInput{
		TableName:                 &s.table,
		FilterExpression:          &filter,
		ExpressionAttributeNames:  e.names,
		ExpressionAttributeValues: e.valueMap(),
		ExclusiveStartKey:         start,
		Limit:                     aws.Int32(int32(min(p.PageSize(), maxRequestItems))),
		ConsistentRead:            aws.Bool(true),
	})
	if err != nil {
		return store.ScanResult{}, s.translate("list", err)
	}
	var res store.ScanResult
	for _, item := range out.Items {
		st, err := decode(item)
		if err != nil {
			return store.ScanResult{}, fmt.Errorf("dynamostore: list: %w", err)
		}
		if p.Match(st.Record) {
			res.Records = append(res.Records, st.Record)
		}
	}
	if len(out.LastEvaluatedKey) > 0 {
		pk, ok := out.LastEvaluatedKey[attrPK].(*types.AttributeValueMemberS)
		if !ok {
			return store.ScanResult{}, fmt.Errorf("dynamostore: list: the table's LastEvaluatedKey has no %s", attrPK)
		}
		res.Cursor = store.EncodeCursor(s.owner(), pk.Value)
	}
	return res, nil
}

// listFilter is the filter expression of a List page: a test that every
// item matching p passes. Items without a state attribute are not records
// (another application's, or a probe) and are left out. Times are kept as
// truncated milliseconds, so each bound is taken inclusively. The item
// layout has no scope or key attribute, so the prefixes are tested loosely:
// pk holds ":" before the scope and before the key.
func listFilter(e *expr, p store.ListParams) string {
	exp := e.n(attrExpires)
	conds := []string{
		"attribute_exists(" + e.n(attrState) + ")",
		"(attribute_not_exists(" + exp + ") OR " + exp + " >= " + e.v(":now", avN(ms(p.Now))) + ")",
	}
	if len(p.States) > 0 {
		var in []string
		for i, st := range p.States {
			if !slices.Contains(p.States[:i], st) {
				in = append(in, e.v(":st"+strconv.Itoa(i), avS(string(st))))
			}
		}
		conds = append(conds, e.n(attrState)+" IN ("+strings.Join(in, ", ")+")")
	}
	if p.ScopePrefix != "" {
		conds = append(conds, "contains("+e.n(attrPK)+", "+e.v(":scope", avS(":"+p.ScopePrefix))+")")
	}
	if p.KeyPrefix != "" {
		conds = append(conds, "contains("+e.n(attrPK)+", "+e.v(":key", avS(":"+p.KeyPrefix))+")")
	}
	if !p.CreatedFrom.IsZero() {
		conds = append(conds, e.n(attrCreated)+" >= "+e.v(":from", avN(ms(p.CreatedFrom))))
	}
	if !p.CreatedBefore.IsZero() {
		conds = append(conds, e.n(attrCreated)+" <= "+e.v(":before", avN(ms(p.CreatedBefore))))
	}
	return strings.Join(conds, " AND ")
}

// decodeListCursor returns the ExclusiveStartKey a List cursor holds (nil
// for the empty cursor): the partition key last read, a record's or not.
// It has one field where a Scan cursor has three, so neither is taken for
// the other.
func (s *Store) decodeListCursor(c string) (map[string]types.AttributeValue, error) {
	if c == "" {
		return nil, nil
	}
	f, err := store.DecodeCursor(c, s.owner(), 1)
	if err != nil {
		return nil, fmt.Errorf("dynamostore: list: %w", err)
	}
	if f[0] == "" {
		return nil, fmt.Errorf("dynamostore: list: %w: the cursor names a position this store does not have", store.ErrInvalid)
	}
	return keyOf(f[0]), nil
}

// Prune implements [store.Store]. DynamoDB deletes settled records itself
// through the table's TTL (the ttl attribute), so Prune only validates p and
// reports 0. DynamoDB deletes expired items late (typically within a few
// days); until then every read treats them as absent.
func (s *Store) Prune(ctx context.Context, p store.PruneParams) (int, error) {
	if err := p.Validate(); err != nil {
		return 0, err
	}
	return 0, nil
}

// sleep waits d or until ctx is done.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

var _ store.DurabilityReporter = (*Store)(nil)

// Durability implements [store.DurabilityReporter]: DynamoDB stores every
// write durably, in several availability zones, before it answers. (A local
// stand-in such as dynalite is only as durable as its own disk, which the
// store cannot see.)
func (s *Store) Durability(context.Context) (store.Durability, error) {
	return store.Durability{CrashSafe: true, Detail: "DynamoDB writes every item to several availability zones before it answers"}, nil
}
