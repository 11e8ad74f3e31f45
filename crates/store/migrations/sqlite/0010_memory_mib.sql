-- Memory is kept in MiB, not whole GiB, so a guest of 256 MiB can be said.
ALTER TABLE sandboxes RENAME COLUMN memory_gib TO memory_mib;
UPDATE sandboxes SET memory_mib = memory_mib * 1024;
ALTER TABLE snapshots RENAME COLUMN memory_gib TO memory_mib;
UPDATE snapshots SET memory_mib = memory_mib * 1024;
