//! Writes a copy of a GGUF model with its weight matrices in f16, bf16 or f32 (e.g. an f16
//! demo model, to measure the float-weight CPU kernels on a real shape):
//! `cargo run --release -p turbokv-model --example reencode_gguf -- IN.gguf OUT.gguf f16`.
use turbokv_model::gguf::GgufFile;
use turbokv_model::gguf::reencode::{FloatFormat, reencode_matrices};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, output, format] = args.as_slice() else {
        return Err("usage: reencode_gguf IN.gguf OUT.gguf f16|bf16|f32".into());
    };
    let format: FloatFormat = format.parse()?;
    let file = GgufFile::open(std::path::Path::new(input))?;
    let bytes = reencode_matrices(&file, format)?.to_bytes();
    let tmp = format!("{output}.tmp");
    std::fs::write(&tmp, &bytes)?;
    std::fs::rename(&tmp, output)?;
    eprintln!("wrote {output} ({} MB)", bytes.len() >> 20);
    Ok(())
}
