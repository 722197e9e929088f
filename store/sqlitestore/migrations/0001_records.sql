CREATE TABLE IF NOT EXISTS idem_records (
	scope         TEXT    NOT NULL,
	key           TEXT    NOT NULL,
	state         TEXT    NOT NULL CHECK (state IN ('in_progress', 'completed', 'failed', 'unknown')),
	fingerprint   TEXT    NOT NULL,
	token         TEXT    NOT NULL,
	fence         INTEGER NOT NULL,
	lease_expires INTEGER NOT NULL, -- unix nanoseconds
	takeover_safe INTEGER NOT NULL,
	response      BLOB,             -- idem.Response.MarshalBinary, completed records only
	created       INTEGER NOT NULL,
	updated       INTEGER NOT NULL,
	expires       INTEGER,          -- NULL while in_progress or unknown
	PRIMARY KEY (scope, key)
);

CREATE INDEX IF NOT EXISTS idem_records_expires ON idem_records (expires)
	WHERE state IN ('completed', 'failed');

CREATE INDEX IF NOT EXISTS idem_records_unsettled ON idem_records (scope, key)
	WHERE state IN ('in_progress', 'unknown');
