//! The base protocol's framing of JSON-RPC messages on a language server's
//! stdin and stdout: a header section (`Content-Length: N`, optionally
//! `Content-Type`, each line ending in `\r\n`), an empty line, then N bytes
//! of JSON.
//!
//! [`Decoder`] is pure (bytes in, message bodies out), so reads cut anywhere
//! and several messages in one read are tested without a process. What the
//! server writes is bounded: a header section past [`MAX_HEADER_BYTES`] or a
//! body past [`MAX_MESSAGE_BYTES`] is an error, not an allocation.

/// Largest message body accepted: a completion list of a big TypeScript
/// project is a few MiB; anything near this is a broken or hostile server.
pub const MAX_MESSAGE_BYTES: usize = 32 << 20;
/// Largest header section accepted (real ones are under 100 bytes).
pub const MAX_HEADER_BYTES: usize = 8 << 10;

/// Why a server's output is not the base protocol.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// A header line without `:`.
    #[error("malformed header line {0:?}")]
    MalformedHeader(String),
    #[error("a message header has no Content-Length")]
    NoContentLength,
    #[error("Content-Length {0:?} is not a number")]
    BadContentLength(String),
    #[error("a message of {0} bytes is over the limit of {MAX_MESSAGE_BYTES}")]
    TooLarge(usize),
    #[error("a header section runs past {MAX_HEADER_BYTES} bytes without ending")]
    HeaderTooLong,
}

/// One message's frame around `body` (serialised JSON).
pub fn encode(body: &[u8]) -> Vec<u8> {
    let mut frame = format!("Content-Length: {}\r\n\r\n", body.len()).into_bytes();
    frame.extend_from_slice(body);
    frame
}

/// Reassembles message bodies from reads of any size.
#[derive(Debug, Default)]
pub struct Decoder {
    buffered: Vec<u8>,
    /// The body length of the message whose header has been read.
    body_len: Option<usize>,
}

impl Decoder {
    /// Appends what one read returned.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buffered.extend_from_slice(bytes);
    }

    /// The next whole message body, `None` until more bytes arrive. After an
    /// error the stream is out of step for good: the caller stops reading.
    pub fn next_message(&mut self) -> Result<Option<Vec<u8>>, FrameError> {
        let body_len = match self.body_len {
            Some(len) => len,
            None => {
                let Some(end) = find(&self.buffered, b"\r\n\r\n") else {
                    if self.buffered.len() > MAX_HEADER_BYTES {
                        return Err(FrameError::HeaderTooLong);
                    }
                    return Ok(None);
                };
                if end > MAX_HEADER_BYTES {
                    return Err(FrameError::HeaderTooLong);
                }
                let len = content_length(&self.buffered[..end])?;
                self.buffered.drain(..end + 4);
                self.body_len = Some(len);
                len
            }
        };
        if self.buffered.len() < body_len {
            return Ok(None);
        }
        let rest = self.buffered.split_off(body_len);
        self.body_len = None;
        Ok(Some(std::mem::replace(&mut self.buffered, rest)))
    }
}

fn content_length(header: &[u8]) -> Result<usize, FrameError> {
    let header = String::from_utf8_lossy(header);
    let mut length = None;
    for line in header.split("\r\n") {
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| FrameError::MalformedHeader(line.to_owned()))?;
        if name.trim().eq_ignore_ascii_case("content-length") {
            let value = value.trim();
            let len: usize = value
                .parse()
                .map_err(|_| FrameError::BadContentLength(value.to_owned()))?;
            if len > MAX_MESSAGE_BYTES {
                return Err(FrameError::TooLarge(len));
            }
            length = Some(len);
        }
        // Content-Type is always UTF-8 JSON in practice; other headers are
        // not in the protocol and are skipped rather than refused.
    }
    length.ok_or(FrameError::NoContentLength)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    memchr::memmem::find(haystack, needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(decoder: &mut Decoder) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(body) = decoder.next_message().unwrap() {
            out.push(String::from_utf8(body).unwrap());
        }
        out
    }

    #[test]
    fn a_message_cut_at_every_byte_comes_out_whole() {
        let frame = encode(br#"{"jsonrpc":"2.0","id":1,"result":"h\u00e9"}"#);
        for cut in 0..=frame.len() {
            let mut decoder = Decoder::default();
            decoder.push(&frame[..cut]);
            let first = all(&mut decoder);
            decoder.push(&frame[cut..]);
            let second = all(&mut decoder);
            let got: Vec<_> = first.into_iter().chain(second).collect();
            assert_eq!(
                got,
                [r#"{"jsonrpc":"2.0","id":1,"result":"h\u00e9"}"#],
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn several_messages_in_one_read_come_out_in_order() {
        let mut bytes = encode(b"{\"a\":1}");
        bytes.extend(encode(b"[]"));
        bytes.extend_from_slice(
            b"Content-Type: application/vscode-jsonrpc; charset=utf-8\r\ncontent-length: 2\r\n\r\n{}",
        );
        bytes.extend_from_slice(b"Content-Length: 5\r\n\r\n{\"b\"");
        let mut decoder = Decoder::default();
        decoder.push(&bytes);
        assert_eq!(all(&mut decoder), ["{\"a\":1}", "[]", "{}"]);
        decoder.push(b"}");
        assert_eq!(all(&mut decoder), ["{\"b\"}"]);
    }

    #[test]
    fn an_empty_body_is_a_message() {
        let mut decoder = Decoder::default();
        decoder.push(b"Content-Length: 0\r\n\r\n");
        assert_eq!(decoder.next_message().unwrap(), Some(Vec::new()));
        assert_eq!(decoder.next_message().unwrap(), None);
    }

    #[test]
    fn bad_headers_are_errors() {
        for (bytes, error) in [
            (
                &b"Content-Length 3\r\n\r\n{}"[..],
                FrameError::MalformedHeader("Content-Length 3".into()),
            ),
            (b"Content-Type: x\r\n\r\n{}", FrameError::NoContentLength),
            (
                b"Content-Length: -1\r\n\r\n",
                FrameError::BadContentLength("-1".into()),
            ),
            (
                b"Content-Length: 99999999999\r\n\r\n",
                FrameError::TooLarge(99_999_999_999),
            ),
            (b"\r\n\r\n", FrameError::MalformedHeader(String::new())),
        ] {
            let mut decoder = Decoder::default();
            decoder.push(bytes);
            assert_eq!(
                decoder.next_message(),
                Err(error),
                "{:?}",
                String::from_utf8_lossy(bytes)
            );
        }
    }

    #[test]
    fn a_header_that_never_ends_is_refused_before_it_grows() {
        let mut decoder = Decoder::default();
        decoder.push(&vec![b'x'; MAX_HEADER_BYTES]);
        assert_eq!(decoder.next_message(), Ok(None));
        decoder.push(b"x");
        assert_eq!(decoder.next_message(), Err(FrameError::HeaderTooLong));
    }
}
