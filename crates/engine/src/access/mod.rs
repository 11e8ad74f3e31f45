//! The access part of the engine: who may use the server and its sandboxes.
//!
//! API keys (`keys.rs`), the audit log (`audit.rs`), previews of a sandbox's ports (`preview.rs`) and the
//! tokens of the SSH gateway (`ssh.rs`). It reads sandboxes from the store
//! and drives none of them.

mod audit;
mod keys;
mod preview;
mod ssh;

use std::sync::{Arc, Mutex, RwLock};

use cove_store::ApiKeyRecord;

use crate::shared::Shared;

pub(crate) use keys::hash_secret;
pub use keys::{
    constant_time_eq, hash_api_key, ApiKeyInfo, Caller, KeyCheck, NewApiKey, Permission,
};
pub(crate) use preview::random_token;
pub use ssh::{IssuedSshAccess, SshAccessRecord, MAX_SSH_ACCESS_MINUTES};

/// Keys and tokens. Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct Access {
    shared: Arc<Shared>,
    /// The stored keys, read once (`keys.rs`).
    api_keys: Arc<RwLock<Option<Arc<Vec<ApiKeyRecord>>>>>,
    /// When each key's last use was written, by hash.
    touched: Arc<Mutex<keys::Touched>>,
}

impl Access {
    pub(crate) fn new(shared: Arc<Shared>) -> Access {
        Access {
            shared,
            api_keys: Arc::default(),
            touched: Arc::default(),
        }
    }
}
