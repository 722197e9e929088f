DROP SCHEMA IF EXISTS idem_walcost CASCADE;
CREATE SCHEMA idem_walcost;
-- idem's records table before migration 003: the prune and scan indexes on
-- records itself. (run.sh applies the migrations as they are, in this schema,
-- as the table records.)
CREATE TABLE idem_walcost.idem (
	scope text COLLATE "C" NOT NULL, key text COLLATE "C" NOT NULL, state text NOT NULL,
	fingerprint text NOT NULL, token text NOT NULL, fence bigint NOT NULL,
	lease_expires timestamptz NOT NULL, takeover_safe boolean NOT NULL, response bytea,
	created timestamptz NOT NULL, updated timestamptz NOT NULL, expires timestamptz,
	checkpoints bytea, PRIMARY KEY (scope, key));
CREATE INDEX ON idem_walcost.idem (expires) WHERE state IN ('completed', 'failed');
CREATE INDEX ON idem_walcost.idem (scope, key) WHERE state IN ('in_progress', 'unknown');
-- The same without the prune and scan indexes: what HOT completes would cost.
CREATE TABLE idem_walcost.idem_no_partial (LIKE idem_walcost.idem INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
ALTER TABLE idem_walcost.idem_no_partial ADD PRIMARY KEY (scope, key);
-- idem's columns with those a complete never changes first: on an update
-- that stays on its page, PostgreSQL logs only the new tuple's bytes
-- between the prefix and the suffix it shares with the old one.
CREATE TABLE idem_walcost.idem_reordered (
	scope text COLLATE "C" NOT NULL, key text COLLATE "C" NOT NULL,
	fingerprint text NOT NULL, token text NOT NULL, fence bigint NOT NULL, created timestamptz NOT NULL,
	lease_expires timestamptz NOT NULL, takeover_safe boolean NOT NULL,
	state text NOT NULL, updated timestamptz NOT NULL, expires timestamptz, response bytea,
	checkpoints bytea, PRIMARY KEY (scope, key));
CREATE INDEX ON idem_walcost.idem_reordered (expires) WHERE state IN ('completed', 'failed');
CREATE INDEX ON idem_walcost.idem_reordered (scope, key) WHERE state IN ('in_progress', 'unknown');
-- The leanest record: that order, the fingerprint and token as bytes, a
-- one-byte state, and no partial indexes (HOT completes).
CREATE TABLE idem_walcost.lean_no_partial (
	scope text COLLATE "C" NOT NULL, key text COLLATE "C" NOT NULL,
	fingerprint bytea NOT NULL, token bytea NOT NULL, fence bigint NOT NULL, created timestamptz NOT NULL,
	lease_expires timestamptz NOT NULL, takeover_safe boolean NOT NULL,
	state "char" NOT NULL, updated timestamptz NOT NULL, expires timestamptz, response bytea,
	checkpoints bytea, PRIMARY KEY (scope, key));
-- The raw limit (bench/serve.go's rawTable).
CREATE TABLE idem_walcost.raw (scope text NOT NULL, key text NOT NULL, state text NOT NULL,
	body bytea, PRIMARY KEY (scope, key));
-- The raw limit keyed as idem keys a record: under the caller's scope
-- (HashScope's 64 hex digits), which a check for more than one caller
-- needs, or one caller's key replays another's answer.
CREATE TABLE idem_walcost.raw_scoped (LIKE idem_walcost.raw INCLUDING ALL);
