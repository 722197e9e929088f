-- Recovery points: idem.AppendCheckpoint lines, oldest first.
ALTER TABLE idem_records ADD COLUMN checkpoints BLOB;
