//! A bounds-checked little-endian cursor over the file bytes.

use super::GgufError;

/// Reads little-endian fields; every read checks the remaining length first.
pub(super) struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub(super) fn pos(&self) -> usize {
        self.pos
    }

    pub(super) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub(super) fn bytes(&mut self, n: usize) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                offset: self.pos,
                needed: n,
                len: self.buf.len(),
            });
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.bytes(N)?);
        Ok(out)
    }

    pub(super) fn u8(&mut self) -> Result<u8, GgufError> {
        Ok(self.array::<1>()?[0])
    }
    pub(super) fn u16(&mut self) -> Result<u16, GgufError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub(super) fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub(super) fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    pub(super) fn f32(&mut self) -> Result<f32, GgufError> {
        Ok(f32::from_le_bytes(self.array()?))
    }
    pub(super) fn f64(&mut self) -> Result<f64, GgufError> {
        Ok(f64::from_le_bytes(self.array()?))
    }

    /// A count of items each taking at least `min_item_bytes`; rejects counts the rest of the
    /// file could not hold, so a corrupt count never triggers a huge allocation.
    pub(super) fn count(&mut self, what: &str, min_item_bytes: usize) -> Result<usize, GgufError> {
        let at = self.pos;
        let n = self.u64()?;
        let fits = usize::try_from(n)
            .ok()
            .filter(|&n| n.saturating_mul(min_item_bytes.max(1)) <= self.remaining());
        fits.ok_or_else(|| GgufError::Corrupt {
            offset: at,
            what: format!(
                "{what} {n} exceeds what the remaining {} bytes can hold",
                self.remaining()
            ),
        })
    }

    /// A GGUF string: u64 length + UTF-8 bytes.
    pub(super) fn string(&mut self) -> Result<String, GgufError> {
        let at = self.pos;
        let n = self.count("string length", 1)?;
        let bytes = self.bytes(n)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::Corrupt {
            offset: at,
            what: "string is not UTF-8".into(),
        })
    }
}
