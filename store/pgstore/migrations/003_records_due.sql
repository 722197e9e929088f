-- Completes as HOT updates. PostgreSQL 15 can update a row in place in its
-- page, writing no index entries and the least WAL (a HOT update), only when
-- no indexed column changes, and a column in a partial index's predicate
-- counts. The prune and scan indexes referenced state and expires, which every
-- complete changes, so every complete wrote new entries in all three indexes.
--
-- What they indexed moves to records_due, one row per record: its expiry,
-- NULL while the record is unsettled (in_progress or unknown, as the records
-- CHECK ties expires to state). Triggers on records keep it in step, in the
-- same transaction, whoever writes (this store, FinishTx, an older idem
-- during a rolling upgrade, an operator's DELETE). It is UNLOGGED: it writes
-- no WAL, and PostgreSQL empties it after a crash and on a promoted standby.
-- The row ('', '') (no record has an empty key) says that it is whole: the
-- store checks for it before every scan and prune and, when it is missing,
-- rebuilds the table from records (Store.Scan, Store.Prune).
-- {{schema}} is replaced by the quoted schema name.
CREATE UNLOGGED TABLE IF NOT EXISTS {{schema}}.records_due (
	scope   text COLLATE "C" NOT NULL,
	key     text COLLATE "C" NOT NULL,
	expires timestamptz,
	PRIMARY KEY (scope, key)
);

-- Scan: the unsettled records in (scope, key) order.
CREATE INDEX IF NOT EXISTS records_due_unsettled_idx ON {{schema}}.records_due (scope, key)
	WHERE expires IS NULL;

-- Prune: the settled records by expiry.
CREATE INDEX IF NOT EXISTS records_due_expires_idx ON {{schema}}.records_due (expires)
	WHERE expires IS NOT NULL;

CREATE OR REPLACE FUNCTION {{schema}}.records_due_sync() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
	IF TG_OP = 'TRUNCATE' THEN
		TRUNCATE {{schema}}.records_due;
	ELSIF TG_OP = 'DELETE' THEN
		DELETE FROM {{schema}}.records_due WHERE scope = OLD.scope AND key = OLD.key;
	ELSE
		INSERT INTO {{schema}}.records_due (scope, key, expires) VALUES (NEW.scope, NEW.key, NEW.expires)
		ON CONFLICT (scope, key) DO UPDATE SET expires = excluded.expires;
	END IF;
	RETURN NULL;
END $$;

CREATE TRIGGER records_due_insert_delete AFTER INSERT OR DELETE ON {{schema}}.records
	FOR EACH ROW EXECUTE FUNCTION {{schema}}.records_due_sync();
-- Renewals and checkpoints leave expires alone and do not call the function.
CREATE TRIGGER records_due_update AFTER UPDATE ON {{schema}}.records
	FOR EACH ROW WHEN (OLD.expires IS DISTINCT FROM NEW.expires)
	EXECUTE FUNCTION {{schema}}.records_due_sync();
CREATE TRIGGER records_due_truncate AFTER TRUNCATE ON {{schema}}.records
	FOR EACH STATEMENT EXECUTE FUNCTION {{schema}}.records_due_sync();

DROP INDEX IF EXISTS {{schema}}.records_prune_idx;
DROP INDEX IF EXISTS {{schema}}.records_scan_idx;

-- A complete can be HOT only if the page has room for the completed row
-- beside the one it replaces. A record grows from ~200 B to ~200 B plus its
-- response, so inserts fill each new page to 30% and leave the rest for the
-- completes of the records they put there: at 16 concurrent connections, with
-- 220 B responses, every complete was HOT against 56% with full pages and 91%
-- at 50% (go run ./bench -stores postgres). Pages written before the upgrade
-- keep their fill. A deployment whose responses are much smaller or larger
-- can set its own: ALTER TABLE <schema>.records SET (fillfactor = N).
ALTER TABLE {{schema}}.records SET (fillfactor = 30);
