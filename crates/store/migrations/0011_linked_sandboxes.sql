-- The sandbox a linked (ephemeral) sandbox shares a private network with.
ALTER TABLE sandboxes ADD COLUMN linked_sandbox_id TEXT;
