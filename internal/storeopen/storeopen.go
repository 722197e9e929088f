// Package storeopen turns a store DSN into an [idem.Store]. It is the one
// place that knows every store.
//
//	sqlite:PATH                          the embedded default (sqlite:idem.db); a plain path, no ?options
//	postgres://user@host:5432/db?…       PostgreSQL; ?idem_schema=NAME picks the schema (default idem)
//	redis://host:6379/0                  Redis; ?idem_prefix=NAME picks the key prefix (default idem)
//	redis+cluster://host:7000?addr=host:7001&…   Redis Cluster (go-redis cluster URL)
//	dynamodb://?region=eu-west-1&table=idem_records          DynamoDB, with the AWS default credentials
//	dynamodb://KEY:SECRET@127.0.0.1:8000?table=…&create_table=true  a DynamoDB-compatible server at that address
//	memcached://host:11211[,host:11212]?idem_prefix=idem     Memcached (it may evict records: see memcachedstore)
//	memory:                              in memory; forgotten on exit (tests and demos)
//
// PostgreSQL and Redis DSNs take their drivers' own options too (PostgreSQL
// sends one it does not know to the server, which refuses it: see
// [OpenEventually]). A DynamoDB DSN takes region, table, create_table and
// tls (these two true or false) and no others; a Memcached DSN idem_prefix
// alone, and no user name or password (the client does not authenticate):
// anything else is refused, naming the option, rather than dropped. A / ? #
// @ : or % in a user name or password is percent-encoded; a DSN where one
// is not is refused, as it would be read with the password in the host or
// the path (see [redact.HiddenUserInfo]).
package storeopen

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/bradfitz/gomemcache/memcache"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/redact"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/dynamostore"
	"github.com/idemhq/idem/store/memcachedstore"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/store/pgstore"
	"github.com/idemhq/idem/store/redisstore"
	"github.com/idemhq/idem/store/sqlitestore"
)

// Default is the DSN used when none is given: SQLite in the working directory.
const Default = "sqlite:idem.db"

// Opened is an open store with what else it offers.
type Opened struct {
	Store idem.Store
	// Kind names the store: memory, sqlite, postgres or redis.
	Kind string
	// NewNotifier starts a notifier that wakes waiters across instances
	// (PostgreSQL LISTEN/NOTIFY, Redis pub/sub); nil for stores that have
	// none. Close closes it too. It costs a round trip per settled record,
	// so start it only where waiting is configured.
	NewNotifier func(ctx context.Context) (idem.Notifier, error)
	// Close releases the store's connections or file.
	Close func() error
}

// closer closes a notifier, if one was started, before the store.
type closer struct {
	notifier interface{ Close() error }
	store    func() error
}

func (c *closer) close() error {
	if c.notifier != nil {
		c.notifier.Close()
	}
	return c.store()
}

// Kind names the store kind of a DSN, as Opened.Kind does.
func Kind(dsn string) string {
	scheme, _, _ := strings.Cut(dsn, ":")
	return kindOf(scheme)
}

// kindOf names the store kind of a DSN scheme, as Opened.Kind does.
func kindOf(scheme string) string {
	switch scheme {
	case "memory", "mem":
		return "memory"
	case "sqlite", "sqlite3", "file":
		return "sqlite"
	case "postgres", "postgresql":
		return "postgres"
	case "redis", "rediss", "redis+cluster", "rediss+cluster":
		return "redis"
	}
	return scheme
}

// dynamoMaxBody is the DynamoDB store's body limit.
const dynamoMaxBody = dynamostore.MaxBodyBytes

// Open opens the store named by dsn. Its errors never hold the DSN's
// password, even for a DSN that does not parse.
func Open(ctx context.Context, dsn string) (*Opened, error) {
	o, err := open(ctx, dsn)
	if err != nil {
		return nil, scrub(err, dsn)
	}
	return o, nil
}

// OpenExisting is [Open] for a command that reads a store that must already
// be there: a SQLite DSN naming no file is an error wrapping
// [idem.ErrInvalid], rather than a new, empty database.
func OpenExisting(ctx context.Context, dsn string) (*Opened, error) {
	if path, missing := Missing(dsn); missing {
		return nil, fmt.Errorf("%w: store %s: there is no database at %s (is the store right?)", idem.ErrInvalid, dsn, path)
	}
	return Open(ctx, dsn)
}

// Missing returns the path of the SQLite database dsn names, made absolute,
// when there is no file there: opening it would create a new, empty one.
func Missing(dsn string) (path string, missing bool) {
	path, ok := sqlitePath(dsn)
	if !ok || path == "" || strings.ContainsAny(path, "?#") { // refused by Open
		return "", false
	}
	if _, err := os.Stat(path); !errors.Is(err, fs.ErrNotExist) {
		return "", false
	}
	if abs, err := filepath.Abs(path); err == nil {
		path = abs
	}
	return path, true
}

// sqlitePath returns the path of a SQLite DSN, and whether it is one.
func sqlitePath(dsn string) (string, bool) {
	scheme, rest, _ := strings.Cut(dsn, ":")
	if kindOf(scheme) != "sqlite" {
		return "", false
	}
	return strings.TrimPrefix(rest, "//"), true // as open reads it
}

// password finds the password of a URL-shaped DSN without parsing it, since
// a DSN that does not parse is precisely when a driver's error echoes it.
var password = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9+.-]*://[^:/@]*:([^@]*)@`)

// scrubbed is an error whose message has had a secret taken out; it
// unwraps to the original, for errors.Is.
type scrubbed struct {
	msg string
	err error
}

func (e *scrubbed) Error() string { return e.msg }
func (e *scrubbed) Unwrap() error { return e.err }

// queryOption finds the options of a DSN's query without parsing it.
var queryOption = regexp.MustCompile(`[?&]([^=&#]*)=([^&#]*)`)

// scrub takes dsn's secrets (its password, as written and as decoded, and
// the values of its query options that hold one) out of err's message. The
// password is found in the DSN's text, whatever url.Parse makes of it; and
// since an unencoded / ? or # in it ends the authority, what follows each
// of these is taken out too: a driver names it as the database, or as an
// option ("database=hunter2@db/x" for postgres://app:/hunter2@db/x).
func scrub(err error, dsn string) error {
	var secrets []string
	if m := password.FindStringSubmatch(dsn); m != nil && m[1] != "" {
		secrets = append(secrets, m[1])
		for i, c := range m[1] {
			if strings.ContainsRune("/?#", c) && i+1 < len(m[1]) {
				secrets = append(secrets, m[1][i+1:])
			}
		}
	}
	for _, m := range queryOption.FindAllStringSubmatch(dsn, -1) {
		if redact.SecretOption(m[1]) && m[2] != "" {
			secrets = append(secrets, m[2])
		}
	}
	if len(secrets) == 0 {
		return err
	}
	msg := err.Error()
	for _, secret := range secrets {
		msg = strings.ReplaceAll(msg, secret, "xxxxx")
		for _, unescape := range []func(string) (string, error){url.PathUnescape, url.QueryUnescape} {
			if dec, derr := unescape(secret); derr == nil && dec != "" {
				msg = strings.ReplaceAll(msg, dec, "xxxxx")
			}
		}
	}
	return &scrubbed{msg: msg, err: err}
}

// plainPath is a store with no kind that is shown in its error: a file path,
// with nothing (no =, no space, no @) that a DSN holding a password has.
var plainPath = regexp.MustCompile(`^[A-Za-z0-9_./~+-]+$`)

func open(ctx context.Context, dsn string) (*Opened, error) {
	scheme, _, _ := strings.Cut(dsn, ":")
	switch scheme {
	case "memory", "mem":
		return &Opened{Store: memstore.New(), Kind: "memory", Close: func() error { return nil }}, nil
	case "sqlite", "sqlite3", "file":
		path, _ := sqlitePath(dsn)
		if path == "" {
			return nil, fmt.Errorf("%w: store %q: sqlite needs a path, as in sqlite:idem.db", idem.ErrInvalid, dsn)
		}
		if i := strings.IndexAny(path, "?#"); i >= 0 {
			// SQLite's URI options (file:PATH?cache=shared) would be read
			// as part of the file name: a new, empty database elsewhere.
			return nil, fmt.Errorf("%w: store %s%s…: a SQLite store is a plain file path, with no options (no %q in it): use %s:%s",
				idem.ErrInvalid, dsn[:len(dsn)-len(path)], path[:i], path[i], scheme, path[:i])
		}
		s, err := sqlitestore.Open(ctx, sqlitestore.Config{Path: path})
		if err != nil {
			return nil, err
		}
		return &Opened{Store: s, Kind: "sqlite", Close: s.Close}, nil
	case "postgres", "postgresql":
		return openPostgres(ctx, dsn)
	case "redis", "rediss", "redis+cluster", "rediss+cluster":
		return openRedis(ctx, dsn, scheme)
	case "dynamodb":
		return openDynamo(ctx, dsn)
	case "memcached":
		return openMemcached(dsn)
	}
	if !strings.Contains(dsn, ":") {
		if plainPath.MatchString(dsn) { // a path: it holds no credentials
			return nil, fmt.Errorf("%w: store %q names no kind: a SQLite file is sqlite:%s; the others are postgres://…, redis://…, redis+cluster://…, dynamodb://…, memcached://… or memory:", idem.ErrInvalid, dsn, dsn)
		}
		// Not a path: a libpq key=value DSN, say, which may hold a password.
		return nil, fmt.Errorf("%w: store names no kind: use sqlite:PATH, postgres://…, redis://…, redis+cluster://…, dynamodb://…, memcached://… or memory:", idem.ErrInvalid)
	}
	return nil, fmt.Errorf("%w: store %s: unknown kind %q; use sqlite:PATH, postgres://…, redis://…, redis+cluster://…, dynamodb://…, memcached://… or memory:", idem.ErrInvalid, Redact(dsn), schemeOf(dsn))
}

// takeOption removes idem's own query option from a DSN, so the driver
// never sees it.
func takeOption(dsn, name string) (string, string, error) {
	u, err := parseDSN(dsn)
	if err != nil {
		return "", "", err
	}
	q := u.Query()
	v := q.Get(name)
	q.Del(name)
	u.RawQuery = q.Encode()
	return u.String(), v, nil
}

func openPostgres(ctx context.Context, dsn string) (*Opened, error) {
	dsn, schema, err := takeOption(dsn, "idem_schema")
	if err != nil {
		return nil, err
	}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return nil, fmt.Errorf("%w: store %s: %v", idem.ErrInvalid, Redact(dsn), err)
	}
	s, err := pgstore.New(ctx, pgstore.Config{Pool: pool, Schema: schema})
	if err != nil {
		pool.Close()
		return nil, err
	}
	c := &closer{store: func() error { pool.Close(); return nil }}
	return &Opened{Store: s, Kind: "postgres", Close: c.close, NewNotifier: func(ctx context.Context) (idem.Notifier, error) {
		n, err := pgstore.NewNotifier(ctx, pgstore.NotifierConfig{Pool: pool})
		if err == nil {
			c.notifier = n
		}
		return n, err
	}}, nil
}

func openRedis(ctx context.Context, dsn, scheme string) (*Opened, error) {
	dsn, prefix, err := takeOption(dsn, "idem_prefix")
	if err != nil {
		return nil, err
	}
	var client redis.UniversalClient
	if base, ok := strings.CutSuffix(scheme, "+cluster"); ok {
		opts, err := redis.ParseClusterURL(base + strings.TrimPrefix(dsn, scheme))
		if err != nil {
			return nil, fmt.Errorf("%w: store %s: %v", idem.ErrInvalid, Redact(dsn), err)
		}
		opts.ContextTimeoutEnabled = true // a call ends at its deadline (store_timeout), not at go-redis's read timeout
		client = redis.NewClusterClient(opts)
	} else {
		opts, err := redis.ParseURL(dsn)
		if err != nil {
			return nil, fmt.Errorf("%w: store %s: %v", idem.ErrInvalid, Redact(dsn), err)
		}
		opts.ContextTimeoutEnabled = true
		client = redis.NewClient(opts)
	}
	s, err := redisstore.New(redisstore.Config{Client: client, Prefix: prefix})
	if err != nil {
		client.Close()
		return nil, err
	}
	if err := probeRedis(ctx, s, client); err != nil {
		client.Close()
		return nil, fmt.Errorf("store %s: %w", Redact(dsn), err)
	}
	c := &closer{store: client.Close}
	return &Opened{Store: s, Kind: "redis", Close: c.close, NewNotifier: func(ctx context.Context) (idem.Notifier, error) {
		n, err := redisstore.NewNotifier(ctx, redisstore.NotifierConfig{Client: client})
		if err == nil {
			c.notifier = n
		}
		return n, err
	}}, nil
}

// probeTimeout bounds probe: a server that does not answer by then is
// taken as not reachable yet, as before the probe.
const probeTimeout = 3 * time.Second

// probeScope and probeKey name the record probe reads, which no request
// writes.
const probeScope, probeKey = "idem-storeopen", "probe"

// probe makes one call on a store whose client opens without talking to
// its server (Redis, DynamoDB), so that a server that refuses the DSN for
// good is told at once, rather than by every call for ever. It reads a
// record with the store itself, so that its error is the store's own
// translation: refused credentials, or permissions the store's calls need
// (NOAUTH, WRONGPASS, NOPERM; AccessDeniedException,
// UnrecognizedClientException…), are [idem.ErrDenied]; another answer of
// the server that is not about reaching it (a missing DynamoDB table; AUTH
// sent to a Redis with no password) is returned as it is. A server that
// cannot be reached, or does not answer within probeTimeout, is no error:
// the store opens as before, and its calls fail as unavailable until the
// server answers.
func probe(ctx context.Context, s idem.Store) (reached bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	_, err = s.Get(ctx, store.GetParams{Scope: probeScope, Key: probeKey, Now: time.Now()})
	switch {
	case err == nil || errors.Is(err, idem.ErrNotFound):
		return true, nil
	case errors.Is(err, idem.ErrDenied):
		return true, fmt.Errorf("the server refuses the DSN's credentials or permissions: %w", err)
	case errors.Is(err, idem.ErrUnavailable) || ctx.Err() != nil:
		return false, nil
	}
	return true, fmt.Errorf("the server refuses the store's calls: %w", err)
}

// probeRedis is [probe] for Redis; on Redis Cluster, each master is asked
// too (a PING): one that refuses the credentials (ACLs are each node's
// own) is [idem.ErrDenied].
func probeRedis(ctx context.Context, s *redisstore.Store, client redis.UniversalClient) error {
	reached, err := probe(ctx, s)
	cluster, ok := client.(*redis.ClusterClient)
	if err != nil || !reached || !ok {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	err = cluster.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
		if err := c.Ping(ctx).Err(); redis.HasErrorPrefix(err, "NOAUTH") || redis.HasErrorPrefix(err, "WRONGPASS") {
			return fmt.Errorf("master %s: %w", c.Options().Addr, store.Denied(err))
		}
		return nil
	})
	if errors.Is(err, idem.ErrDenied) {
		return fmt.Errorf("the server refuses the DSN's credentials: %w", err)
	}
	return nil
}

// parseDSN parses a URL-shaped DSN. Its error never quotes the DSN, nor
// url's error, which may hold part of a password (a password with a / in
// it makes url read what follows the : as a port).
//
// A DSN whose user-info url.Parse does not read as such (see
// [redact.HiddenUserInfo]: "postgres://app:/hunter2@db/x" is host "app:",
// database "hunter2@db/x") is refused the same way: the driver would
// connect elsewhere and name the password in its errors.
func parseDSN(dsn string) (*url.URL, error) {
	u, err := url.Parse(dsn)
	if err == nil && !redact.HiddenUserInfo(dsn) {
		return u, nil
	}
	var uerr *url.Error
	if _, rest, ok := strings.Cut(dsn, "://"); ok && err != nil && errors.As(err, &uerr) {
		if at := strings.LastIndex(rest, "@"); at < 0 || !strings.ContainsAny(rest[:at], "/?#") {
			// The user-info was read as such: url's own words ("invalid
			// port") quote no part of it.
			return nil, fmt.Errorf("%w: store %s: %v", idem.ErrInvalid, Redact(dsn), uerr.Err)
		}
	}
	return nil, fmt.Errorf("%w: store %s: not a valid URL (%s)", idem.ErrInvalid, Redact(dsn), redact.PercentEncode)
}

// Redact returns dsn fit for a message or a log line (see [redact.URL]):
// a SQLite path or memory: as it is.
func Redact(dsn string) string {
	scheme := schemeOf(dsn)
	if !strings.Contains(dsn, "://") && kindOf(scheme) == "sqlite" || kindOf(scheme) == "memory" {
		return dsn // a path, or nothing
	}
	if scheme == "" {
		return "(a DSN that is not a URL)"
	}
	return redact.URL(dsn)
}

// schemeOf is the scheme of a DSN, or "" when what comes before its first
// colon is no scheme (and may be a secret).
func schemeOf(dsn string) string { return redact.Scheme(dsn) }

// dynamoOptions are the query options of a DynamoDB DSN; the booleans
// among them take true or false.
var (
	dynamoOptions  = []string{"region", "table", "create_table", "tls"}
	dynamoBooleans = []string{"create_table", "tls"}
)

func openDynamo(ctx context.Context, dsn string) (*Opened, error) {
	u, err := parseDSN(dsn)
	if err != nil {
		return nil, err
	}
	q := u.Query()
	if err := checkOptions(dsn, q, dynamoOptions, dynamoBooleans); err != nil {
		return nil, err
	}
	if u.Path != "" && u.Path != "/" {
		return nil, fmt.Errorf("%w: store %s: a DynamoDB DSN has no path: the table is ?table=NAME", idem.ErrInvalid, Redact(dsn))
	}
	opts := []func(*config.LoadOptions) error{config.WithLogger(awsLogger())}
	if r := q.Get("region"); r != "" {
		opts = append(opts, config.WithRegion(r))
	}
	if u.User != nil {
		secret, ok := u.User.Password()
		if u.User.Username() == "" || !ok || secret == "" {
			return nil, fmt.Errorf("%w: store %s: want both an access key and its secret (dynamodb://KEY:SECRET@…), or neither for the AWS default credentials", idem.ErrInvalid, Redact(dsn))
		}
		opts = append(opts, config.WithCredentialsProvider(credentials.NewStaticCredentialsProvider(u.User.Username(), secret, "")))
	}
	cfg, err := config.LoadDefaultConfig(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("%w: store %s: %v", idem.ErrInvalid, Redact(dsn), err)
	}
	client := dynamodb.NewFromConfig(cfg, func(o *dynamodb.Options) {
		if u.Host != "" {
			scheme := "http"
			if q.Get("tls") == "true" {
				scheme = "https"
			}
			o.BaseEndpoint = aws.String(scheme + "://" + u.Host)
		}
	})
	table := q.Get("table")
	if table == "" {
		table = dynamostore.DefaultTable
	}
	if q.Get("create_table") == "true" {
		if err := dynamostore.CreateTable(ctx, client, table); err != nil {
			return nil, err
		}
	}
	s, err := dynamostore.New(dynamostore.Config{Client: client, Table: table})
	if err != nil {
		return nil, err
	}
	if _, err := probe(ctx, s); errors.Is(err, dynamostore.ErrTableNotFound) {
		return nil, fmt.Errorf("%w: store %s: %w: there is no table %q where the DSN points (create it, or add create_table=true)",
			idem.ErrInvalid, Redact(dsn), dynamostore.ErrTableNotFound, table)
	} else if err != nil {
		return nil, fmt.Errorf("store %s: %w", Redact(dsn), err)
	}
	return &Opened{Store: s, Kind: "dynamodb", Close: func() error { return nil }}, nil
}

func openMemcached(dsn string) (*Opened, error) {
	u, err := parseDSN(dsn)
	if err != nil {
		return nil, err
	}
	if err := checkOptions(dsn, u.Query(), []string{"idem_prefix"}, nil); err != nil {
		return nil, err
	}
	if u.User != nil {
		// The client never authenticates: the credentials would be
		// dropped without a word, and the server used without them.
		return nil, fmt.Errorf("%w: store %s: a Memcached DSN takes no user name or password: the client does not authenticate (no SASL); secure the server by its network", idem.ErrInvalid, Redact(dsn))
	}
	if u.Host == "" || u.Path != "" && u.Path != "/" {
		return nil, fmt.Errorf("%w: store %s: want memcached://host:port[,host:port][?idem_prefix=NAME]", idem.ErrInvalid, Redact(dsn))
	}
	servers := strings.Split(u.Host, ",")
	client := memcache.New(servers...)
	client.MaxIdleConns = 64
	s, err := memcachedstore.New(memcachedstore.Config{Client: client, Servers: servers, Prefix: u.Query().Get("idem_prefix")})
	if err != nil {
		return nil, err
	}
	return &Opened{Store: s, Kind: "memcached", Close: client.Close}, nil
}

// checkOptions refuses a query option of dsn that is not one of known (a
// mistyped one would be dropped without a word: tabel=… keeps the records
// in the default table, which another deployment may use), one given twice
// or empty, and a boolean one whose value is not true or false. The error
// names the option, and shows its value only as [Redact] does (never the
// value of an option whose name says it holds a secret).
func checkOptions(dsn string, q url.Values, known, booleans []string) error {
	names := make([]string, 0, len(q))
	for name := range q {
		names = append(names, name)
	}
	slices.Sort(names)
	bad := func(name, why string) error {
		return fmt.Errorf("%w: store %s: option %q %s", idem.ErrInvalid, Redact(dsn), name, why)
	}
	for _, name := range names {
		v := q[name]
		switch {
		case !slices.Contains(known, name):
			return bad(name, fmt.Sprintf("is not one of this store's (%s)", strings.Join(known, ", ")))
		case len(v) > 1:
			return bad(name, "is given more than once")
		case v[0] == "":
			return bad(name, "is empty: leave it out for the default")
		case slices.Contains(booleans, name) && v[0] != "true" && v[0] != "false":
			return bad(name, "wants true or false")
		}
	}
	return nil
}
