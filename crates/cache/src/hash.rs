//! Content hashes of full KV blocks, stable across builds and platforms.
//!
//! A block's hash chains its parent's hash, its token ids and the cache identity, so equal
//! hashes mean equal KV bytes: the same tokens at the same positions, under the same model and
//! the same storage format. The hash names snapshot files on disk, hence BLAKE3 over an
//! explicit little-endian encoding rather than `std`'s per-build hasher.

use std::fmt;

use crate::KvLayout;

/// A 256-bit block or identity hash.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 32]);

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({})", &self.to_hex()[..16])
    }
}

impl BlockHash {
    /// Lower-case hex, 64 characters (snapshot file names).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses [`Self::to_hex`]'s output.
    pub fn from_hex(text: &str) -> Option<Self> {
        if text.len() != 64 || !text.is_ascii() {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(Self(out))
    }

    /// The hash of a full block: `parent` (the previous block's hash, `None` for the first
    /// block), its token ids and the cache identity.
    pub fn chain(parent: Option<&BlockHash>, tokens: &[u32], identity: &CacheIdentity) -> Self {
        let mut h = blake3::Hasher::new();
        h.update(b"turbokv block v1");
        h.update(&identity.0.0);
        match parent {
            Some(p) => {
                h.update(&[1]);
                h.update(&p.0);
            }
            None => {
                h.update(&[0]);
            }
        }
        h.update(&(tokens.len() as u64).to_le_bytes());
        for t in tokens {
            h.update(&t.to_le_bytes());
        }
        Self(*h.finalize().as_bytes())
    }
}

/// The hashes of the full blocks of `tokens` (block `i` covers tokens `i·block_size ..`), at
/// most `max_blocks` of them.
pub fn block_hashes(
    tokens: &[u32],
    block_size: usize,
    identity: &CacheIdentity,
    max_blocks: usize,
) -> Vec<BlockHash> {
    let mut out: Vec<BlockHash> = Vec::new();
    for chunk in tokens.chunks_exact(block_size.max(1)).take(max_blocks) {
        let h = BlockHash::chain(out.last(), chunk, identity);
        out.push(h);
    }
    out
}

/// What decides the meaning of a cache's bytes: the model (a fingerprint its loader
/// computes), the codec version, and per layer the dtype, outlier channels, rotation seeds,
/// key mode, window and centers. Two caches share blocks only when their identities are equal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CacheIdentity(pub BlockHash);

impl CacheIdentity {
    /// The identity of `layout` for the model whose fingerprint is `model`.
    pub fn new(model: &[u8; 32], layout: &KvLayout) -> Self {
        let mut h = blake3::Hasher::new();
        h.update(b"turbokv cache identity v1");
        h.update(model);
        h.update(&turbokv_codec::CODEC_VERSION.to_le_bytes());
        let c = &layout.codec;
        for v in [layout.kv_heads, layout.head_dim, layout.block_size] {
            h.update(&(v as u64).to_le_bytes());
        }
        h.update(&[c.key_mode as u8, c.norm.code(), c.qjl.code()]);
        h.update(&c.base_seed.to_le_bytes());
        for v in [layout.window.recent, layout.window.sinks] {
            h.update(&(v as u64).to_le_bytes());
        }
        // Only int8 copies add bytes, so the identities of f16-copy caches (and the snapshots
        // stored under them) stay what they were.
        if layout.window.copies == crate::WindowCopies::Int8 {
            h.update(b"copies:int8");
        }
        h.update(&(layout.layers.len() as u64).to_le_bytes());
        for l in 0..layout.layers.len() {
            let opts = layout.codec_options(l);
            let name = layout.layers[l].dtype.to_string();
            h.update(&(name.len() as u64).to_le_bytes());
            h.update(name.as_bytes());
            // Only layers with per-head dtypes add bytes, so other identities stay the same.
            for d in &layout.layers[l].head_dtypes {
                let name = format!("head:{d}");
                h.update(&(name.len() as u64).to_le_bytes());
                h.update(name.as_bytes());
            }
            for o in [&opts.key_outliers, &opts.value_outliers] {
                match o {
                    None => h.update(&u64::MAX.to_le_bytes()),
                    Some(o) => {
                        h.update(&(o.channels().len() as u64).to_le_bytes());
                        for ch in o.channels() {
                            h.update(&ch.to_le_bytes());
                        }
                        h.update(&(o.head_dim() as u64).to_le_bytes())
                    }
                };
            }
        }
        match &layout.centers {
            None => {
                h.update(&[0]);
            }
            Some(cs) => {
                h.update(&[1]);
                for v in cs.key.iter().chain(&cs.value) {
                    h.update(&v.to_bits().to_le_bytes());
                }
            }
        }
        Self(BlockHash(*h.finalize().as_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use turbokv_codec::KvDtype;

    fn layout(dtype: KvDtype) -> KvLayout {
        KvLayout::uniform(2, 1, 64, dtype, 16, 64).unwrap()
    }

    #[test]
    fn the_hash_is_a_fixed_value() {
        // A changed value renames every snapshot on disk: bump the "v1" tags on purpose only.
        let id = CacheIdentity::new(&[7; 32], &layout(KvDtype::Bf16));
        let h = BlockHash::chain(None, &[1, 2, 3], &id);
        let again = BlockHash::chain(None, &[1, 2, 3], &id);
        assert_eq!(h, again);
        assert_eq!(BlockHash::from_hex(&h.to_hex()), Some(h));
        assert_eq!(BlockHash::from_hex("zz"), None);
    }

    #[test]
    fn every_input_changes_the_hash() {
        let id = CacheIdentity::new(&[7; 32], &layout(KvDtype::Bf16));
        let tq = CacheIdentity::new(&[7; 32], &layout("tq3".parse().unwrap()));
        let other_model = CacheIdentity::new(&[8; 32], &layout(KvDtype::Bf16));
        assert_ne!(id, tq);
        assert_ne!(id, other_model);
        let mut windowed = layout("tq3".parse().unwrap());
        windowed.window.recent = 16;
        assert_ne!(tq, CacheIdentity::new(&[7; 32], &windowed));
        let mut int8_copies = windowed.clone();
        int8_copies.window.copies = crate::WindowCopies::Int8;
        assert_ne!(
            CacheIdentity::new(&[7; 32], &windowed),
            CacheIdentity::new(&[7; 32], &int8_copies)
        );
        let a = BlockHash::chain(None, &[1, 2], &id);
        assert_ne!(a, BlockHash::chain(None, &[1, 3], &id));
        assert_ne!(a, BlockHash::chain(None, &[1, 2], &tq));
        assert_ne!(a, BlockHash::chain(Some(&a), &[1, 2], &id));
    }

    #[test]
    fn block_hashes_chain_full_blocks_only() {
        let id = CacheIdentity::new(&[0; 32], &layout(KvDtype::Bf16));
        let toks: Vec<u32> = (0..40).collect();
        let hs = block_hashes(&toks, 16, &id, usize::MAX);
        assert_eq!(hs.len(), 2);
        assert_eq!(hs[0], BlockHash::chain(None, &toks[..16], &id));
        assert_eq!(hs[1], BlockHash::chain(Some(&hs[0]), &toks[16..32], &id));
        assert_eq!(block_hashes(&toks, 16, &id, 1).len(), 1);
    }
}
