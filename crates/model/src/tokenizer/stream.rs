//! Incremental decoding that never splits a UTF-8 sequence across emitted pieces.

use super::Tokenizer;

/// Turns generated tokens into text pieces as they arrive.
///
/// A token may end in the middle of a multi-byte character (byte-level BPE and
/// SentencePiece byte tokens split emoji and CJK across tokens); those bytes are held back
/// until the character is complete, so every emitted piece is valid UTF-8 and the
/// concatenation of all pieces plus [`finish`](Self::finish) equals
/// [`Tokenizer::decode`] of the whole sequence (except that a stream keeps the leading
/// space SentencePiece's decode strips: generated text continues a prompt).
///
/// The stream owns no tokenizer reference, so it can live in a per-request struct; it
/// allocates only while its buffers grow.
#[derive(Clone, Debug, Default)]
pub struct DecodeStream {
    skip_special: bool,
    /// Bytes not yet emitted: at most the start of one incomplete UTF-8 sequence between
    /// calls.
    pending: Vec<u8>,
    /// The piece returned by the last call.
    out: String,
}

impl DecodeStream {
    /// A new stream; `skip_special` leaves out control and unknown tokens.
    pub fn new(skip_special: bool) -> Self {
        Self {
            skip_special,
            pending: Vec::with_capacity(16),
            out: String::with_capacity(64),
        }
    }

    /// Adds one token; returns the text that became complete, if any.
    pub fn step(&mut self, tokenizer: &Tokenizer, id: u32) -> Option<&str> {
        tokenizer
            .pieces()
            .push_piece(id, self.skip_special, &mut self.pending);
        self.drain(false)
    }

    /// Ends the stream: returns the held-back bytes, if any, as U+FFFD replacement text.
    pub fn finish(&mut self) -> Option<&str> {
        self.drain(true)
    }

    /// Whether bytes of an incomplete character are held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Moves the longest valid UTF-8 prefix of `pending` to `out`; invalid bytes become
    /// U+FFFD; an incomplete tail stays unless `flush`.
    fn drain(&mut self, flush: bool) -> Option<&str> {
        self.out.clear();
        let mut start = 0;
        while start < self.pending.len() {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    self.out.push_str(s);
                    start = self.pending.len();
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // `valid_up_to` bytes were just checked to be UTF-8.
                    if let Ok(s) = std::str::from_utf8(&self.pending[start..start + valid]) {
                        self.out.push_str(s);
                    }
                    start += valid;
                    match e.error_len() {
                        Some(bad) => {
                            self.out.push('\u{FFFD}');
                            start += bad;
                        }
                        None if flush => {
                            self.out.push('\u{FFFD}');
                            start = self.pending.len();
                        }
                        None => break,
                    }
                }
            }
        }
        self.pending.drain(..start);
        (!self.out.is_empty()).then_some(self.out.as_str())
    }
}
