//! How a GPU pool arranges the bits of each token's code record, where that differs from the
//! codec's layout (code `d` at bits `d·b ..` of the record, LSB first).
//!
//! The decode attention unpacks codes into f16 pairs with byte permutes (`prmt`) whose
//! selectors are nibbles: one 3-bit index per nibble, bit 3 clear. In the codec's packing a
//! selector costs several shifts and masks per 4 codes (most of a 3-bit kernel's
//! instructions); in the layouts here it is one mask per 8 codes. Each kernel lane reads one
//! *run* of a record (`run` consecutive codes: `head_dim / 4` for keys, `head_dim / 8` for
//! values), so a layout permutes bits only within a run and a run stays `run · bits / 8`
//! bytes: the pool holds exactly the codec's bytes per token, rearranged. Block I/O
//! (`read_kv_block` / `write_kv_block`) converts records both ways, so blocks (and
//! snapshots) still move between the backends in the codec's layout.

/// The arrangement of one role's code records in a GPU pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RecordLayout {
    /// The codec's own packing (int8, 2-bit codes, 3-bit runs shorter than 16).
    Codec,
    /// 3-bit codes in runs of `run` (a multiple of 16) codes. A run is `3·run/16` 16-bit
    /// halfwords; for `U = run / 16` units, code `16u + t` lives in halfword `U·j + u`:
    /// for `t < 12`, `j = t / 4` and its 3 bits fill nibble `t % 4` (bits 0-2); the codes
    /// `t = 12 + i` are spread over the spare bit 3 of nibble `i` of the unit's three
    /// halfwords (bit `j` of the code in halfword `U·j + u`). So `halfword & 0x7777` is the
    /// selector of 4 codes, and the spare codes' one is three shifts and masks.
    Nibbles3 { run: usize },
    /// 4-bit codes in the codec's nibbles, re-indexed as sign and magnitude: the complement
    /// of a nibble is `8·neg | m` for the centroid `(-1)^neg · c[8 + m]` (the Lloyd–Max
    /// codebook is symmetric), so 8-entry magnitude tables serve all 16 codes and the sign is
    /// one bit flip. Stored values are the codes 0-7 as they are and 8-15 reversed
    /// (`s = 23 - c`), so a zeroed record is still all code 0.
    SignMagnitude4,
}

impl RecordLayout {
    /// The layout of a role with `bits`-bit codes read in runs of `run` codes.
    pub(crate) fn for_role(bits: u8, run: usize) -> RecordLayout {
        match bits {
            3 if run.is_multiple_of(16) => RecordLayout::Nibbles3 { run },
            4 => RecordLayout::SignMagnitude4,
            _ => RecordLayout::Codec,
        }
    }

    /// The descriptor word the encoder reads (write_kv.cu `encode_vector`): 0 codec,
    /// `1 | run << 8` for [`RecordLayout::Nibbles3`], 2 sign-magnitude.
    pub(crate) fn descriptor_word(self) -> u32 {
        match self {
            RecordLayout::Codec => 0,
            RecordLayout::Nibbles3 { run } => 1 | (run as u32) << 8,
            RecordLayout::SignMagnitude4 => 2,
        }
    }

    /// The record bit that holds bit `bit` of code `code` (`bits`-bit codes).
    fn position(self, bits: usize, code: usize, bit: usize) -> usize {
        match self {
            RecordLayout::Codec | RecordLayout::SignMagnitude4 => code * bits + bit,
            RecordLayout::Nibbles3 { run } => {
                let units = run / 16;
                let (r, s) = (code / run, code % run);
                let (u, t) = (s / 16, s % 16);
                let (halfword, at) = if t < 12 {
                    (units * (t / 4) + u, 4 * (t % 4) + bit)
                } else {
                    (units * bit + u, 4 * (t - 12) + 3)
                };
                3 * run * r + 16 * halfword + at
            }
        }
    }

    /// The stored value of code `c` (the sign-magnitude re-indexing, its own inverse;
    /// identity otherwise).
    fn stored(self, c: u8) -> u8 {
        match self {
            RecordLayout::SignMagnitude4 if c >= 8 => 23 - c,
            _ => c,
        }
    }

    /// The code of stored value `s`.
    fn code(self, s: u8) -> u8 {
        self.stored(s)
    }

    /// Rewrites a record of `bits`-bit codes from the codec's layout into this one.
    pub(crate) fn to_device(self, bits: u8, record: &mut [u8]) {
        if self == RecordLayout::Codec {
            return;
        }
        let codes = unpack(record, bits, |c, b| c * usize::from(bits) + b);
        let codes: Vec<u8> = codes.into_iter().map(|c| self.stored(c)).collect();
        pack(&codes, bits, record, |c, b| {
            self.position(usize::from(bits), c, b)
        });
    }

    /// Rewrites a record of `bits`-bit codes from this layout into the codec's.
    pub(crate) fn to_codec(self, bits: u8, record: &mut [u8]) {
        if self == RecordLayout::Codec {
            return;
        }
        let stored = unpack(record, bits, |c, b| self.position(usize::from(bits), c, b));
        let codes: Vec<u8> = stored.into_iter().map(|s| self.code(s)).collect();
        pack(&codes, bits, record, |c, b| c * usize::from(bits) + b);
    }
}

/// The record's codes, bit `b` of code `c` read from record bit `at(c, b)`.
fn unpack(record: &[u8], bits: u8, at: impl Fn(usize, usize) -> usize) -> Vec<u8> {
    let bits = usize::from(bits);
    (0..record.len() * 8 / bits)
        .map(|c| {
            (0..bits).fold(0u8, |v, b| {
                let p = at(c, b);
                v | ((record[p / 8] >> (p % 8)) & 1) << b
            })
        })
        .collect()
}

/// Writes `codes` into `record`, bit `b` of code `c` at record bit `at(c, b)`.
fn pack(codes: &[u8], bits: u8, record: &mut [u8], at: impl Fn(usize, usize) -> usize) {
    record.fill(0);
    for (c, &v) in codes.iter().enumerate() {
        for b in 0..usize::from(bits) {
            let p = at(c, b);
            record[p / 8] |= ((v >> b) & 1) << (p % 8);
        }
    }
}

#[cfg(test)]
mod tests {
    //! The layouts against a software model of the kernel's unpacking (attention.cu
    //! `Codes<B, R>::group`): `prmt` as PTX defines it, the same selector arithmetic, the same
    //! tables. A mismatch here is a kernel that reads the wrong codes.
    use super::*;
    use half::f16;
    use turbokv_codec::{DeviceFormat, LayerCodec};

    /// A small deterministic generator (splitmix64) for the random records.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: u8) -> u8 {
            (self.next() % u64::from(n)) as u8
        }
    }

    /// PTX `prmt.b32` (default mode): byte i of the result is byte `n & 7` of {b, a}, or the
    /// replicated sign bit of that byte when `n & 8`, for nibble n = (sel >> 4i) & 15.
    fn prmt(a: u32, b: u32, sel: u32) -> u32 {
        let src = u64::from(a) | u64::from(b) << 32;
        (0..4).fold(0u32, |r, i| {
            let n = (sel >> (4 * i)) & 15;
            let byte = ((src >> (8 * (n & 7))) & 0xff) as u32;
            let byte = if n & 8 != 0 {
                if byte & 0x80 != 0 { 0xff } else { 0 }
            } else {
                byte
            };
            r | byte << (8 * i)
        })
    }

    /// The 4 codes of a 16-bit selector as f16 bits (low byte table `lo`, high `hi`).
    fn lookup(sel: u32, lo: [u32; 2], hi: [u32; 2]) -> [u16; 4] {
        let l = prmt(lo[0], lo[1], sel);
        let h = prmt(hi[0], hi[1], sel);
        let (a, b) = (prmt(l, h, 0x5140), prmt(l, h, 0x7362));
        [a as u16, (a >> 16) as u16, b as u16, (b >> 16) as u16]
    }

    fn words(run: &[u8]) -> Vec<u32> {
        let mut w = vec![0u32; run.len().div_ceil(4)];
        for (i, &b) in run.iter().enumerate() {
            w[i / 4] |= u32::from(b) << (8 * (i % 4));
        }
        w
    }

    /// Codes<3, R>::group for group g of a run (R = 16, 32 or 64): the f16 of its 4 codes and
    /// which codes of the run they are (group g is halfword j = g / U of unit u = g % U).
    fn nibbles3_group(
        w: &[u32],
        r: usize,
        g: usize,
        lo: [u32; 2],
        hi: [u32; 2],
    ) -> ([u16; 4], usize) {
        let units = r / 16;
        let (j, u) = (g / units, g % units);
        let hw = |j: usize| (w[(units * j + u) / 2] >> (16 * ((units * j + u) % 2))) & 0xffff;
        let sel = if j < 3 {
            hw(j) & 0x7777
        } else {
            ((hw(0) >> 3) & 0x1111) | ((hw(1) >> 2) & 0x2222) | ((hw(2) >> 1) & 0x4444)
        };
        (lookup(sel, lo, hi), 16 * u + 4 * j)
    }

    /// Codes<4>::group for group g: sign-magnitude nibbles, magnitude tables, sign flip.
    fn signmag4_group(w: &[u32], g: usize, lo: [u32; 2], hi: [u32; 2]) -> [u16; 4] {
        let sel = (w[g >> 1] >> (16 * (g & 1))) & 0xffff;
        let mags = !sel & 0x7777;
        let l = prmt(lo[0], lo[1], mags);
        let pos = prmt(sel << 4, sel, 0xd9c8);
        let h = prmt(hi[0], hi[1], mags) ^ (!pos & 0x8080_8080);
        let (a, b) = (prmt(l, h, 0x5140), prmt(l, h, 0x7362));
        [a as u16, (a >> 16) as u16, b as u16, (b >> 16) as u16]
    }

    fn table(values: &[f32]) -> ([u32; 2], [u32; 2]) {
        let (mut lo, mut hi) = ([0u32; 2], [0u32; 2]);
        for (j, v) in values.iter().enumerate() {
            let bits = f16::from_f32(*v).to_bits();
            lo[j / 4] |= u32::from(bits & 0xff) << (8 * (j % 4));
            hi[j / 4] |= u32::from(bits >> 8) << (8 * (j % 4));
        }
        (lo, hi)
    }

    fn centroids(bits: u8) -> Vec<f32> {
        let dtype = format!("tq{bits}").parse().unwrap();
        let codec = LayerCodec::new(dtype, 128, 0, &Default::default()).unwrap();
        match codec.key.device_format() {
            Some(DeviceFormat::HadamardMse(h)) => h.centroids,
            _ => panic!("tq{bits} keys have a device format"),
        }
    }

    fn random_record(rng: &mut Rng, bytes: usize) -> Vec<u8> {
        (0..bytes).map(|_| rng.next() as u8).collect()
    }

    #[test]
    fn zeroed_records_stay_zero() {
        // Unwritten slots of a fresh pool read back as code 0, as the CPU pool's do.
        for (bits, run) in [(3u8, 64usize), (3, 32), (3, 16), (4, 64), (4, 32), (4, 16)] {
            let layout = RecordLayout::for_role(bits, run);
            let mut rec = vec![0u8; 256 * usize::from(bits) / 8];
            layout.to_codec(bits, &mut rec);
            assert!(rec.iter().all(|&b| b == 0), "{layout:?}");
        }
    }

    #[test]
    fn layouts_round_trip_every_record() {
        let mut rng = Rng(7);
        for (bits, run) in [
            (3u8, 64usize),
            (3, 32),
            (3, 16),
            (3, 8),
            (4, 32),
            (4, 16),
            (2, 16),
        ] {
            let layout = RecordLayout::for_role(bits, run);
            for dims in [64usize, 128, 256] {
                for _ in 0..50 {
                    let codec = random_record(&mut rng, dims * usize::from(bits) / 8);
                    let mut rec = codec.clone();
                    layout.to_device(bits, &mut rec);
                    layout.to_codec(bits, &mut rec);
                    assert_eq!(rec, codec, "{layout:?} {bits}-bit, {dims} dims");
                }
            }
        }
        assert_eq!(RecordLayout::for_role(3, 8), RecordLayout::Codec);
        assert_eq!(RecordLayout::for_role(8, 32), RecordLayout::Codec);
    }

    #[test]
    fn the_kernels_unpacking_reads_the_codecs_codes() {
        let mut rng = Rng(11);
        let c3 = centroids(3);
        let (lo3, hi3) = table(&c3);
        for run in [16usize, 32, 64] {
            let layout = RecordLayout::for_role(3, run);
            for _ in 0..200 {
                let codes: Vec<u8> = (0..run).map(|_| rng.below(8)).collect();
                let mut rec = vec![0u8; run * 3 / 8];
                pack(&codes, 3, &mut rec, |c, b| c * 3 + b);
                layout.to_device(3, &mut rec);
                let w = words(&rec);
                for g in 0..run / 4 {
                    let (got, first) = nibbles3_group(&w, run, g, lo3, hi3);
                    for (slot, bits) in got.iter().enumerate() {
                        let want = f16::from_f32(c3[usize::from(codes[first + slot])]).to_bits();
                        assert_eq!(*bits, want, "run {run}, group {g}, slot {slot}");
                    }
                }
            }
        }
        let c4 = centroids(4);
        let (lo4, hi4) = table(&c4[8..]);
        for _ in 0..200 {
            let codes: Vec<u8> = (0..32).map(|_| rng.below(16)).collect();
            let mut rec = vec![0u8; 16];
            pack(&codes, 4, &mut rec, |c, b| c * 4 + b);
            RecordLayout::SignMagnitude4.to_device(4, &mut rec);
            let w = words(&rec);
            for g in 0..8 {
                for (slot, bits) in signmag4_group(&w, g, lo4, hi4).iter().enumerate() {
                    let want = f16::from_f32(c4[usize::from(codes[4 * g + slot])]).to_bits();
                    assert_eq!(*bits, want, "group {g}, slot {slot}");
                }
            }
        }
    }

    #[test]
    fn four_bit_codebooks_are_symmetric_in_f16() {
        // SignMagnitude4 decodes c[7 - m] as -c[8 + m]; exact only if the f16 tables agree.
        for dims in [64usize, 128, 256] {
            let codec =
                LayerCodec::new("tq4".parse().unwrap(), dims, 0, &Default::default()).unwrap();
            let Some(DeviceFormat::HadamardMse(h)) = codec.key.device_format() else {
                panic!("tq4 has a device format");
            };
            for m in 0..8 {
                assert_eq!(
                    f16::from_f32(h.centroids[7 - m]).to_bits(),
                    f16::from_f32(-h.centroids[8 + m]).to_bits(),
                    "magnitude {m}, {dims} dims"
                );
            }
        }
    }
}
