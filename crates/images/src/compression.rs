//! Layer compression: gzip, zstd or none, told apart by the stream's first bytes.
//!
//! The magic bytes decide, not the media type: docker-save tarballs call every
//! layer a plain tar, and some registries mislabel zstd layers. The media type
//! only decides whether a blob is a filesystem layer at all (see `media.rs`).

use std::io::{self, BufRead, Read};

use ruzstd::decoding::errors::{FrameDecoderError, ReadFrameHeaderError};
use ruzstd::decoding::{BlockDecodingStrategy, FrameDecoder};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    pub(crate) fn detect(head: &[u8]) -> Compression {
        if head.starts_with(&[0x1f, 0x8b]) {
            Compression::Gzip
        } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd])
            // A skippable frame (magic 0x184D2A50..5F) can open a zstd stream.
            || (head.len() >= 4 && head[0] & 0xf0 == 0x50 && head[1..4] == [0x2a, 0x4d, 0x18])
        {
            Compression::Zstd
        } else {
            Compression::None
        }
    }
}

/// Wraps a buffered compressed stream in the matching decoder.
pub(crate) fn decoder<'a, R: BufRead + 'a>(mut source: R) -> io::Result<Box<dyn Read + 'a>> {
    let compression = Compression::detect(source.fill_buf()?);
    Ok(match compression {
        // Multi-member: some tools (pigz, concatenating writers) emit several
        // gzip members for one layer.
        Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(source)),
        Compression::Zstd => Box::new(ZstdFrames::new(source)),
        Compression::None => Box::new(source),
    })
}

/// A zstd reader that decodes every frame in the stream and skips skippable
/// frames (zstd:chunked layers are many frames plus a skippable table of
/// contents; ruzstd's `StreamingDecoder` stops after the first frame).
struct ZstdFrames<R> {
    source: R,
    decoder: FrameDecoder,
    in_frame: bool,
}

impl<R: BufRead> ZstdFrames<R> {
    fn new(source: R) -> Self {
        ZstdFrames {
            source,
            decoder: FrameDecoder::new(),
            in_frame: false,
        }
    }

    /// Starts the next frame; `false` at the end of the stream.
    fn next_frame(&mut self) -> io::Result<bool> {
        loop {
            if self.source.fill_buf()?.is_empty() {
                return Ok(false);
            }
            match self.decoder.reset(&mut self.source) {
                Ok(()) => return Ok(true),
                Err(FrameDecoderError::ReadFrameHeaderError(ReadFrameHeaderError::SkipFrame {
                    length,
                    ..
                })) => {
                    let skipped =
                        io::copy(&mut (&mut self.source).take(length.into()), &mut io::sink())?;
                    if skipped != u64::from(length) {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "zstd skippable frame is truncated",
                        ));
                    }
                }
                Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e)),
            }
        }
    }
}

impl<R: BufRead> Read for ZstdFrames<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            if !self.in_frame {
                if !self.next_frame()? {
                    return Ok(0);
                }
                self.in_frame = true;
            }
            while self.decoder.can_collect() == 0 && !self.decoder.is_finished() {
                self.decoder
                    .decode_blocks(&mut self.source, BlockDecodingStrategy::UptoBlocks(1))
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            }
            let n = self.decoder.read(buf)?;
            if n > 0 {
                return Ok(n);
            }
            if self.decoder.is_finished() {
                self.in_frame = false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn decode(data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        decoder(io::BufReader::new(data))
            .unwrap()
            .read_to_end(&mut out)
            .unwrap();
        out
    }

    #[test]
    fn plain_data_passes_through() {
        assert_eq!(decode(b"plain tar bytes"), b"plain tar bytes");
    }

    #[test]
    fn gzip_with_two_members() {
        let mut data = Vec::new();
        for part in [&b"first "[..], b"second"] {
            let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            enc.write_all(part).unwrap();
            data.extend(enc.finish().unwrap());
        }
        assert_eq!(decode(&data), b"first second");
    }

    #[test]
    fn zstd_with_two_frames_and_a_skippable_frame() {
        let level = ruzstd::encoding::CompressionLevel::Fastest;
        let mut data = ruzstd::encoding::compress_to_vec(&b"first "[..], level);
        // A skippable frame: magic 0x184D2A50, little-endian length, payload.
        data.extend([0x50, 0x2a, 0x4d, 0x18, 3, 0, 0, 0, 1, 2, 3]);
        data.extend(ruzstd::encoding::compress_to_vec(&b"second"[..], level));
        assert_eq!(decode(&data), b"first second");
    }
}
