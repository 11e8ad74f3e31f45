//! container
