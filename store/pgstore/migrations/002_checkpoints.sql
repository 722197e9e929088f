-- Recovery points (idem.Checkpoint): the concatenated idem.AppendCheckpoint
-- lines, oldest first; NULL when there are none. Checkpoint appends with ||.
-- {{schema}} is replaced by the quoted schema name.
ALTER TABLE {{schema}}.records ADD COLUMN IF NOT EXISTS checkpoints bytea;
