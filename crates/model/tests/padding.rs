//! Padded decode steps (`Transformer::forward_padded`) on the demo model (CPU): the real
//! rows' logits and candidates are bit for bit those of the unpadded step, the placeholder
//! rows write no block the allocator manages (every block's bytes equal the unpadded run's)
//! and take none from it, and a step the padding cannot apply to is refused without growing
//! any sequence.

mod common;

use turbokv_backend::TopK;
use turbokv_backend::cpu::CpuBackend;
use turbokv_cache::{KvPolicy, KvWindow};
use turbokv_codec::KvDtype;
use turbokv_model::{
    KvCache, LoadOptions, LogitsFor, Model, ModelError, Scratch, SeqInput, StepOutput, Transformer,
};

const PROMPTS: [&[u32]; 3] = [
    &[1, 504, 3458, 282, 4649, 314],
    &[1, 9519, 2116, 253, 655, 28, 281, 253, 1165, 6772, 28],
    &[1, 563, 30, 7208, 25],
];

/// A cache of 32 blocks of 16 tokens with the three prompts prefilled.
fn prefilled(
    tm: &Transformer<CpuBackend>,
    dtype: KvDtype,
    policy: &KvPolicy,
    scratch: &mut Scratch<CpuBackend>,
) -> KvCache<CpuBackend> {
    let mut cache = tm.new_cache_with(dtype, policy, 16, 512, 256).unwrap();
    let mut logits = Vec::new();
    for (id, p) in PROMPTS.iter().enumerate() {
        cache.add_sequence(id as u64).unwrap();
        let inp = [SeqInput {
            seq: id as u64,
            tokens: p,
        }];
        tm.forward(&inp, &mut cache, scratch, LogitsFor::LastToken, &mut logits)
            .unwrap();
    }
    cache
}

fn dtype(spelling: &str) -> KvDtype {
    spelling.parse().unwrap()
}

/// Every managed block's bytes, block after block.
fn all_blocks(tm: &Transformer<CpuBackend>, cache: &KvCache<CpuBackend>) -> Vec<Vec<u8>> {
    (0..cache.allocator().total_blocks() as u32)
        .map(|b| cache.read_block(tm.backend(), b).unwrap())
        .collect()
}

/// Decode steps over the first `n` sequences (sizes 3, 2, 3, 1, 3, …), unpadded on one cache
/// and padded to `bucket` rows on another; returns how many steps compared.
fn compare_padded(
    tm: &Transformer<CpuBackend>,
    dtype: KvDtype,
    policy: &KvPolicy,
    bucket: usize,
    check_blocks: bool,
) -> usize {
    let (mut s1, mut s2) = (tm.new_scratch().unwrap(), tm.new_scratch().unwrap());
    let mut plain = prefilled(tm, dtype, policy, &mut s1);
    let mut padded = prefilled(tm, dtype, policy, &mut s2);
    let (mut want, mut got) = (Vec::new(), Vec::new());
    let (mut want_top, mut got_top) = (TopK::default(), TopK::default());
    let mut next: Vec<u32> = vec![42, 7, 1999];
    let sizes = [3, 2, 3, 1, 3, 2];
    for (step, &n) in sizes.iter().enumerate() {
        let inputs: Vec<SeqInput<'_>> = (0..n)
            .map(|s| SeqInput {
                seq: s as u64,
                tokens: std::slice::from_ref(&next[s]),
            })
            .collect();
        let pad = bucket - n;
        // Even steps end in full logits, odd ones in top-k candidates.
        if step % 2 == 0 {
            tm.forward(
                &inputs,
                &mut plain,
                &mut s1,
                LogitsFor::LastToken,
                &mut want,
            )
            .unwrap();
            tm.forward_padded(
                &inputs,
                pad,
                &mut padded,
                &mut s2,
                &mut StepOutput::Logits(&mut got),
            )
            .unwrap();
            assert_eq!(got.len(), want.len(), "{dtype} step {step}: only real rows");
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{dtype} step {step}: padded logits differ");
        } else {
            tm.forward_top_k(&inputs, &mut plain, &mut s1, 5, &mut want_top)
                .unwrap();
            let mut out = StepOutput::TopK {
                k: 5,
                out: &mut got_top,
            };
            tm.forward_padded(&inputs, pad, &mut padded, &mut s2, &mut out)
                .unwrap();
            assert_eq!(got_top.rows(), n, "{dtype} step {step}: only real rows");
            assert_eq!(
                got_top, want_top,
                "{dtype} step {step}: padded candidates differ"
            );
        }
        drop(inputs);
        for (s, t) in next.iter_mut().enumerate().take(n) {
            *t = (*t * 31 + 17 + s as u32) % 49_000;
        }
        assert_eq!(
            padded.allocator().free_blocks(),
            plain.allocator().free_blocks(),
            "the placeholder rows take no block"
        );
        for s in 0..3 {
            assert_eq!(padded.seq_len(s).unwrap(), plain.seq_len(s).unwrap());
        }
    }
    if check_blocks {
        assert_eq!(
            all_blocks(tm, &padded),
            all_blocks(tm, &plain),
            "{dtype}: the placeholder rows wrote into a managed block"
        );
    }
    sizes.len()
}

#[test]
fn padded_decode_steps_give_the_unpadded_rows_and_touch_no_managed_block() {
    let Some(path) = common::demo_model() else {
        return;
    };
    let model = Model::load(&path, CpuBackend::new(), &LoadOptions::default()).unwrap();
    let tm = &model.transformer;
    assert!(tm.supports_padding());
    let none = KvPolicy::default();
    assert_eq!(compare_padded(tm, KvDtype::Bf16, &none, 8, true), 6);
    assert_eq!(compare_padded(tm, dtype("tq3"), &none, 4, true), 6);
    // A full-precision window beside the codes: the placeholder rows keep their exact copy
    // beside the padding block (block bytes are refused for such pools: logits only).
    let windowed = KvPolicy {
        window: KvWindow {
            recent: 8,
            sinks: 1,
            ..Default::default()
        },
        ..KvPolicy::default()
    };
    assert_eq!(compare_padded(tm, dtype("k4v3"), &windowed, 4, false), 6);
}

#[test]
fn a_step_that_cannot_be_padded_is_refused_and_grows_nothing() {
    let Some(path) = common::demo_model() else {
        return;
    };
    let model = Model::load(&path, CpuBackend::new(), &LoadOptions::default()).unwrap();
    let tm = &model.transformer;
    let mut scratch = tm.new_scratch().unwrap();
    let mut cache = prefilled(tm, KvDtype::Bf16, &KvPolicy::default(), &mut scratch);
    let before: Vec<usize> = (0..3).map(|s| cache.seq_len(s).unwrap()).collect();
    let two = [5u32, 6];
    let inputs = [
        SeqInput {
            seq: 0,
            tokens: &two,
        },
        SeqInput {
            seq: 1,
            tokens: &two[..1],
        },
    ];
    let mut logits = Vec::new();
    let err = tm
        .forward_padded(
            &inputs,
            2,
            &mut cache,
            &mut scratch,
            &mut StepOutput::Logits(&mut logits),
        )
        .unwrap_err();
    assert!(matches!(err, ModelError::PaddingUnsupported(_)), "{err}");
    let after: Vec<usize> = (0..3).map(|s| cache.seq_len(s).unwrap()).collect();
    assert_eq!(before, after);
    // Without placeholder rows the same step runs as an ordinary one.
    tm.forward_padded(
        &inputs,
        0,
        &mut cache,
        &mut scratch,
        &mut StepOutput::Logits(&mut logits),
    )
    .unwrap();
    assert_eq!(logits.len(), 2 * tm.config().vocab_size);
    assert_eq!(cache.seq_len(0).unwrap(), before[0] + 2);
}
