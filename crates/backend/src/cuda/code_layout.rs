//! How a GPU pool arranges the bits of its code records, where that differs from the codec's
//! layout (code `d` of a token at bits `d·b ..` of its record, LSB first).
//!
//! The decode attention (attention.cu `attn_imma_*`) turns codes into integer MMA fragment
//! bytes with byte permutes (`prmt`) whose selectors are nibbles: one 3-bit table index per
//! nibble, bit 3 clear, four codes per selector. The layouts here make a selector cost about
//! one mask, and put into one selector exactly the four codes an MMA fragment register holds.
//!
//! - **Keys** ([`RecordLayout`]) stay one record per token: a kernel lane reads one *run* of
//!   `head_dim / 4` consecutive codes of a key, four codes of one key per register, so a
//!   layout permutes bits only within a run and a run stays `run · bits / 8` bytes.
//! - **Values** ([`ValueUnits`]) are interleaved over each run of 16 tokens: the value MMAs
//!   reduce over keys, so a register holds one dim of four keys, and a *unit* of 32 codes
//!   (8 dims × 4 keys) is what one lane reads.
//!
//! The pool holds exactly the codec's bytes per token, rearranged. Block I/O
//! (`read_kv_block` / `write_kv_block`) converts both ways, so blocks (and snapshots) still
//! move between the backends in the codec's layout.

/// The arrangement of the key records in a GPU pool.
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

/// The value codes of a GPU pool, interleaved per run of 16 tokens (attention.cu
/// `ValueUnit`): in a run, lane `L = 4q + c` of dim group `G` (64 dims) owns one *unit* of 32
/// codes — dims `64G + q + 8j` (`j < 8`) × the tokens `2c, 2c+1, 8+2c, 9+2c` of the run (slot
/// `i` = 0..3 in that order) — and unit `32G + L` lies at byte `unit · 4·bits` of the run's
/// `16 · head_dim · bits / 8` bytes. Selector `j` (one fragment register: dim j's four tokens)
/// sits in the unit as:
/// - 8 bits: byte `4j + i` (the code's own byte);
/// - 4 bits: word `j / 2`, nibble `4(j % 2) + i`, the sign-magnitude values of
///   [`RecordLayout::SignMagnitude4`];
/// - 3 bits: for `j < 6` word `j / 2`, bits 0-2 of nibble `4(j % 2) + i`; for `j = 6, 7` bit
///   `k` of the code in bit 3 of nibble `4(j - 6) + i` of word `k` (the spare bits);
/// - 2 bits: word `j / 4`, bits `2·((j % 4) / 2)` .. of nibble `4(j % 2) + i`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ValueUnits {
    pub bits: u8,
    pub head_dim: usize,
}

impl ValueUnits {
    /// The descriptor word the encoder reads (write_kv.cu `encode_vector`).
    pub(crate) const DESCRIPTOR_WORD: u32 = 3;

    /// Bytes of one run of 16 tokens.
    fn run_bytes(self) -> usize {
        16 * self.head_dim * usize::from(self.bits) / 8
    }

    /// The bit of a run that holds bit `k` of the code of token `s` (< 16), dim `d`.
    pub(crate) fn bit(self, s: usize, d: usize, k: usize) -> usize {
        let bits = usize::from(self.bits);
        let (c, i) = ((s & 7) >> 1, (s & 1) | ((s >> 3) << 1));
        let (group, q, j) = (d / 64, d % 8, (d % 64) / 8);
        let unit = 32 * group + 4 * q + c;
        let within = match bits {
            8 => 8 * (4 * j + i) + k,
            4 => 32 * (j / 2) + 16 * (j % 2) + 4 * i + k,
            3 if j < 6 => 32 * (j / 2) + 16 * (j % 2) + 4 * i + k,
            3 => 32 * k + 4 * (4 * (j - 6) + i) + 3,
            _ => 32 * (j / 4) + 16 * (j % 2) + 4 * i + 2 * ((j % 4) / 2) + k,
        };
        unit * 32 * bits + within
    }

    /// Rewrites the code region of a block (whole runs of 16 codec records) into units.
    pub(crate) fn to_device(self, codes: &mut [u8]) {
        let sm = RecordLayout::SignMagnitude4;
        for run in codes.chunks_exact_mut(self.run_bytes()) {
            let values = self.unpack_records(run);
            run.fill(0);
            for (s, rec) in values.iter().enumerate() {
                for (d, &v) in rec.iter().enumerate() {
                    let v = if self.bits == 4 { sm.stored(v) } else { v };
                    for k in 0..usize::from(self.bits) {
                        let p = self.bit(s, d, k);
                        run[p / 8] |= ((v >> k) & 1) << (p % 8);
                    }
                }
            }
        }
    }

    /// Rewrites the code region of a block from units back into codec records.
    pub(crate) fn to_codec(self, codes: &mut [u8]) {
        let sm = RecordLayout::SignMagnitude4;
        let (bits, dims) = (usize::from(self.bits), self.head_dim);
        for run in codes.chunks_exact_mut(self.run_bytes()) {
            let mut values = vec![vec![0u8; dims]; 16];
            for (s, rec) in values.iter_mut().enumerate() {
                for (d, v) in rec.iter_mut().enumerate() {
                    let stored = (0..bits).fold(0u8, |a, k| {
                        let p = self.bit(s, d, k);
                        a | ((run[p / 8] >> (p % 8)) & 1) << k
                    });
                    *v = if bits == 4 { sm.code(stored) } else { stored };
                }
            }
            run.fill(0);
            for (s, rec) in values.iter().enumerate() {
                let at = s * dims * bits / 8;
                pack(
                    rec,
                    self.bits,
                    &mut run[at..at + dims * bits / 8],
                    |c, b| c * bits + b,
                );
            }
        }
    }

    /// The 16 codec records of a run, as codes.
    fn unpack_records(self, run: &[u8]) -> Vec<Vec<u8>> {
        let bits = usize::from(self.bits);
        run.chunks_exact(self.head_dim * bits / 8)
            .map(|rec| unpack(rec, self.bits, |c, b| c * bits + b))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    //! The layouts against a software model of the kernel's unpacking (attention.cu
    //! `Codes<B, R>::group`): `prmt` as PTX defines it, the same selector arithmetic, the same
    //! tables. A mismatch here is a kernel that reads the wrong codes.
    use super::*;
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

    fn words(run: &[u8]) -> Vec<u32> {
        let mut w = vec![0u32; run.len().div_ceil(4)];
        for (i, &b) in run.iter().enumerate() {
            w[i / 4] |= u32::from(b) << (8 * (i % 4));
        }
        w
    }

    fn format(bits: u8) -> DeviceFormat {
        let dtype = format!("tq{bits}").parse().unwrap();
        let codec = LayerCodec::new(dtype, 128, 0, &Default::default()).unwrap();
        codec.key.device_format().unwrap()
    }

    fn random_record(rng: &mut Rng, bytes: usize) -> Vec<u8> {
        (0..bytes).map(|_| rng.next() as u8).collect()
    }

    /// The 16-bit values of the four lo / hi byte pairs, as the key MMAs combine them.
    fn values16(lo: u32, hi: u32) -> [i32; 4] {
        std::array::from_fn(|j| {
            let l = (lo >> (8 * j)) & 0xff;
            let h = (hi >> (8 * j)) & 0xff;
            i32::from((l | h << 8) as u16 as i16)
        })
    }

    /// KeyCodes<B, R>::group (attention.cu) for group g of a run in the pool's layout: the
    /// lo and hi byte registers, and the run codes (dims) of its four slots.
    fn key_group(bits: u8, w: &[u32], r: usize, g: usize, t: &[u32; 4]) -> (u32, u32, [usize; 4]) {
        match bits {
            3 => {
                let units = r / 16;
                let sel = if units == 2 {
                    let j = g >> 1;
                    let s = if j < 3 {
                        w[j] & 0x7777_7777
                    } else {
                        ((w[0] >> 3) & 0x1111_1111)
                            | ((w[1] >> 2) & 0x2222_2222)
                            | ((w[2] >> 1) & 0x4444_4444)
                    };
                    if g & 1 == 1 { s >> 16 } else { s }
                } else {
                    match g {
                        0 => w[0] & 0x7777,
                        1 => (w[0] >> 16) & 0x7777,
                        2 => w[1] & 0x7777,
                        _ => {
                            ((w[0] >> 3) & 0x1111)
                                | ((w[0] >> 18) & 0x2222)
                                | ((w[1] >> 1) & 0x4444)
                        }
                    }
                };
                let dims = std::array::from_fn(|j| {
                    if units == 2 {
                        16 * (g & 1) + 4 * (g >> 1) + j
                    } else {
                        4 * g + j
                    }
                });
                (prmt(t[0], t[1], sel), prmt(t[2], t[3], sel), dims)
            }
            4 => {
                let x = w[g >> 1];
                let mags = if g & 1 == 1 {
                    (!x >> 16) & 0x7777
                } else {
                    !x & 0x7777
                };
                let pos = prmt(x << 4, x, if g & 1 == 1 { 0xfbea } else { 0xd9c8 });
                let lo = prmt(t[0], t[1], mags) ^ !pos;
                let hi = prmt(t[2], t[3], mags) ^ !pos;
                (lo, hi, std::array::from_fn(|j| 4 * g + j))
            }
            _ => {
                let sub = g & 3;
                let s = if sub & 1 == 1 {
                    (w[g >> 2] >> 2) & 0x3333_3333
                } else {
                    w[g >> 2] & 0x3333_3333
                };
                let sel = if sub >> 1 == 1 { s >> 16 } else { s };
                let dims =
                    std::array::from_fn(|j| 16 * (g >> 2) + 8 * ((g & 3) >> 1) + (g & 1) + 2 * j);
                (prmt(t[0], t[0], sel), prmt(t[2], t[2], sel), dims)
            }
        }
    }

    #[test]
    fn zeroed_records_stay_zero() {
        // Unwritten slots of a fresh pool read back as code 0, as the CPU pool's do.
        for (bits, run) in [(3u8, 32usize), (3, 16), (4, 32), (4, 16)] {
            let layout = RecordLayout::for_role(bits, run);
            let mut rec = vec![0u8; 128 * usize::from(bits) / 8];
            layout.to_codec(bits, &mut rec);
            assert!(rec.iter().all(|&b| b == 0), "{layout:?}");
        }
        for bits in [2u8, 3, 4, 8] {
            let mut run = vec![0u8; 16 * 128 * usize::from(bits) / 8];
            ValueUnits {
                bits,
                head_dim: 128,
            }
            .to_codec(&mut run);
            assert!(run.iter().all(|&b| b == 0), "{bits}-bit value units");
        }
    }

    #[test]
    fn layouts_round_trip_every_record() {
        let mut rng = Rng(7);
        for (bits, run) in [(3u8, 32usize), (3, 16), (3, 8), (4, 32), (4, 16), (2, 16)] {
            let layout = RecordLayout::for_role(bits, run);
            for dims in [64usize, 128] {
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
    fn value_units_round_trip_and_use_every_bit_once() {
        let mut rng = Rng(9);
        for bits in [2u8, 3, 4, 8] {
            for dims in [64usize, 128] {
                let units = ValueUnits {
                    bits,
                    head_dim: dims,
                };
                let b = usize::from(bits);
                let mut seen = vec![false; 16 * dims * b];
                for s in 0..16 {
                    for d in 0..dims {
                        for k in 0..b {
                            let p = units.bit(s, d, k);
                            assert!(!seen[p], "{bits}-bit, {dims} dims: bit {p} twice");
                            seen[p] = true;
                        }
                    }
                }
                for _ in 0..20 {
                    // Two runs (a block of 32 tokens).
                    let codec = random_record(&mut rng, 32 * dims * b / 8);
                    let mut block = codec.clone();
                    units.to_device(&mut block);
                    units.to_codec(&mut block);
                    assert_eq!(block, codec, "{bits}-bit, {dims} dims");
                }
            }
        }
    }

    #[test]
    fn the_key_unpacking_reads_the_codecs_codes() {
        let mut rng = Rng(11);
        for (bits, run) in [(3u8, 32usize), (3, 16), (4, 32), (4, 16), (2, 32), (2, 16)] {
            let f = format(bits);
            let DeviceFormat::HadamardMse(h) = &f else {
                panic!("tq has a device format");
            };
            let (t, kfac) = super::super::codes::key_tables(&f);
            let s = 256.0 / kfac;
            let layout = RecordLayout::for_role(bits, run);
            for _ in 0..100 {
                let n = 1usize << bits;
                let codes: Vec<u8> = (0..run).map(|_| rng.below(n as u8)).collect();
                let mut rec = vec![0u8; run * usize::from(bits) / 8];
                pack(&codes, bits, &mut rec, |c, b| c * usize::from(bits) + b);
                layout.to_device(bits, &mut rec);
                let w = words(&rec);
                for g in 0..run / 4 {
                    let (lo, hi, dims) = key_group(bits, &w, run, g, &t);
                    for (j, v) in values16(lo, hi).iter().enumerate() {
                        let c = h.centroids[usize::from(codes[dims[j]])];
                        let got = if bits == 4 {
                            *v as f32 + 0.5
                        } else {
                            *v as f32
                        };
                        assert!(
                            (got / s - c).abs() <= 0.51 / s,
                            "{bits}-bit run {run}, group {g}, slot {j}: {} vs {c}",
                            got / s
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_value_unpacking_reads_the_codecs_codes() {
        // ValueUnit<B>::decode (attention.cu) of every lane's unit: selector j's byte i is
        // (lo, hi) of the 16-bit value of dim 64G + q + 8j of token (2c, 2c+1, 8+2c, 9+2c)[i].
        let mut rng = Rng(13);
        for bits in [2u8, 3, 4, 8] {
            let (t, vfac) = match bits {
                8 => ([0; 8], 1.0 / 65535.0),
                b => super::super::codes::value_tables(&format(b)),
            };
            let centroids = match bits {
                8 => vec![],
                b => match format(b) {
                    DeviceFormat::HadamardMse(h) => h.centroids,
                    DeviceFormat::Int8 => unreachable!(),
                },
            };
            let s = 256.0 / (65535.0 * vfac);
            for dims in [64usize, 128] {
                let units = ValueUnits {
                    bits,
                    head_dim: dims,
                };
                let b = usize::from(bits);
                let codes: Vec<Vec<u8>> = (0..16)
                    .map(|_| {
                        (0..dims)
                            .map(|_| {
                                if b == 8 {
                                    rng.next() as u8
                                } else {
                                    rng.below(1 << b)
                                }
                            })
                            .collect()
                    })
                    .collect();
                let mut run = vec![0u8; 16 * dims * b / 8];
                for (tok, rec) in codes.iter().enumerate() {
                    let at = tok * dims * b / 8;
                    pack(rec, bits, &mut run[at..at + dims * b / 8], |c, k| c * b + k);
                }
                units.to_device(&mut run);
                for group in 0..dims / 64 {
                    for lane in 0..32usize {
                        let (q, c) = (lane / 4, lane % 4);
                        let unit = 32 * group + lane;
                        let w = words(&run[unit * 4 * b..(unit + 1) * 4 * b]);
                        let lookup = |sel: u32, t2: bool| {
                            let (a, h) = if t2 { (2, 3) } else { (0, 1) };
                            prmt(t[a], t[h], sel)
                        };
                        let pair = |sel: u32| (lookup(sel, false), lookup(sel, true));
                        let regs: [(u32, u32); 8] = match bits {
                            8 => std::array::from_fn(|j| (0, w[j])),
                            3 => {
                                let sp = ((w[0] >> 3) & 0x1111_1111)
                                    | ((w[1] >> 2) & 0x2222_2222)
                                    | ((w[2] >> 1) & 0x4444_4444);
                                std::array::from_fn(|j| {
                                    let s = if j < 6 { w[j / 2] & 0x7777_7777 } else { sp };
                                    pair(if j % 2 == 1 { s >> 16 } else { s })
                                })
                            }
                            2 => std::array::from_fn(|j| {
                                let x = w[j / 4];
                                let s = if (j % 4) / 2 == 1 {
                                    (x >> 2) & 0x3333_3333
                                } else {
                                    x & 0x3333_3333
                                };
                                let sel = if j % 2 == 1 { s >> 16 } else { s };
                                (prmt(t[0], t[0], sel), prmt(t[2], t[2], sel))
                            }),
                            _ => std::array::from_fn(|j| {
                                let x = w[j / 2];
                                let m = !x & 0x7777_7777;
                                let mags = if j % 2 == 1 { m >> 16 } else { m };
                                let pos = prmt(x << 4, x, if j % 2 == 1 { 0xfbea } else { 0xd9c8 });
                                let pick = |p: usize, n: usize| {
                                    (prmt(t[p], t[p + 1], mags) & pos)
                                        | (prmt(t[n], t[n + 1], mags) & !pos)
                                };
                                (pick(0, 4), pick(2, 6))
                            }),
                        };
                        for (j, (lo, hi)) in regs.iter().enumerate() {
                            for (i, tok) in [2 * c, 2 * c + 1, 8 + 2 * c, 9 + 2 * c]
                                .into_iter()
                                .enumerate()
                            {
                                let d = 64 * group + q + 8 * j;
                                let byte = |r: u32| i32::from((r >> (8 * i)) as u8 as i8);
                                let code = codes[tok][d];
                                if bits == 8 {
                                    assert_eq!(byte(*hi), i32::from(code as i8));
                                } else {
                                    let got = (256 * byte(*hi) + byte(*lo)) as f32;
                                    let want = centroids[usize::from(code)];
                                    assert!(
                                        (got / s - want).abs() <= 0.51 / s,
                                        "{bits}-bit {dims} dims lane {lane} j {j} i {i}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
