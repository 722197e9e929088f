// Package dynamostore is an [store.Store] on Amazon DynamoDB, through
// aws-sdk-go-v2. Every write and every Get is a single-item request (PutItem,
// UpdateItem or GetItem) whose condition expression does the compare-and-set;
// the logic of [store.AcquireParams.Apply] runs in Go on the item that
// DynamoDB sends back. [Store.Scan] queries an index; [Store.List], for
// operators, scans the table. The caller builds the *dynamodb.Client (region,
// credentials, retries) and passes it in [Config].
//
// # Table
//
// One table (default "idem_records"), one item per record, made by
// [CreateTable] or by your infrastructure code with this schema:
//
//	partition key   pk          S    no sort key; on-demand or provisioned capacity
//	global index    idem_stale       partition key gsi_shard (S), sort key gsi_lease (N),
//	                                 projection ALL
//	TTL             ttl              (UpdateTimeToLive on attribute "ttl")
//
// An item's attributes (times are unix milliseconds, taken from the params:
// the store never reads a clock; they come back truncated to the
// millisecond, in UTC):
//
//	pk         S     "<len(scope)>:<scope>:<key>": the length makes it unambiguous,
//	                 ("a:b", "c") is "3:a:b:c" and ("a", "b:c") is "1:a:b:c"
//	state      S     in_progress, completed, failed or unknown
//	fp         S     the fingerprint
//	token      S     the lease token
//	fence      N     the fence
//	lease      N     the lease's end
//	ts         BOOL  takeover safe
//	created    N     when this incarnation of the record was created
//	updated    N     when it was last written
//	ver        N     a version, one more on every write
//	expires    N     when a settled record expires (settled records only)
//	ttl        N     expires as epoch seconds, rounded up (settled records only)
//	resp       B     the response without its body: [store.Response.MarshalBinary]
//	                 of it with Body nil (COMPLETED only)
//	body       B     the response body, raw (COMPLETED with a stored, non-empty body)
//	cps        L     the checkpoints, oldest first: one B per checkpoint, its
//	                 [store.AppendCheckpoint] line (absent when there are none)
//	cps_bytes  N     the sum over cps of each line's length plus one
//	gsi_shard  S     crc32(pk) mod Shards, in decimal (unsettled records only)
//	gsi_lease  N     when the record is due for the reconciler: the lease's end
//	                 for IN_PROGRESS, for UNKNOWN the earlier of that and when it
//	                 was marked, so a scan finds it at once (unsettled only)
//
// The body is stored beside the response rather than inside
// MarshalBinary's JSON, where base64 would make it a third larger: that
// would cut the largest body an item holds to about 290 KB and make every
// completion and replay cost a third more capacity.
//
// The index idem_stale is sparse: only IN_PROGRESS and UNKNOWN items have
// gsi_shard and gsi_lease (Finish to COMPLETED or FAILED removes them), so
// it holds exactly the records that [Store.Scan] may return, and settled
// records cost it nothing. Its partition key is spread over [Config.Shards]
// values because one partition key value of a DynamoDB index takes at most
// about 1,000 writes a second.
//
// Settled items carry ttl, so DynamoDB deletes them after their retention,
// at no cost; IN_PROGRESS and UNKNOWN items never do: they may stand for a
// side effect nobody has accounted for yet. DynamoDB deletes expired items
// late (typically within days), so every read checks the expiry itself: an
// expired item is not found by [Store.Get], not listed by [Store.Scan] or
// [Store.List], and
// [Store.Acquire] writes a new record over it, as over no record at all.
// [Store.Prune] has nothing to do and reports 0.
//
// # Round trips
//
// Each operation is one request, so one round trip, in the usual case:
//
//	acquire of a new key                         1   PutItem, condition attribute_not_exists(pk)
//	acquire of an existing key (replay,          1   the same PutItem; its failed condition sends
//	  in flight, mismatch, uncertain)                the item back (ReturnValuesOnConditionCheckFailure)
//	acquire that changes the record (re-run      2   then a PutItem of the record Apply made, on the
//	  after FAILED or expiry, takeover, UNKNOWN)     condition that token and ver are as read
//	renew                                        1   UpdateItem, condition token, state and lease
//	checkpoint                                   1   UpdateItem with list_append
//	complete, release                            1   UpdateItem, condition token and state
//	mark unknown while the lease runs            1   UpdateItem (2 after it ran out: see Finish)
//	get                                          1   consistent GetItem
//	scan page                                    1 per shard queried (an empty scan: Shards)
//	list page                                    1   consistent Scan of the table
//	prune                                        0
//
// A server that does not send the item back with a failed condition costs
// one consistent GetItem more wherever a condition fails: a replay is then
// 2 round trips. dynalite, the local server the tests use, is one; DynamoDB
// has sent the item back since June 2023. A write that loses a race to
// another writer of the same item reads what won and decides again (at most
// 16 times, then [store.ErrUnavailable]). A failed condition on a renew is a
// lost lease at once; on a checkpoint or a finish the store looks at the
// item sent back to tell a lost lease from a full record or from its own
// earlier attempt that the SDK retried after losing the answer (which then
// counts as done: a checkpoint is not recorded twice, a completion marked
// [store.FinishParams.Repeat] does not report a lost lease). The SDK's own retries (throttling, 5xx, broken
// connections) add round trips of their own.
//
// # Costs
//
// By DynamoDB's billing rules (not measured here): a write costs one write
// unit per KB of the larger of the item before and after, rounded up, and
// a strongly consistent read one read unit per 4 KB; an index write costs
// as a table write of the item, since the index projects every attribute.
// For a record of a few hundred bytes: acquire of a new key 2 write units
// (the item and its index entry); renew 3 (the item, and the index entry
// moved to its new score, a delete and a put); checkpoint 2; completion
// 2 or more with the response (the item, and its index entry removed).
// A failed condition is billed as a write of the existing item: a replay
// costs a write of the completed record, body included, where a read would
// cost a quarter as many units at a fifth of the price each (on-demand
// prices at the time of writing) — so a replay of a 100 KB response costs
// about 100 write units. One round trip less is what that buys; where
// replays of large responses are frequent and latency matters less, a
// store that reads first would be cheaper. A get costs one read unit per
// 4 KB; a scan at least half a read unit per shard queried. TTL deletions
// are free. Only unsettled records are stored twice (the index).
//
// # Listing
//
// [Store.List] (idem keys ls) has no index to use: each page is one
// strongly consistent Scan of the table, reading the next Limit items (at
// most 1,000, or 1 MB) in DynamoDB's order, whatever they hold. A filter
// expression built from the params (state, expiry, creation time, and a
// loose test of the scope and key prefixes on pk, which has no attribute
// of its own for either) spares sending back items that cannot match, and
// [store.ListParams.Match] decides on the rest. DynamoDB's Limit counts the
// items read, not those that match, so a page holds fewer than Limit
// records, often none, until its cursor (the table's LastEvaluatedKey) is
// empty. A page costs one read unit per 4 KB of all the items it read,
// bodies included, matching or not; the filter saves transfer, not
// capacity. A whole listing reads the whole table, expired items that
// DynamoDB has not yet deleted too: on a large table, list with a small
// Limit, or in quiet hours, or with provisioned capacity to spare. Items
// without a state attribute are not records and are skipped.
//
// # Limits
//
// An item holds at most 400 KB (409,600 bytes, names and values). The
// store keeps every record within it by fixed budgets: a response body of
// at most [MaxBodyBytes] (350 KiB; [Store.MaxBody] reports it, and Finish
// with a larger body stores the response with BodyOmitted, never failing
// for it), a response without its body of [MaxHeaderBytes] (16 KiB
// encoded: status and headers; the response as a whole shares the room of
// both, so larger headers are kept and the body is omitted when it no
// longer fits beside them; only status and headers of more than both fail,
// with [store.ErrInvalid], before anything is written), checkpoints of at
// most [MaxCheckpointBytes] (32 KiB;
// a checkpoint past it fails with [store.ErrInvalid] and is not written),
// and at most 2 KiB for everything else, names included, with the longest
// scope, key, fingerprint and token. The tests fill a record to every
// budget: it takes 403,687 bytes by the store's reckoning (which may
// overstate numbers), and the server accepts it.
//
// The index is eventually consistent: [Store.Scan] may miss a record that
// became stale a moment ago, or see a record as it was a moment ago (one
// that has just been renewed or settled). The reconciler settles records
// with conditional writes, so a stale view costs it a lost condition, not a
// wrong outcome, and the next scan sees the rest. Every other read is
// strongly consistent.
//
// Use one region: with global tables, DynamoDB settles concurrent writes to
// an item in two regions by the last writer, so two requests with the same
// key in two regions could both run.
//
// # Errors
//
// Errors are translated at the store's edge: a condition that fails because
// the token no longer owns the record gives [store.ErrLeaseLost], a missing
// or expired record [store.ErrNotFound]; a table that does not exist wraps
// [ErrTableNotFound], an item over 400 KB [store.ErrInvalid], and another
// malformed request (ValidationException, SerializationException) is
// returned as it is: these are DynamoDB's verdicts on the request itself.
// Every other error wraps [store.ErrUnavailable]: a failure to reach
// DynamoDB or to read its answer (refused or broken connections, timeouts,
// a deadline that ran out), throttling (ProvisionedThroughputExceeded,
// ThrottlingException, RequestLimitExceeded and the like), a 5xx answer, a
// transaction holding the item, denied or expired credentials, and a
// credential source that failed before the request could be signed (STS
// throttling, an identity provider out of reach), whatever its code: the
// same request may succeed later, so the engine keeps an outcome it could
// not store rather than drop it. An acquire that found the record (its
// put's condition failed) and then failed so, to read it or to write it
// (throttled, say, while it marks a lease that ran out UNKNOWN), wraps
// [store.ErrRefused] too: DynamoDB holds the record, which may say the
// request ran, so the middleware's fail_open never runs it; the same
// failure of the put of a new key wraps ErrUnavailable alone. A cancelled
// context stays recognisable with errors.Is(err, context.Canceled) and is
// not ErrUnavailable. The SDK's error stays in the chain for logs, but no
// SDK type is part of the API.
//
// # Testing locally
//
// The tests run against any DynamoDB endpoint in IDEM_TEST_DYNAMODB_URL,
// each on a table of its own; testdata/start-dynalite.sh installs and starts
// dynalite 4.0.0 (an in-memory DynamoDB on Node.js) on 127.0.0.1:8000:
//
//	store/dynamostore/testdata/start-dynalite.sh
//	IDEM_TEST_DYNAMODB_URL=http://127.0.0.1:8000 go test ./store/dynamostore/
//
// dynalite 4.0.0 ignores ReturnValuesOnConditionCheckFailure (so replays
// take 2 round trips there) and does not implement TTL (CreateTable
// accepts that; expired items stay, and reads hide them). It writes its
// indexes synchronously, so the suite's scans right after writing see
// everything, as they may not on DynamoDB.
//
// # Performance
//
// Measured with go test -run '^$' -bench . -benchtime 1000x -count 5 against
// dynalite 4.0.0 (loopback HTTP, one request at a time, a 2-vCPU VM shared
// with other work; median of 5 runs), next to the bare requests a
// hand-written check makes on a bare table (no index, no TTL):
//
//	benchmark                                        ns/op   ops/s   round trips/op
//	AcquireComplete (acquire new + complete)       2777616     360   2
//	RawPutUpdate (conditional PutItem, UpdateItem) 2489444     402   2
//	Replay (acquire of a completed key)            1808906     553   2 (1 on DynamoDB)
//	RawGet (consistent GetItem)                     812344    1231   1
//
// idem/raw: AcquireComplete/RawPutUpdate = 1.12, the same requests with a
// larger item and its index entry to maintain. Replay/RawGet = 2.2: on
// dynalite a replay is a failed PutItem and a GetItem, because dynalite does
// not send the item back with the failed condition; on DynamoDB it is one
// request. dynalite spends most of a millisecond on each request, so these
// figures say how many requests an operation makes and what the store adds
// to them, not how fast DynamoDB is.
package dynamostore
