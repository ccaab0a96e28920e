//! LFM2's conv layers: their state carried across prefill chunks, decode steps and batched
//! sequences; the KV cache, its policy and its byte figures skipping them; cuts within and
//! beyond the state's reach; bad files naming the conv tensor or key at fault.

use turbokv_backend::cpu::CpuBackend;
use turbokv_cache::{KvPolicy, KvWindow};
use turbokv_codec::KvDtype;
use turbokv_model::gguf::MetaValue;
use turbokv_model::{LogitsFor, Model, ModelError, SeqInput, Session};

use super::{assert_close, family_dir, load, reference, rewrite_gguf, tempdir};

fn lfm2() -> Model<CpuBackend> {
    load(&family_dir("lfm2").join("model.gguf")).unwrap()
}

/// Prefill in chunks of several sizes (1 = token by token, sizes that cut between the
/// conv's taps, one chunk of the whole prompt) gives one-shot prefill's logits at every
/// position, and decoding on from each gives the same next logits: the conv state carries
/// across chunk boundaries.
#[test]
fn lfm2_chunked_prefill_equals_one_shot() {
    let model = lfm2();
    let t = &model.transformer;
    let prompt = reference("lfm2").prompt;
    let mut one = Session::new(t, KvDtype::F16, 256).unwrap();
    let want = one.prefill_all_logits(&prompt).unwrap();
    let next = super::common::argmax(&want[want.len() - 128..]);
    let want_step = one.step(next).unwrap().to_vec();
    for chunk in [1, 2, 3, 5, 7, 11, prompt.len()] {
        let mut s = Session::new(t, KvDtype::F16, 256).unwrap();
        let mut got = Vec::new();
        for c in prompt.chunks(chunk) {
            got.extend(s.prefill_all_logits(c).unwrap());
        }
        assert_eq!(got.len(), want.len());
        // Other chunkings run other row counts through the matmuls (other summation
        // orders); a state lost or misplaced at a boundary would be off by O(1).
        assert_close(&got, &want, &format!("chunks of {chunk}"));
        let step = s.step(next).unwrap().to_vec();
        assert_close(
            &step,
            &want_step,
            &format!("decode after chunks of {chunk}"),
        );
    }
}

/// Two sequences of different lengths in each step, one joining late, give the logits each
/// gets alone: every sequence has its own conv state.
#[test]
fn lfm2_batched_sequences_keep_their_own_conv_state() {
    let model = lfm2();
    let t = &model.transformer;
    let a: Vec<u32> = (0..19).map(|i| (i * 7 + 3) % 128).collect();
    let b: Vec<u32> = (0..6).map(|i| (i * 13 + 1) % 128).collect();
    let alone = |ids: &[u32]| {
        let mut s = Session::new(t, KvDtype::F16, 256).unwrap();
        s.prefill_all_logits(ids).unwrap()
    };
    let (want_a, want_b) = (alone(&a), alone(&b));
    let mut cache = t.new_cache(KvDtype::F16, 16, 512, 256).unwrap();
    let mut scratch = t.new_scratch().unwrap();
    cache.add_sequence(1).unwrap();
    cache.add_sequence(2).unwrap();
    let mut out = Vec::new();
    let (mut got_a, mut got_b) = (Vec::new(), Vec::new());
    // Step 1: a's first 10 tokens alone; step 2: a's next 5 and all of b; step 3: the rest
    // of a, one token at a time, beside nothing.
    t.forward(
        &[SeqInput {
            seq: 1,
            tokens: &a[..10],
        }],
        &mut cache,
        &mut scratch,
        LogitsFor::AllTokens,
        &mut out,
    )
    .unwrap();
    got_a.extend_from_slice(&out);
    t.forward(
        &[
            SeqInput {
                seq: 1,
                tokens: &a[10..15],
            },
            SeqInput { seq: 2, tokens: &b },
        ],
        &mut cache,
        &mut scratch,
        LogitsFor::AllTokens,
        &mut out,
    )
    .unwrap();
    got_a.extend_from_slice(&out[..5 * 128]);
    got_b.extend_from_slice(&out[5 * 128..]);
    for i in 15..a.len() {
        t.forward(
            &[SeqInput {
                seq: 1,
                tokens: &a[i..i + 1],
            }],
            &mut cache,
            &mut scratch,
            LogitsFor::AllTokens,
            &mut out,
        )
        .unwrap();
        got_a.extend_from_slice(&out);
    }
    assert_close(&got_a, &want_a, "sequence a in a batch");
    assert_close(&got_b, &want_b, "sequence b in a batch");
}

/// The KV layout holds the two attention layers only: the policy's `-1` is the last
/// attention layer, bytes per token count two layers, and the conv layers' fixed state is
/// reported beside it. Every KV dtype and a preset-like policy run.
#[test]
fn lfm2_kv_cache_skips_conv_layers() {
    let model = lfm2();
    let t = &model.transformer;
    let c = t.config();
    assert_eq!((c.n_layers, c.kv_layers()), (5, 2));
    let policy = KvPolicy {
        layers: KvPolicy::parse_layers("-1:bf16").unwrap(),
        ..Default::default()
    };
    let cache = t
        .new_cache_with(KvDtype::Int8, &policy, 16, 256, 256)
        .unwrap();
    let dtypes: Vec<String> = cache
        .layout()
        .layers
        .iter()
        .map(|l| l.dtype.to_string())
        .collect();
    assert_eq!(dtypes, ["int8", "bf16"]);
    let per_layer = |d: KvDtype| {
        let l = turbokv_cache::KvLayout::uniform(1, c.n_kv_heads, c.head_dim, d, 16, 16).unwrap();
        l.bytes_per_token(0)
    };
    let want = per_layer(KvDtype::Int8) + per_layer(KvDtype::Bf16);
    assert!((cache.bytes_per_token() - want).abs() < 1e-9);
    // Three conv layers × (2 taps read + 4 to cut back) × 32 channels × f32.
    assert_eq!(cache.conv_state_bytes_per_seq(), Some(3 * 6 * 32 * 4));
    // An override naming a conv layer's model index beyond the attention layers is refused.
    let bad = KvPolicy {
        layers: KvPolicy::parse_layers("3:bf16").unwrap(),
        ..Default::default()
    };
    assert!(t.new_cache_with(KvDtype::Int8, &bad, 16, 256, 256).is_err());

    // Calibration (for centered caches) measures the attention layers only, and its centers
    // fit the cache.
    let prompt = reference("lfm2").prompt;
    let cal = turbokv_model::calibrate::calibrate_kv_centers_on(t, &prompt).unwrap();
    assert_eq!(cal.centers.layers(), 2);
    let centered = KvPolicy {
        centers: Some(std::sync::Arc::new(cal.centers)),
        ..Default::default()
    };
    let tq3: KvDtype = "tq3".parse().unwrap();
    let mut s = Session::with_policy(t, tq3, &centered, 256).unwrap();
    assert!(
        s.prefill_all_logits(&prompt)
            .unwrap()
            .iter()
            .all(|x| x.is_finite())
    );

    let compact = KvPolicy {
        window: KvWindow {
            recent: 15,
            sinks: 1,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut base = Session::new(t, KvDtype::F16, 256).unwrap();
    let base = base.prefill_all_logits(&prompt).unwrap();
    for (kv, policy) in [
        ("tq3", KvPolicy::default()),
        ("int8", KvPolicy::default()),
        ("k4v2", compact),
    ] {
        let dtype: KvDtype = kv.parse().unwrap();
        let mut s = Session::with_policy(t, dtype, &policy, 256).unwrap();
        let got = s.prefill_all_logits(&prompt).unwrap();
        assert!(got.iter().all(|x| x.is_finite()), "{kv}");
        let kl = super::mean_kl(&base, &got, 128);
        eprintln!(
            "lfm2 {kv} (window {:?}): mean KL {kl:.2e} from the f16 cache",
            policy.window
        );
        assert!(kl < 0.5, "{kv}: mean KL {kl} from the f16 cache");
        let next = s.step(1).unwrap();
        assert!(next.iter().all(|x| x.is_finite()), "{kv} decode");
    }
}

/// Cutting a sequence back a few tokens (what greedy decoding does with the step it issued
/// past the last token) and feeding the same tokens again gives the same logits; a cut
/// beyond the conv state's reach is refused and changes nothing; a cut to 0 restarts it.
#[test]
fn lfm2_truncation_within_the_conv_state_reach() {
    let model = lfm2();
    let t = &model.transformer;
    let ids: Vec<u32> = (0..14).map(|i| (i * 9 + 4) % 128).collect();
    let mut cache = t.new_cache(KvDtype::F16, 16, 512, 256).unwrap();
    let mut scratch = t.new_scratch().unwrap();
    cache.add_sequence(5).unwrap();
    let mut run = |cache: &mut turbokv_model::KvCache<CpuBackend>, tokens: &[u32]| {
        let mut out = Vec::new();
        t.forward(
            &[SeqInput { seq: 5, tokens }],
            cache,
            &mut scratch,
            LogitsFor::LastToken,
            &mut out,
        )
        .map(|()| out)
    };
    let want = run(&mut cache, &ids).unwrap();
    for back in 1..=4 {
        cache.truncate(5, ids.len() - back).unwrap();
        let again = run(&mut cache, &ids[ids.len() - back..]).unwrap();
        assert_close(&again, &want, &format!("after cutting {back} back"));
    }
    let err = cache.truncate(5, 3).unwrap_err();
    assert!(
        matches!(err, ModelError::ConvState { seq: 5, .. }) && err.to_string().contains("cut"),
        "{err}"
    );
    assert_eq!(
        cache.seq_len(5).unwrap(),
        ids.len(),
        "a refused cut changes nothing"
    );
    cache.truncate(5, 0).unwrap();
    let again = run(&mut cache, &ids).unwrap();
    assert_close(&again, &want, "after a restart");

    // A step that fails before any conv layer runs (a token outside the vocabulary fails the
    // embedding) leaves the state as it was: the sequence goes on as if it never happened.
    let err = run(&mut cache, &[999]).unwrap_err();
    assert!(err.to_string().contains("vocabulary"), "{err}");
    assert_eq!(cache.seq_len(5).unwrap(), ids.len());
    cache.truncate(5, ids.len() - 1).unwrap();
    let again = run(&mut cache, &ids[ids.len() - 1..]).unwrap();
    assert_close(&again, &want, "after a failed step");

    // A sequence resumed past position 0 without a state (as a shared prefix would be) is
    // refused before anything runs.
    cache.add_sequence(6).unwrap();
    cache.allocator_mut().grow(6, 4).unwrap();
    let err = t
        .forward(
            &[SeqInput {
                seq: 6,
                tokens: &ids[..2],
            }],
            &mut cache,
            &mut scratch,
            LogitsFor::LastToken,
            &mut Vec::new(),
        )
        .unwrap_err();
    assert!(
        matches!(err, ModelError::ConvState { seq: 6, .. }) && err.to_string().contains("prefix"),
        "{err}"
    );
    assert_eq!(cache.seq_len(6).unwrap(), 4);
}

/// Bad LFM2 files: a missing or mis-shaped conv tensor names it; a missing conv width or
/// inconsistent per-layer kv heads name the key; the MoE variant names itself.
#[test]
fn lfm2_bad_files_give_typed_errors() {
    let dir = tempdir("lfm2");
    let src = family_dir("lfm2").join("model.gguf");
    let path = dir.join("bad.gguf");
    let keep = |_: &str, d, b| Some((d, b));

    for missing in [
        "blk.1.shortconv.conv.weight",
        "blk.3.shortconv.in_proj.weight",
    ] {
        rewrite_gguf(&src, &path, |n, d, b| (n != missing).then_some((d, b)), &[]);
        let err = load(&path).err().unwrap();
        assert!(
            matches!(&err, ModelError::MissingTensor(n) if n == missing),
            "{err}"
        );
    }

    // A conv kernel of 2 taps where the file says 3.
    rewrite_gguf(
        &src,
        &path,
        |n, d, b| {
            if n == "blk.0.shortconv.conv.weight" {
                let (taps, rows) = (d[0], d[1]);
                let row = b.len() / rows;
                let keep = row / taps * 2;
                let data: Vec<u8> = b.chunks(row).flat_map(|r| r[..keep].to_vec()).collect();
                Some((vec![2, rows], data))
            } else {
                Some((d, b))
            }
        },
        &[],
    );
    let err = load(&path).err().unwrap();
    assert!(
        matches!(&err, ModelError::TensorShape { name, detail }
            if name == "blk.0.shortconv.conv.weight" && detail.contains("[32, 2]")),
        "{err}"
    );

    rewrite_gguf(
        &src,
        &path,
        |n, d, b| (n != "token_embd_norm.weight").then_some((d, b)),
        &[],
    );
    let err = load(&path).err().unwrap();
    assert!(
        matches!(&err, ModelError::MissingTensor(n) if n == "token_embd_norm.weight"),
        "{err}"
    );

    // The conv width is required (no silent default).
    let file = turbokv_model::gguf::GgufFile::open(&src).unwrap();
    let mut w = turbokv_model::gguf::GgufWriter::new();
    for (k, v) in file.metadata.iter() {
        if k != "lfm2.shortconv.l_cache" {
            w.meta(k, v.clone());
        }
    }
    for t in file.tensors() {
        w.tensor(&t.name, &t.dims, 1, file.tensor_bytes(t).to_vec());
    }
    std::fs::write(&path, w.to_bytes()).unwrap();
    let err = load(&path).err().unwrap();
    assert!(err.to_string().contains("lfm2.shortconv.l_cache"), "{err}");

    let heads = |v: &[u64]| MetaValue::Array(v.iter().map(|&h| MetaValue::U64(h)).collect());
    rewrite_gguf(
        &src,
        &path,
        keep,
        &[("lfm2.attention.head_count_kv", heads(&[0, 0, 1, 0, 2]))],
    );
    let err = load(&path).err().unwrap();
    assert!(
        matches!(&err, ModelError::InvalidConfig(m) if m.contains("head_count_kv")),
        "{err}"
    );

    rewrite_gguf(
        &src,
        &path,
        keep,
        &[("general.architecture", MetaValue::Str("lfm2moe".into()))],
    );
    let err = load(&path).err().unwrap();
    assert!(
        matches!(err, ModelError::UnknownArchitecture { .. }) && err.to_string().contains("MoE"),
        "{err}"
    );
}
