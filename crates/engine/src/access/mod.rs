//! The access part of the engine: who may use the server and its sandboxes.
//!
//! API keys (`keys.rs`), previews of a sandbox's ports (`preview.rs`) and the
//! tokens of the SSH gateway (`ssh.rs`). It reads sandboxes from the store
//! and drives none of them.

mod keys;
mod preview;
mod ssh;

use std::sync::{Arc, RwLock};

use crate::shared::Shared;

pub use keys::hash_api_key;
pub use ssh::{IssuedSshAccess, SshAccessRecord, MAX_SSH_ACCESS_MINUTES};

/// Keys and tokens. Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct Access {
    shared: Arc<Shared>,
    /// Stored key hashes, read once: checking a key must not cost a query per request.
    api_keys: Arc<RwLock<Option<Vec<String>>>>,
}

impl Access {
    pub(crate) fn new(shared: Arc<Shared>) -> Access {
        Access {
            shared,
            api_keys: Arc::default(),
        }
    }
}
