-- The sandbox a linked (ephemeral) sandbox shares a private network with.
ALTER TABLE sandboxes ADD COLUMN linked_sandbox_id TEXT;
-- Every attach looks up the sandboxes linked to the one attached.
CREATE INDEX sandboxes_by_linked ON sandboxes (linked_sandbox_id);
