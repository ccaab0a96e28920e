//! Token kinds and the decode table: the bytes each token contributes to decoded text.

/// What a vocabulary entry is, following GGUF's `tokenizer.ggml.token_type` numbering.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TokenKind {
    /// An ordinary text token (type 1).
    Normal,
    /// The unknown token, e.g. `<unk>` (type 2).
    Unknown,
    /// A control token such as `<|im_start|>` or `</s>` (type 3); hidden by
    /// `skip_special` and recognised in text only when special parsing is on.
    Control,
    /// A user-defined (added, non-special) token (type 4); always recognised in text.
    UserDefined,
    /// A reserved slot that never appears in text (type 5).
    Unused,
    /// A SentencePiece byte-fallback token `<0xAB>` (type 6).
    Byte,
}

impl TokenKind {
    /// The kind for a GGUF token-type number; unknown numbers count as normal.
    pub(crate) fn from_gguf(ty: i64) -> Self {
        match ty {
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Normal,
        }
    }

    /// Whether `decode(.., skip_special = true)` leaves this token out.
    pub fn is_special(self) -> bool {
        matches!(self, Self::Control | Self::Unknown | Self::Unused)
    }
}

/// How normal token strings map to bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TextEncoding {
    /// GPT-2 byte-level: each char stands for one byte (`Ġ` = space).
    ByteLevel,
    /// SentencePiece: `▁` stands for a space; `<0xAB>` byte tokens.
    SentencePiece,
    /// Token strings are the text itself.
    Plain,
}

/// GPT-2's byte ↔ char table: printable Latin-1 bytes stand for themselves, the other 68
/// bytes are shifted to U+0100.. in byte order.
pub(crate) fn byte_level_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut shifted = 0u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let printable = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            b as u32
        } else {
            shifted += 1;
            255 + shifted
        };
        *slot = char::from_u32(code).unwrap_or('\u{FFFD}');
    }
    table
}

/// The inverse of [`byte_level_chars`], indexed by char code (all codes are < 0x144).
fn byte_level_inverse() -> Vec<Option<u8>> {
    let mut inv = vec![None; 0x144];
    for (b, c) in byte_level_chars().iter().enumerate() {
        inv[*c as usize] = Some(b as u8);
    }
    inv
}

/// The byte a SentencePiece byte token `<0xAB>` stands for.
pub(crate) fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Decoded bytes of every token, packed: token `i` is `bytes[offsets[i]..offsets[i + 1]]`.
///
/// Invariant: `offsets.len() == kinds.len() + 1`, offsets non-decreasing, last == bytes.len().
#[derive(Clone, Debug)]
pub(crate) struct PieceTable {
    bytes: Vec<u8>,
    offsets: Vec<u32>,
    kinds: Vec<TokenKind>,
}

impl PieceTable {
    /// Builds the table from each token's vocabulary string and kind.
    ///
    /// Special and user-defined tokens decode to their text as written; normal tokens are
    /// mapped through `encoding`. `texts[i] == None` marks a hole in the id space (decodes
    /// to nothing).
    pub(crate) fn build<'a>(
        texts: impl Iterator<Item = (Option<&'a str>, TokenKind)>,
        encoding: TextEncoding,
    ) -> Self {
        let inverse = byte_level_inverse();
        let mut table = Self {
            bytes: Vec::new(),
            offsets: vec![0],
            kinds: Vec::new(),
        };
        for (text, kind) in texts {
            let text = text.unwrap_or("");
            match (kind, encoding) {
                (TokenKind::Unused, _) => {}
                (TokenKind::Byte, _) => match parse_byte_token(text) {
                    Some(b) => table.bytes.push(b),
                    None => table.bytes.extend_from_slice(text.as_bytes()),
                },
                (TokenKind::Normal, TextEncoding::ByteLevel) => {
                    let start = table.bytes.len();
                    let mut all_mapped = true;
                    for c in text.chars() {
                        match inverse.get(c as usize).copied().flatten() {
                            Some(b) => table.bytes.push(b),
                            None => {
                                all_mapped = false;
                                break;
                            }
                        }
                    }
                    if !all_mapped {
                        // Like the HF decoder: a string outside the byte alphabet is literal.
                        table.bytes.truncate(start);
                        table.bytes.extend_from_slice(text.as_bytes());
                    }
                }
                (TokenKind::Normal, TextEncoding::SentencePiece) => {
                    for part in text.split('▁').enumerate() {
                        if part.0 > 0 {
                            table.bytes.push(b' ');
                        }
                        table.bytes.extend_from_slice(part.1.as_bytes());
                    }
                }
                _ => table.bytes.extend_from_slice(text.as_bytes()),
            }
            table.kinds.push(kind);
            // Vocabularies are far below 4 GiB of text; saturate rather than wrap.
            table
                .offsets
                .push(u32::try_from(table.bytes.len()).unwrap_or(u32::MAX));
        }
        debug_assert_eq!(table.offsets.len(), table.kinds.len() + 1);
        table
    }

    /// Number of ids covered.
    pub(crate) fn len(&self) -> usize {
        self.kinds.len()
    }

    /// The decoded bytes of `id`, or `None` past the vocabulary.
    pub(crate) fn piece(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        let (start, end) = (*self.offsets.get(i)?, *self.offsets.get(i + 1)?);
        self.bytes.get(start as usize..end as usize)
    }

    /// The kind of `id`, or `None` past the vocabulary.
    pub(crate) fn kind(&self, id: u32) -> Option<TokenKind> {
        self.kinds.get(id as usize).copied()
    }

    /// Appends the bytes of `id` to `out` unless it is skipped; unknown ids add nothing.
    #[inline]
    pub(crate) fn push_piece(&self, id: u32, skip_special: bool, out: &mut Vec<u8>) {
        let Some(kind) = self.kind(id) else { return };
        if skip_special && kind.is_special() {
            return;
        }
        if let Some(p) = self.piece(id) {
            out.extend_from_slice(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_is_gpt2s() {
        let t = byte_level_chars();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[0], 'Ā');
        let mut seen: Vec<char> = t.to_vec();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 256);
    }

    #[test]
    fn pieces_decode_each_encoding() {
        let toks = [
            (Some("Ġhello"), TokenKind::Normal),
            (Some("<|im_end|>"), TokenKind::Control),
            (Some("<0x0A>"), TokenKind::Byte),
            (None, TokenKind::Unused),
        ];
        let t = PieceTable::build(toks.into_iter(), TextEncoding::ByteLevel);
        assert_eq!(t.piece(0), Some(&b" hello"[..]));
        assert_eq!(t.piece(1), Some(&b"<|im_end|>"[..]));
        assert_eq!(t.piece(2), Some(&b"\n"[..]));
        assert_eq!(t.piece(3), Some(&b""[..]));
        assert_eq!(t.piece(4), None);
        let spm = PieceTable::build(
            [(Some("▁a▁b"), TokenKind::Normal)].into_iter(),
            TextEncoding::SentencePiece,
        );
        assert_eq!(spm.piece(0), Some(&b" a b"[..]));
    }
}
