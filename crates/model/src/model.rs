//! Opening a model path: detect the format, read the config, load weights with progress.

use std::path::Path;

use turbokv_backend::{Backend, VariantNeeds};
use turbokv_codec::KvDtype;

use crate::ModelError;
use crate::config::ModelConfig;
use crate::gguf::GgufFile;
use crate::loader::{load_weights, weight_bytes};
use crate::source::{SafetensorsDir, TensorSource};
use crate::transformer::Transformer;

/// How to load a model.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Show a progress bar on stderr while loading.
    pub progress: bool,
}

/// A loaded model: the forward pass on its backend, plus facts about the files.
pub struct Model<B: Backend> {
    /// The forward pass.
    pub transformer: Transformer<B>,
    /// Bytes of weight matrices read per decoded token.
    pub weight_bytes: usize,
    /// GGUF metadata (empty for safetensors directories).
    pub gguf: Option<GgufFile>,
    /// A short name for logs.
    pub name: String,
}

impl<B: Backend> Model<B> {
    /// Loads a GGUF file or a Hugging Face directory onto `backend`.
    pub fn load(path: &Path, backend: B, opts: &LoadOptions) -> Result<Self, ModelError> {
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        if path.is_dir() {
            let cfg_path = path.join("config.json");
            let text = std::fs::read_to_string(&cfg_path).map_err(|e| ModelError::Io {
                path: cfg_path.display().to_string(),
                source: e,
            })?;
            let config = ModelConfig::from_hf_json(&text)?;
            let src = SafetensorsDir::open(path)?
                .with_layer_names(crate::arch::hf_layer_names(config.family));
            let transformer = build(backend, config, &src, opts)?;
            let weight_bytes = weight_bytes(&src, transformer.config());
            Ok(Self {
                transformer,
                weight_bytes,
                gguf: None,
                name,
            })
        } else if path.extension().is_some_and(|e| e == "gguf") || path.is_file() {
            let file = GgufFile::open(path)?;
            let mut config = ModelConfig::from_gguf(&file.metadata)?;
            if file.has("rope_freqs.weight") {
                config.rope_scaling =
                    crate::config::RopeScaling::Factors(file.vector("rope_freqs.weight")?);
            }
            let transformer = build(backend, config, &file, opts)?;
            let weight_bytes = weight_bytes(&file, transformer.config());
            Ok(Self {
                transformer,
                weight_bytes,
                gguf: Some(file),
                name,
            })
        } else {
            Err(ModelError::UnknownFormat(path.display().to_string()))
        }
    }
}

fn build<B: Backend>(
    backend: B,
    config: ModelConfig,
    src: &dyn TensorSource,
    opts: &LoadOptions,
) -> Result<Transformer<B>, ModelError> {
    if let Some(missing) = missing_ops(&backend, &config) {
        return Err(ModelError::FamilyUnsupported {
            family: config.family,
            missing,
            backend: backend.describe(),
        });
    }
    let bar = if opts.progress {
        let bar = indicatif::ProgressBar::new(config.n_layers as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "loading {bar:30} {pos}/{len} layers {elapsed}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar
    } else {
        indicatif::ProgressBar::hidden()
    };
    let weights = load_weights(&backend, src, &config, &|done, _| {
        bar.set_position(done as u64)
    })?;
    bar.finish_and_clear();
    tracing::info!(
        layers = config.n_layers,
        hidden = config.hidden,
        heads = config.n_heads,
        kv_heads = config.n_kv_heads,
        head_dim = config.head_dim,
        backend = %backend.describe(),
        "model loaded"
    );
    Ok(Transformer::new(backend, config, weights))
}

/// What `backend` lacks to run a model with `config`, if anything: the element-wise family ops,
/// the attention variant its layers need (asked over 16-bit KV, which sliding-window rings
/// always use: the cache's dtype is checked again per layer when a cache is made), the short
/// convolution, the mixture of experts.
fn missing_ops<B: Backend>(backend: &B, config: &ModelConfig) -> Option<String> {
    let a = &config.arch;
    if !a.is_plain() && !backend.supports_family_ops() {
        return Some("element-wise family ops (scale, GeGLU)".into());
    }
    let needs = VariantNeeds {
        window: a.local_layers.contains(&true),
        sinks: a.sinks,
    };
    let geometry = crate::transformer::attn_geometry(config);
    let lacks = |n: VariantNeeds| {
        !n.is_plain()
            && backend
                .supports_attention_variant(&geometry, KvDtype::F16, n)
                .is_err()
    };
    if lacks(needs) {
        // Name the part the backend lacks (it may have windows but not sinks), or the pair
        // when each alone is supported.
        let window = VariantNeeds {
            sinks: false,
            ..needs
        };
        let sinks = VariantNeeds {
            window: false,
            ..needs
        };
        let missing = match (lacks(window), lacks(sinks)) {
            (false, true) => sinks,
            (true, false) => window,
            _ => needs,
        };
        return Some(missing.describe().to_string());
    }
    if a.conv_layers.contains(&true) && !backend.supports_short_conv() {
        return Some("short convolutions".into());
    }
    if a.moe.is_some() && !backend.supports_moe() {
        return Some("a mixture-of-experts MLP".into());
    }
    None
}
