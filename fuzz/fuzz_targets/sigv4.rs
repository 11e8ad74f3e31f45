//! Fuzz target `sigv4`: the object-storage endpoint's AWS Signature Version 4
//! check (`crates/api/src/object_storage/sigv4.rs`, compiled from its file)
//! on arbitrary requests.
//!
//! The input is a request in lines: the method, the URI (path and query),
//! then `name: value` header lines; what `http` would refuse to carry (an
//! invalid method, URI or header) is skipped, as hyper refuses it before the
//! handler. Besides "no panic": a request that verifies carries the
//! signature cove computes, and one given that signature verifies.

#![no_main]

#[allow(dead_code)]
#[path = "../../crates/api/src/object_storage/sigv4.rs"]
mod sigv4;

use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};
use libfuzzer_sys::fuzz_target;

/// The secret of AWS's documented example (the seeds use it).
const SECRET: &str = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";
/// 2013-05-24T00:00:00Z, the example's date: the server's clock.
const NOW: i64 = 1_369_353_600;

fuzz_target!(|data: &[u8]| {
    let mut lines = data.split(|b| *b == b'\n');
    let Some(Ok(method)) = lines.next().map(Method::from_bytes) else {
        return;
    };
    let Some(Ok(uri)) = lines.next().map(Uri::try_from) else {
        return;
    };
    let mut headers = HeaderMap::new();
    for line in lines {
        let Some(colon) = line.iter().position(|b| *b == b':') else {
            continue;
        };
        let name = HeaderName::from_bytes(&line[..colon]);
        let value = HeaderValue::from_bytes(line[colon + 1..].trim_ascii());
        if let (Ok(name), Ok(value)) = (name, value) {
            headers.append(name, value);
        }
    }
    let Ok(mut auth) = sigv4::parse_authorization(&headers) else {
        return;
    };
    let verified = sigv4::verify(&auth, SECRET, &method, &uri, &headers, NOW);
    let Ok(expected) = sigv4::signature(&auth, SECRET, &method, &uri, &headers) else {
        assert!(verified.is_err(), "verified without a signature to compare");
        return;
    };
    if verified.is_ok() {
        assert_eq!(auth.signature, expected, "verified with another signature");
    }
    auth.signature = expected;
    if let Err(refusal) = sigv4::verify(&auth, SECRET, &method, &uri, &headers, NOW) {
        // Only the clock may refuse a request carrying the right signature.
        assert_ne!(refusal.code, "SignatureDoesNotMatch", "{refusal:?}");
    }
});
