//! A runtime that makes nothing, for tests of the engine and the API.
