-- 3,000 keys into idem_walcost.:tbl after a checkpoint; prints the WAL bytes
-- per key and the HOT share of the updates. The record's sizes are those of
-- the harness (220 B of body): in the compact forms of a table created now
-- (records, lean_no_partial), a 129-byte fingerprint and a 256-byte
-- response; as text and JSON in the others, 178 and 373 B. (The stored
-- response has no Idempotency-Expires since the engine derives it from the
-- record's expiry: 51 B less.)
SET idem.tbl = :'tbl';
CHECKPOINT;
SELECT pg_current_wal_lsn() AS start \gset
DO $$
DECLARE
	tbl text := current_setting('idem.tbl');
	k text;
BEGIN
	FOR i IN 1..3000 LOOP
		k := md5(random()::text);
		IF tbl = 'raw' THEN
			INSERT INTO idem_walcost.raw VALUES ('', k, 'in_progress') ON CONFLICT DO NOTHING;
			COMMIT;
			UPDATE idem_walcost.raw SET state = 'completed', body = convert_to(repeat('x', 220), 'UTF8')
			WHERE scope = '' AND key = k;
			COMMIT;
		ELSIF tbl = 'raw_scoped' THEN
			INSERT INTO idem_walcost.raw_scoped VALUES (repeat('5e', 32), k, 'in_progress') ON CONFLICT DO NOTHING;
			COMMIT;
			UPDATE idem_walcost.raw_scoped SET state = 'completed', body = convert_to(repeat('x', 220), 'UTF8')
			WHERE scope = repeat('5e', 32) AND key = k;
			COMMIT;
		ELSIF tbl = 'lean_no_partial' THEN
			INSERT INTO idem_walcost.lean_no_partial (scope, key, state, fingerprint, token, fence, lease_expires, takeover_safe, created, updated)
			VALUES ('tenant', k, 'p', decode(repeat('ab', 129), 'hex'), decode(repeat('cd', 16), 'hex'), 1, now() + interval '30s', false, now(), now())
			ON CONFLICT DO NOTHING;
			COMMIT;
			UPDATE idem_walcost.lean_no_partial SET state = 'c', response = convert_to(repeat('x', 256), 'UTF8'),
				expires = now() + interval '24h', updated = now() WHERE scope = 'tenant' AND key = k;
			COMMIT;
		ELSIF tbl = 'records' THEN
			INSERT INTO idem_walcost.records (scope, key, state, fingerprint, token, fence, lease_expires, takeover_safe, created, updated)
			VALUES ('tenant', k, 'in_progress', decode(repeat('ab', 129), 'hex'), repeat('t', 26), 1, now() + interval '30s', false, now(), now())
			ON CONFLICT DO NOTHING;
			COMMIT;
			UPDATE idem_walcost.records SET state = 'completed', response = convert_to(repeat('x', 256), 'UTF8'),
				expires = now() + interval '24h', updated = now() WHERE scope = 'tenant' AND key = k;
			COMMIT;
		ELSE
			EXECUTE format('INSERT INTO idem_walcost.%I (scope, key, state, fingerprint, token, fence, lease_expires, takeover_safe, created, updated) VALUES ($1, $2, ''in_progress'', $3, $4, 1, now() + interval ''30s'', false, now(), now()) ON CONFLICT DO NOTHING', tbl)
				USING 'tenant', k, repeat('f', 178), repeat('t', 26);
			COMMIT;
			EXECUTE format('UPDATE idem_walcost.%I SET state = ''completed'', response = $3, expires = now() + interval ''24h'', updated = now() WHERE scope = $1 AND key = $2', tbl)
				USING 'tenant', k, convert_to(repeat('x', 373), 'UTF8');
			COMMIT;
		END IF;
	END LOOP;
END $$;
SELECT pg_stat_force_next_flush() \gset
SELECT format('%-16s %5s B of WAL per key, %s of %s updates HOT', :'tbl',
	round(pg_wal_lsn_diff(pg_current_wal_lsn(), :'start') / 3000),
	n_tup_hot_upd, n_tup_upd)
FROM pg_stat_user_tables WHERE schemaname = 'idem_walcost' AND relname = :'tbl';
