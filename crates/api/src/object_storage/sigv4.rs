//! Checking AWS Signature Version 4 on an S3 request, as the SDK's S3 client
//! (`obstore`) signs it: an `Authorization: AWS4-HMAC-SHA256 ...` header over
//! the method, path, query, the signed headers and the payload's SHA-256.
//! The server recomputes the signature with the secret it issued and
//! compares.
//!
//! `fuzz/fuzz_targets/sigv4.rs` compiles this file on its own (`#[path]`), so
//! it uses nothing of this crate and only `http`, `hmac`, `sha2`, `time` and
//! `form_urlencoded`.

use hmac::{Hmac, Mac};
use http::{HeaderMap, Method, Uri};
use sha2::{Digest as _, Sha256};

type HmacSha256 = Hmac<Sha256>;

/// How far a request's `x-amz-date` may be from this server's clock.
const MAX_SKEW_SECONDS: i64 = 15 * 60;

/// The parts of an `Authorization` header.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Authorization {
    pub access_key: String,
    /// `date/region/service/aws4_request`.
    pub scope: String,
    pub date: String,
    pub signed_headers: Vec<String>,
    pub signature: String,
}

/// Why a request is not accepted, as S3 names it.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Refusal {
    pub code: &'static str,
    pub message: String,
}

fn refuse(code: &'static str, message: impl Into<String>) -> Refusal {
    Refusal {
        code,
        message: message.into(),
    }
}

/// Reads `Authorization: AWS4-HMAC-SHA256 Credential=..., SignedHeaders=..., Signature=...`.
pub(super) fn parse_authorization(headers: &HeaderMap) -> Result<Authorization, Refusal> {
    let value = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| {
            refuse(
                "AccessDenied",
                "sign requests with AWS Signature Version 4 and the credentials from push-access",
            )
        })?;
    let fields = value.strip_prefix("AWS4-HMAC-SHA256 ").ok_or_else(|| {
        refuse(
            "AccessDenied",
            "only AWS4-HMAC-SHA256 signatures are accepted",
        )
    })?;
    let mut credential = None;
    let mut signed_headers = None;
    let mut signature = None;
    for field in fields.split(',') {
        match field.trim().split_once('=') {
            Some(("Credential", v)) => credential = Some(v),
            Some(("SignedHeaders", v)) => signed_headers = Some(v),
            Some(("Signature", v)) => signature = Some(v),
            _ => {}
        }
    }
    let malformed = || {
        refuse(
            "AuthorizationHeaderMalformed",
            format!("cannot read {value:?}"),
        )
    };
    let (access_key, scope) = credential
        .and_then(|c| c.split_once('/'))
        .ok_or_else(malformed)?;
    let date = scope.split('/').next().unwrap_or_default();
    if scope.split('/').count() != 4 || !scope.ends_with("/s3/aws4_request") || date.len() != 8 {
        return Err(malformed());
    }
    Ok(Authorization {
        access_key: access_key.to_owned(),
        scope: scope.to_owned(),
        date: date.to_owned(),
        signed_headers: signed_headers
            .ok_or_else(malformed)?
            .split(';')
            .map(str::to_owned)
            .collect(),
        signature: signature.ok_or_else(malformed)?.to_owned(),
    })
}

/// Percent-encodes as SigV4 wants: everything but `A-Z a-z 0-9 - _ . ~`.
fn encode(text: &str) -> String {
    let mut out = String::new();
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-_.~".contains(&byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// The query as SigV4 wants it: each name and value decoded, encoded again
/// strictly, sorted.
fn canonical_query(query: Option<&str>) -> String {
    let mut pairs: Vec<(String, String)> = form_urlencoded::parse(query.unwrap_or("").as_bytes())
        .map(|(k, v)| (encode(&k), encode(&v)))
        .collect();
    pairs.sort();
    pairs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join("&")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes keys of any length");
    mac.update(data);
    mac.finalize().into_bytes().to_vec()
}

/// The signature a request should carry, signed with `secret`.
pub(super) fn signature(
    auth: &Authorization,
    secret: &str,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
) -> Result<String, Refusal> {
    let mut canonical_headers = String::new();
    for name in &auth.signed_headers {
        let values: Vec<String> = headers
            .get_all(name.as_str())
            .iter()
            .map(|v| {
                String::from_utf8_lossy(v.as_bytes())
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect();
        if values.is_empty() {
            return Err(refuse(
                "AccessDenied",
                format!("signed header {name} is not in the request"),
            ));
        }
        canonical_headers.push_str(&format!("{name}:{}\n", values.join(",")));
    }
    let payload = header(headers, "x-amz-content-sha256").unwrap_or("UNSIGNED-PAYLOAD");
    let canonical_request = format!(
        "{method}\n{}\n{}\n{canonical_headers}\n{}\n{payload}",
        uri.path(),
        canonical_query(uri.query()),
        auth.signed_headers.join(";"),
    );
    let amz_date = header(headers, "x-amz-date")
        .ok_or_else(|| refuse("AccessDenied", "the request has no x-amz-date"))?;
    let string_to_sign = format!(
        "AWS4-HMAC-SHA256\n{amz_date}\n{}\n{}",
        auth.scope,
        hex(&Sha256::digest(canonical_request.as_bytes()))
    );
    let mut key = format!("AWS4{secret}").into_bytes();
    for part in auth.scope.split('/') {
        key = hmac(&key, part.as_bytes());
    }
    Ok(hex(&hmac(&key, string_to_sign.as_bytes())))
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// Checks the request's date against `now` (Unix seconds) and its signature
/// against the one made with `secret`.
pub(super) fn verify(
    auth: &Authorization,
    secret: &str,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    now: i64,
) -> Result<(), Refusal> {
    let amz_date = header(headers, "x-amz-date")
        .ok_or_else(|| refuse("AccessDenied", "the request has no x-amz-date"))?;
    let format = time::macros::format_description!("[year][month][day]T[hour][minute][second]Z");
    let when = time::PrimitiveDateTime::parse(amz_date, &format)
        .map_err(|_| refuse("AccessDenied", format!("cannot read x-amz-date {amz_date}")))?
        .assume_utc()
        .unix_timestamp();
    if (when - now).abs() > MAX_SKEW_SECONDS || !amz_date.starts_with(&auth.date) {
        return Err(refuse(
            "RequestTimeTooSkewed",
            "the request's time is more than 15 minutes from the server's",
        ));
    }
    let expected = signature(auth, secret, method, uri, headers)?;
    let matches = expected.len() == auth.signature.len()
        && expected
            .bytes()
            .zip(auth.signature.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
    if !matches {
        return Err(refuse(
            "SignatureDoesNotMatch",
            "the request signature does not match the one computed with the issued secret",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The GET example of AWS's S3 SigV4 documentation ("Example: GET
    /// Object"), with its published signature.
    fn example() -> (Method, Uri, HeaderMap) {
        let mut headers = HeaderMap::new();
        headers.insert("host", "examplebucket.s3.amazonaws.com".parse().unwrap());
        headers.insert("range", "bytes=0-9".parse().unwrap());
        headers.insert(
            "x-amz-content-sha256",
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
                .parse()
                .unwrap(),
        );
        headers.insert("x-amz-date", "20130524T000000Z".parse().unwrap());
        headers.insert(
            "authorization",
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
                .parse()
                .unwrap(),
        );
        (Method::GET, "/test.txt".parse().unwrap(), headers)
    }

    const SECRET: &str = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";

    #[test]
    fn the_documented_example_verifies() {
        let (method, uri, headers) = example();
        let auth = parse_authorization(&headers).unwrap();
        assert_eq!(auth.access_key, "AKIAIOSFODNN7EXAMPLE");
        assert_eq!(auth.scope, "20130524/us-east-1/s3/aws4_request");
        let now = 1_369_353_600; // 2013-05-24T00:00:00Z
        verify(&auth, SECRET, &method, &uri, &headers, now).unwrap();
    }

    #[test]
    fn a_changed_request_or_secret_or_clock_is_refused() {
        let (method, uri, mut headers) = example();
        let auth = parse_authorization(&headers).unwrap();
        let now = 1_369_353_600;
        let refused = verify(&auth, "other", &method, &uri, &headers, now).unwrap_err();
        assert_eq!(refused.code, "SignatureDoesNotMatch");
        let other: Uri = "/other.txt".parse().unwrap();
        assert!(verify(&auth, SECRET, &method, &other, &headers, now).is_err());
        assert!(verify(&auth, SECRET, &Method::PUT, &uri, &headers, now).is_err());
        let refused = verify(&auth, SECRET, &method, &uri, &headers, now + 3600).unwrap_err();
        assert_eq!(refused.code, "RequestTimeTooSkewed");
        headers.insert("range", "bytes=0-99".parse().unwrap());
        assert!(verify(&auth, SECRET, &method, &uri, &headers, now).is_err());
    }

    #[test]
    fn queries_are_canonical() {
        assert_eq!(
            canonical_query(Some("uploadId=a%2Fb&partNumber=2&uploads")),
            "partNumber=2&uploadId=a%2Fb&uploads="
        );
        assert_eq!(canonical_query(None), "");
    }

    #[test]
    fn other_authorizations_are_refused() {
        let mut headers = HeaderMap::new();
        assert_eq!(
            parse_authorization(&headers).unwrap_err().code,
            "AccessDenied"
        );
        headers.insert("authorization", "Bearer key".parse().unwrap());
        assert_eq!(
            parse_authorization(&headers).unwrap_err().code,
            "AccessDenied"
        );
        headers.insert(
            "authorization",
            "AWS4-HMAC-SHA256 Credential=x".parse().unwrap(),
        );
        assert_eq!(
            parse_authorization(&headers).unwrap_err().code,
            "AuthorizationHeaderMalformed"
        );
    }
}
