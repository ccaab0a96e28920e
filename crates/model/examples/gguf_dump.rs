//! Prints a GGUF file's metadata (arrays abbreviated) and tensor index.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).ok_or("usage: gguf_dump FILE")?;
    let f = turbokv_model::gguf::GgufFile::open(std::path::Path::new(&path))?;
    for (k, v) in f.metadata.iter() {
        match v.as_array() {
            Some(a) => println!(
                "{k} = [{} items] first: {:?}",
                a.len(),
                a.iter().take(5).collect::<Vec<_>>()
            ),
            None => {
                let s = format!("{v:?}");
                println!("{k} = {}", if s.len() > 300 { &s[..300] } else { &s });
            }
        }
    }
    for t in f.tensors() {
        println!(
            "{} {:?} {:?} off={} len={}",
            t.name, t.dims, t.ty, t.offset, t.len
        );
    }
    Ok(())
}
