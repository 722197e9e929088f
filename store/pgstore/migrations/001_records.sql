-- The records table. {{schema}} is replaced by the quoted schema name.
--
-- Keys are stored as sent (never hashed) under their scope, so time-ordered
-- keys keep B-tree locality. COLLATE "C" compares bytes: keys are
-- case-sensitive printable ASCII, and byte order is what the scan pages by.
--
-- The columns a complete writes (state, updated, expires, response) come
-- last: a complete is a HOT update, which logs only the new row's bytes
-- between the prefix and the suffix it shares with the old one, so the
-- columns it keeps are not in its WAL (about 250 B less per key than in the
-- order of release 0.1.0, whose tables keep that order: every statement
-- names its columns, so the store works on either; TestCompleteLogsWhatItWrites).
CREATE TABLE IF NOT EXISTS {{schema}}.records (
	scope         text COLLATE "C" NOT NULL,
	key           text COLLATE "C" NOT NULL,
	-- store.Fingerprint.Compact: 129 bytes for a version-1 fingerprint
	-- (178 characters as text, as release 0.1.0 keeps it).
	fingerprint   bytea NOT NULL,
	token         text NOT NULL,
	fence         bigint NOT NULL CHECK (fence > 0),
	lease_expires timestamptz NOT NULL,
	created       timestamptz NOT NULL,
	takeover_safe boolean NOT NULL,
	state         text NOT NULL
	              CHECK (state IN ('in_progress', 'completed', 'failed', 'unknown')),
	updated       timestamptz NOT NULL,
	-- When a settled record stops being replayed; NULL while unsettled.
	expires       timestamptz CHECK ((expires IS NULL) = (state IN ('in_progress', 'unknown'))),
	-- store.Response.MarshalCompact (MarshalBinary's JSON in a table of
	-- release 0.1.0); set only while completed.
	response      bytea CHECK ((response IS NOT NULL) = (state = 'completed')),
	PRIMARY KEY (scope, key)
);

-- Prune: settled records by expiry.
CREATE INDEX IF NOT EXISTS records_prune_idx ON {{schema}}.records (expires)
	WHERE state IN ('completed', 'failed');

-- Scan: unsettled records in the scan's (scope, key) order. It holds only the
-- records that are running or unknown, so it stays small however many settled
-- records the table keeps.
CREATE INDEX IF NOT EXISTS records_scan_idx ON {{schema}}.records (scope, key)
	WHERE state IN ('in_progress', 'unknown');
