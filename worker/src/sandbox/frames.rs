//! Framing of the driver protocol: each frame is a 4-byte big-endian length followed by that
//! many bytes of UTF-8 JSON. The same framing runs both ways over the container's attached
//! stdin/stdout (see `sandbox/driver/driver.py` for the other side).
//!
//! The bytes come from inside the sandbox, so the decoder trusts nothing: a frame larger than
//! the bound, or one that is not JSON, is a protocol violation, never a panic or an unbounded
//! allocation.

use thiserror::Error;

/// The largest frame a worker accepts from a sandbox. The driver sends files in 1 MiB chunks
/// and caps every rich-output value at 4 MiB and every frame at 24 MiB, so no honest frame
/// comes near; a sandbox that announces more fails its job (`driver_protocol`) before the
/// worker buffers it. This, not the job's limits, bounds what one sandbox can make the worker
/// hold at once.
pub const MAX_FRAME_BYTES: usize = 32 << 20;

/// A framing violation by the sandbox.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FrameError {
    /// The length prefix announces more than the allowed maximum.
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Announced length.
        len: usize,
        /// The bound.
        max: usize,
    },
    /// The payload is not a JSON object of the protocol.
    #[error("frame is not valid protocol JSON: {0}")]
    Invalid(String),
}

/// Encode one frame.
pub fn encode(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 4);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// Incremental decoder: feed it chunks as they arrive, take out complete frames.
#[derive(Debug)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    max_frame: usize,
}

impl FrameDecoder {
    /// A decoder refusing frames above `max_frame` bytes.
    pub fn new(max_frame: usize) -> Self {
        FrameDecoder { buf: Vec::new(), max_frame }
    }

    /// Append received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Take the next complete frame's payload, if one is buffered.
    pub fn next_frame(&mut self) -> Result<Option<Vec<u8>>, FrameError> {
        if self.buf.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_be_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize;
        if len > self.max_frame {
            return Err(FrameError::TooLarge { len, max: self.max_frame });
        }
        if self.buf.len() < 4 + len {
            return Ok(None);
        }
        let payload = self.buf[4..4 + len].to_vec();
        self.buf.drain(..4 + len);
        Ok(Some(payload))
    }

    /// Bytes received but not yet part of a complete frame.
    #[cfg(test)]
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_split_across_chunks_are_reassembled() {
        let mut wire = encode(br#"{"type":"ready"}"#);
        wire.extend(encode(br#"{"type":"done"}"#));
        let mut d = FrameDecoder::new(1024);
        let mut got = Vec::new();
        for chunk in wire.chunks(3) {
            d.push(chunk);
            while let Some(f) = d.next_frame().unwrap() {
                got.push(String::from_utf8(f).unwrap());
            }
        }
        assert_eq!(got, vec![r#"{"type":"ready"}"#, r#"{"type":"done"}"#]);
        assert_eq!(d.pending(), 0);
    }

    #[test]
    fn an_oversize_length_prefix_is_refused_before_buffering() {
        let mut d = FrameDecoder::new(10);
        d.push(&[0xff, 0xff, 0xff, 0xff, b'x']);
        assert_eq!(d.next_frame(), Err(FrameError::TooLarge { len: u32::MAX as usize, max: 10 }));
    }

    #[test]
    fn an_incomplete_frame_waits() {
        let mut d = FrameDecoder::new(100);
        d.push(&encode(b"{}")[..4]);
        assert_eq!(d.next_frame(), Ok(None));
    }
}
