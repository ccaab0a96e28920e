//! `Snapshot::decode` on arbitrary bytes: never panics, and whatever it accepts re-encodes to
//! the same bytes. Inputs are also tried with a fixed header and a recomputed checksum, so the
//! fuzzer reaches the field parser instead of stopping at the CRC.
#![no_main]

use libfuzzer_sys::fuzz_target;
use turbokv_codec::Snapshot;
use turbokv_codec::checksum::crc32;
use turbokv_codec::snapshot::{FORMAT_VERSION, MAGIC};

fn check(bytes: &[u8]) {
    if let Ok(s) = Snapshot::decode(bytes) {
        let again = s.encode().expect("a decoded snapshot re-encodes");
        assert_eq!(again, bytes, "decode/encode is not the identity");
    }
}

fuzz_target!(|data: &[u8]| {
    check(data);
    let mut framed = MAGIC.to_vec();
    framed.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    framed.extend_from_slice(data);
    let crc = crc32(&framed);
    framed.extend_from_slice(&crc.to_le_bytes());
    check(&framed);
});
