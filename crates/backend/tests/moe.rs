//! The mixture-of-experts MLP ([`Backend::moe`]) on the CPU against a float64 reference of
//! gpt-oss's: top-k of the router's logits, softmax over the chosen, clamped SwiGLU experts
//! with biases, weighted sum; with the clamp reached on both sides and rows that tie.

use turbokv_backend::cpu::{CpuBackend, CpuTensor};
use turbokv_backend::{Backend, MoeExpert, MoeMlp, WeightMatrix};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| scale * self.next()).collect()
    }
}

/// An expert's f32 weights: gate_up `[2·ffn, hidden]`, its bias, down `[hidden, ffn]`, its bias.
type Expert = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

const ALPHA: f32 = 1.702;
const LIMIT: f32 = 7.0;

fn swiglu_ref(g: f64, u: f64) -> f64 {
    let g = g.min(LIMIT as f64);
    let u = u.clamp(-LIMIT as f64, LIMIT as f64);
    (u + 1.0) * g / (1.0 + (-(ALPHA as f64) * g).exp())
}

fn matvec(w: &[f32], rows: usize, x: &[f64]) -> Vec<f64> {
    let cols = x.len();
    (0..rows)
        .map(|r| {
            (0..cols)
                .map(|c| w[r * cols + c] as f64 * x[c])
                .sum::<f64>()
        })
        .collect()
}

#[test]
fn moe_matches_a_float64_reference() {
    let (hidden, ffn, n_exp, rows) = (64, 32, 4, 9);
    let b = CpuBackend::new();
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let router = rng.vec(n_exp * hidden, 0.3);
    let router_bias = rng.vec(n_exp, 0.5);
    // gate/up large enough that |g|, |u| pass the limit for a good share of entries.
    let experts: Vec<Expert> = (0..n_exp)
        .map(|_| {
            (
                rng.vec(2 * ffn * hidden, 1.5),
                rng.vec(2 * ffn, 1.0),
                rng.vec(hidden * ffn, 0.2),
                rng.vec(hidden, 0.5),
            )
        })
        .collect();
    let mut x = rng.vec(rows * hidden, 1.0);
    // The last row repeats the first: the same experts, the same output.
    let first = x[..hidden].to_vec();
    x[(rows - 1) * hidden..].copy_from_slice(&first);

    let mats: Vec<MoeExpert<WeightMatrix, Vec<f32>>> = experts
        .iter()
        .map(|(gu, gub, d, db)| MoeExpert {
            gate_up: WeightMatrix::from_f32(2 * ffn, hidden, gu).unwrap(),
            gate_up_bias: Some(gub.clone()),
            down: WeightMatrix::from_f32(hidden, ffn, d).unwrap(),
            down_bias: Some(db.clone()),
        })
        .collect();
    let router_m = WeightMatrix::from_f32(n_exp, hidden, &router).unwrap();
    for top_k in [1, 2, 4] {
        let mlp = MoeMlp {
            router: &router_m,
            router_bias: Some(&router_bias),
            experts: &mats,
            top_k,
            alpha: ALPHA,
            limit: LIMIT,
        };
        let xt = CpuTensor::from_vec(x.clone(), rows, hidden).unwrap();
        let mut out = b.tensor(rows, hidden).unwrap();
        out.as_mut_slice().fill(f32::NAN);
        b.moe(&xt, &mlp, &mut out).unwrap();
        let (mut worst, mut clamped) = (0f64, 0usize);
        for r in 0..rows {
            let xr: Vec<f64> = x[r * hidden..(r + 1) * hidden]
                .iter()
                .map(|&v| v as f64)
                .collect();
            let logits: Vec<f64> = matvec(&router, n_exp, &xr)
                .iter()
                .zip(&router_bias)
                .map(|(l, b)| l + *b as f64)
                .collect();
            let mut order: Vec<usize> = (0..n_exp).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
            let chosen = &order[..top_k];
            let m = logits[chosen[0]];
            let z: f64 = chosen.iter().map(|&e| (logits[e] - m).exp()).sum();
            let mut want = vec![0f64; hidden];
            for &e in chosen {
                let (gu, gub, d, db) = &experts[e];
                let h: Vec<f64> = matvec(gu, 2 * ffn, &xr)
                    .iter()
                    .zip(gub)
                    .map(|(v, b)| v + *b as f64)
                    .collect();
                clamped += h.iter().filter(|v| v.abs() > LIMIT as f64).count();
                let act: Vec<f64> = (0..ffn).map(|i| swiglu_ref(h[i], h[ffn + i])).collect();
                let w = (logits[e] - m).exp() / z;
                for (o, (v, b)) in want.iter_mut().zip(matvec(d, hidden, &act).iter().zip(db)) {
                    *o += w * (v + *b as f64);
                }
            }
            let scale = want.iter().map(|v| v.abs()).fold(1e-3, f64::max);
            for (g, w) in out.row(r).iter().zip(&want) {
                assert!(g.is_finite());
                worst = worst.max((*g as f64 - w).abs() / scale);
            }
        }
        assert_eq!(out.row(0), out.row(rows - 1), "top-{top_k}: equal rows");
        assert!(clamped > 0, "the clamp was never reached");
        // f32 dot products of 64 and 32 terms: float noise only.
        assert!(worst < 1e-5, "top-{top_k}: relative error {worst}");
    }

    // A top-k the experts do not allow, and a router for another expert count.
    let xt = CpuTensor::from_vec(x.clone(), rows, hidden).unwrap();
    let mut out = b.tensor(rows, hidden).unwrap();
    for top_k in [0, 5] {
        let mlp = MoeMlp {
            router: &router_m,
            router_bias: None,
            experts: &mats,
            top_k,
            alpha: ALPHA,
            limit: LIMIT,
        };
        let err = b.moe(&xt, &mlp, &mut out).unwrap_err();
        assert!(err.to_string().contains("of 4 experts"), "{err}");
    }
    let mlp = MoeMlp {
        router: &router_m,
        router_bias: None,
        experts: &mats[..3],
        top_k: 2,
        alpha: ALPHA,
        limit: LIMIT,
    };
    let err = b.moe(&xt, &mlp, &mut out).unwrap_err();
    assert!(
        err.to_string().contains("router [4, 64] for 3 experts"),
        "{err}"
    );
}
