//! `turbokv serve`: load the model, start the engine loop on this thread and the HTTP server
//! on another; stop both on Ctrl-C or SIGTERM (persisting the prefix cache).

use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use turbokv_cache::{DirStore, KvLayout};
use turbokv_engine::snapshots::Snapshots;
use turbokv_engine::{
    AdmissionOptions, DecodeBatching, DecodeBuckets, Engine, EngineOptions, LogitsTransfer,
};
use turbokv_server::ServerOptions;

use crate::args::{LogitsArg, ServeArgs};
use crate::bench_decode::BenchBackend;
use crate::generate::{load, prepare};
use crate::random_model::random_model;

/// `turbokv serve`.
pub fn run(args: &ServeArgs) -> Result<()> {
    with_device!(&args.model.device, b => run_on(b, args))
}

/// Parses `512MiB`, `2GiB`, `1.5G`, `800M`, `4096` (bytes).
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .with_context(|| format!("size `{text}`: expected a number and a unit, e.g. 512MiB"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" | "kib" => 1024.0,
        "m" | "mb" | "mib" => 1024.0 * 1024.0,
        "g" | "gb" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tb" | "tib" => 1024f64.powi(4),
        other => bail!("size `{text}`: unknown unit `{other}` (use B, KiB, MiB, GiB)"),
    };
    Ok((n * mult) as u64)
}

/// `--decode-buckets`: `auto` pads decode steps to the default ladder for `max_num_seqs`
/// where they replay as graphs (`replays_steps`) and not at all elsewhere (on the CPU a
/// placeholder row costs as much as a real one).
fn decode_batching(spec: &str, max_num_seqs: usize, replays_steps: bool) -> Result<DecodeBatching> {
    if spec.trim() == "auto" {
        return Ok(if replays_steps {
            DecodeBatching::Buckets(DecodeBuckets::for_max_seqs(max_num_seqs))
        } else {
            DecodeBatching::Exact
        });
    }
    spec.parse()
        .map_err(|e| anyhow::anyhow!("--decode-buckets: {e}"))
}

/// A fingerprint of the model's weights: sizes and the first and last MiB of each file.
fn fingerprint(path: &Path) -> Result<[u8; 32]> {
    let mut h = blake3::Hasher::new();
    let mut files = if path.is_dir() {
        let mut v: Vec<_> = std::fs::read_dir(path)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file())
            .collect();
        v.sort();
        v
    } else {
        vec![path.to_path_buf()]
    };
    files.retain(|p| {
        !p.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with('.'))
    });
    for f in files {
        let mut file =
            std::fs::File::open(&f).with_context(|| format!("reading {}", f.display()))?;
        let len = file.metadata()?.len();
        h.update(&len.to_le_bytes());
        let mut buf = vec![0u8; 1 << 20];
        let n = file.read(&mut buf)?;
        h.update(&buf[..n]);
        if len > 2 << 20 {
            use std::io::Seek;
            file.seek(std::io::SeekFrom::End(-(1 << 20)))?;
            let n = file.read(&mut buf)?;
            h.update(&buf[..n]);
        }
    }
    Ok(*h.finalize().as_bytes())
}

fn run_on<B: BenchBackend + 'static>(backend: B, args: &ServeArgs) -> Result<()> {
    let (loaded, name, model_fingerprint) = match &args.random_shape {
        Some(shape) => {
            let (model, tokenizer) = random_model(backend, shape)?;
            let loaded = prepare(model, tokenizer, &args.cache)?;
            let name = args
                .served_model_name
                .clone()
                .unwrap_or_else(|| loaded.model.name.clone());
            // The weights are a function of the shape (fixed seeds).
            let fp = *blake3::hash(format!("turbokv random weights {shape}").as_bytes()).as_bytes();
            (loaded, name, fp)
        }
        None => {
            let path = args.model.model_path()?;
            let loaded = load(backend, &args.model, &args.cache)?;
            let name = args.served_model_name.clone().unwrap_or_else(|| {
                path.file_stem().map_or_else(
                    || loaded.model.name.clone(),
                    |s| s.to_string_lossy().into_owned(),
                )
            });
            (loaded, name, fingerprint(&path)?)
        }
    };
    let config = loaded.model.transformer.config().clone();
    let mut probe = KvLayout::uniform(
        config.kv_layers(),
        config.n_kv_heads,
        config.head_dim,
        loaded.kv,
        16,
        16,
    )?;
    loaded.policy.apply(&mut probe)?;
    let per_token = probe.bytes_per_token_all_layers();
    let kv_bytes = parse_size(&args.kv_memory).context("--kv-memory")?;
    let kv_tokens = (kv_bytes as f64 / per_token) as usize;
    if kv_tokens < 16 {
        bail!(
            "--kv-memory {} holds {kv_tokens} tokens at {per_token:.0} B/token; give more",
            args.kv_memory
        );
    }
    let replays_steps = loaded
        .model
        .transformer
        .backend()
        .step_graph_stats()
        .is_some()
        && crate::env_options::from_env()?.step_graphs;
    let opts = EngineOptions {
        max_num_seqs: args.max_num_seqs,
        max_batched_tokens: args.max_batched_tokens,
        max_model_len: loaded.ctx,
        kv_tokens,
        block_size: 16,
        prefix_caching: !args.no_prefix_cache,
        model_fingerprint,
        admission: AdmissionOptions {
            reserve: args.growth_reserve,
            watermark: args.kv_watermark,
        },
        decode_batching: decode_batching(&args.decode_buckets, args.max_num_seqs, replays_steps)?,
        logits: match args.logits {
            LogitsArg::Candidates => LogitsTransfer::Candidates,
            LogitsArg::Full => LogitsTransfer::FullRows,
        },
    };
    let describe = loaded.model.transformer.backend().describe();
    let tokenizer = Arc::new(loaded.tokenizer);
    let (mut engine, handle) = Engine::new(
        loaded.model.transformer,
        tokenizer,
        loaded.kv,
        &loaded.policy,
        opts,
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    if let Some(dir) = &args.prefix_cache_dir {
        let bound = parse_size(&args.prefix_cache_disk).context("--prefix-cache-disk")?;
        let store = DirStore::open(dir, bound)
            .with_context(|| format!("opening --prefix-cache-dir {}", dir.display()))?;
        tracing::info!(blobs = turbokv_cache::SnapshotStore::len(&store), dir = %dir.display(), "prefix snapshots indexed");
        engine.set_snapshots(Snapshots::new(Box::new(store)));
    }
    let listener = std::net::TcpListener::bind((args.host.as_str(), args.port))
        .with_context(|| format!("listening on {}:{}", args.host, args.port))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let info = handle.info().clone();
    // The engine may have turned prefix caching off (its warning says why: a windowed
    // compressed cache, ring layers, conv layers): say which is in force.
    let prefix = if info.prefix_caching { "on" } else { "off" };
    let buckets = match info.decode_buckets.as_slice() {
        [] => "none".to_string(),
        b => b.iter().map(usize::to_string).collect::<Vec<_>>().join(","),
    };
    eprintln!(
        "turbokv: serving {name} on http://{addr}/v1 ({describe}; KV {} for {} tokens, up to {} sequences, prefix cache {prefix}, decode buckets {buckets})",
        loaded.kv_label, info.kv_tokens, info.max_num_seqs
    );
    let server_opts = ServerOptions {
        model_name: name,
        api_key: args.api_key.clone(),
        ..ServerOptions::default()
    };
    let server_handle = handle.clone();
    let server = std::thread::Builder::new()
        .name("http".into())
        .spawn(move || -> Result<()> {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener)?;
                turbokv_server::serve(
                    listener,
                    server_handle,
                    server_opts,
                    turbokv_server::shutdown_signal(),
                )
                .await
            })?;
            Ok(())
        })?;
    drop(handle);
    // The step loop runs here, on a worker of the rayon pool (see main).
    engine.run();
    match server.join() {
        Ok(r) => r,
        Err(_) => bail!("the HTTP server thread panicked"),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn decode_buckets_auto_pads_only_where_steps_replay() {
        use super::decode_batching;
        use turbokv_engine::{DecodeBatching, DecodeBuckets};
        assert_eq!(
            decode_batching("auto", 64, true).unwrap(),
            DecodeBatching::Buckets(DecodeBuckets::for_max_seqs(64))
        );
        assert_eq!(
            decode_batching("auto", 64, false).unwrap(),
            DecodeBatching::Exact
        );
        assert_eq!(
            decode_batching("none", 64, true).unwrap(),
            DecodeBatching::Exact
        );
        assert_eq!(
            decode_batching("8,1", 64, false).unwrap(),
            DecodeBatching::Buckets(DecodeBuckets::new(vec![1, 8]).unwrap())
        );
        assert!(decode_batching("1,two", 64, true).is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("GiB").is_err());
    }
}
