//! The Mamba-2 mixer against a naive reference: prompt vs steps vs splits, the dt clamp, and bad checkpoints.
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::model::tensors::test_support::MapSource;

const PREFIX: &str = "backbone.layers.3.mixer.";

fn spec(groups: usize, bias: bool, limit: (f32, f32)) -> Mamba2Spec {
    let (heads, head_dim) = (2 * groups, 3);
    Mamba2Spec {
        hidden: 10,
        heads,
        head_dim,
        state_dim: 5,
        groups,
        conv_kernel: 4,
        chunk_size: 4,
        conv_bias: bias,
        proj_bias: bias,
        norm_eps: 1e-5,
        norm_group_size: heads * head_dim / groups,
        time_step_limit: limit,
    }
}

fn uniform(rng: &mut ChaCha8Rng, len: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(lo..hi)).collect()
}

fn random_weights(s: &Mamba2Spec, rng: &mut ChaCha8Rng) -> MapSource {
    let (di, cd) = (d_inner(s), conv_dim(s));
    let dp = di + cd + s.heads;
    let scale_in = 1.5 / (s.hidden as f32).sqrt();
    let mut src = MapSource::default();
    let mut put = |n: &str, shape: &[usize], lo: f32, hi: f32| {
        let len = shape.iter().product();
        src.put(&format!("{PREFIX}{n}"), shape, uniform(rng, len, lo, hi));
    };
    put("in_proj.weight", &[dp, s.hidden], -scale_in, scale_in);
    put("conv1d.weight", &[cd, 1, s.conv_kernel], -0.6, 0.6);
    put("dt_bias", &[s.heads], -4.0, 1.0);
    put("A_log", &[s.heads], -1.0, 1.5);
    put("D", &[s.heads], -1.0, 1.0);
    put("norm.weight", &[di], 0.5, 1.5);
    put("out_proj.weight", &[s.hidden, di], -0.5, 0.5);
    if s.proj_bias {
        put("in_proj.bias", &[dp], -0.3, 0.3);
        put("out_proj.bias", &[s.hidden], -0.3, 0.3);
    }
    if s.conv_bias {
        put("conv1d.bias", &[cd], -0.3, 0.3);
    }
    src
}

fn load(s: &Mamba2Spec, weights: &MapSource) -> Mamba2Mixer {
    let mut src = weights.clone();
    let mixer = Mamba2Mixer::load(s, &mut src, PREFIX).expect("load");
    src.finish(&[], &[]).expect("every tensor taken");
    mixer
}

fn rel(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let diff: f64 = got.iter().zip(want).map(|(g, w)| ((g - w) as f64).powi(2)).sum();
    let norm: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
    (diff / norm).sqrt()
}

/// The mixer written out token by token in f64, following transformers' `NemotronHMamba2Mixer` line by line.
fn naive(s: &Mamba2Spec, w: &MapSource, x: &[f32], t: usize) -> Vec<f32> {
    let g = |n: &str| -> Vec<f64> { w.get(&format!("{PREFIX}{n}")).iter().map(|v| *v as f64).collect() };
    let opt = |n: &str, on: bool, len: usize| if on { g(n) } else { vec![0.0; len] };
    let (di, cd, k, n, p) = (d_inner(s), conv_dim(s), s.conv_kernel, s.state_dim, s.head_dim);
    let dp = di + cd + s.heads;
    let (w_in, b_in) = (g("in_proj.weight"), opt("in_proj.bias", s.proj_bias, dp));
    let (w_conv, b_conv) = (g("conv1d.weight"), opt("conv1d.bias", s.conv_bias, cd));
    let (dt_bias, a_log, d_skip, norm_w) = (g("dt_bias"), g("A_log"), g("D"), g("norm.weight"));
    let (w_out, b_out) = (g("out_proj.weight"), opt("out_proj.bias", s.proj_bias, s.hidden));
    let silu = |v: f64| v / (1.0 + (-v).exp());
    let proj: Vec<Vec<f64>> = (0..t)
        .map(|i| {
            (0..dp)
                .map(|o| {
                    b_in[o]
                        + (0..s.hidden)
                            .map(|j| w_in[o * s.hidden + j] * x[i * s.hidden + j] as f64)
                            .sum::<f64>()
                })
                .collect()
        })
        .collect();
    let mut state = vec![0.0f64; s.heads * p * n];
    let mut out = Vec::new();
    for i in 0..t {
        let conv: Vec<f64> = (0..cd)
            .map(|ch| {
                let mut acc = b_conv[ch];
                for j in 0..k {
                    let time = i as isize - (k - 1) as isize + j as isize;
                    if time >= 0 {
                        acc += w_conv[ch * k + j] * proj[time as usize][di + ch];
                    }
                }
                silu(acc)
            })
            .collect();
        let (xs, bs, cs) = (&conv[..di], &conv[di..di + s.groups * n], &conv[di + s.groups * n..]);
        let mut y = vec![0.0f64; di];
        for h in 0..s.heads {
            let grp = h / (s.heads / s.groups);
            let raw = proj[i][di + cd + h] + dt_bias[h];
            let sp = if raw > 20.0 { raw } else { raw.exp().ln_1p() };
            let dt = sp.clamp(s.time_step_limit.0 as f64, s.time_step_limit.1 as f64);
            let da = (dt * -a_log[h].exp()).exp();
            for c in 0..p {
                let xv = xs[h * p + c];
                let mut acc = 0.0;
                for m in 0..n {
                    let st = &mut state[(h * p + c) * n + m];
                    *st = da * *st + dt * xv * bs[grp * n + m];
                    acc += *st * cs[grp * n + m];
                }
                y[h * p + c] = acc + d_skip[h] * xv;
            }
        }
        let gated: Vec<f64> = (0..di).map(|c| y[c] * silu(proj[i][c])).collect();
        let mut normed = vec![0.0f64; di];
        for (gi, grp) in gated.chunks(s.norm_group_size).enumerate() {
            let var = grp.iter().map(|v| v * v).sum::<f64>() / grp.len() as f64;
            for (c, v) in grp.iter().enumerate() {
                let ch = gi * s.norm_group_size + c;
                normed[ch] = norm_w[ch] * v / (var + s.norm_eps as f64).sqrt();
            }
        }
        for o in 0..s.hidden {
            let v = b_out[o] + (0..di).map(|c| w_out[o * di + c] * normed[c]).sum::<f64>();
            out.push(v as f32);
        }
    }
    out
}

fn steps(mixer: &Mamba2Mixer, x: &[f32], state: &mut Mamba2State) -> Vec<f32> {
    let hidden = mixer.spec().hidden;
    x.chunks_exact(hidden)
        .flat_map(|row| mixer.forward(row, 1, state))
        .collect()
}

#[test]
fn prompt_matches_reference_and_steps_and_splits() {
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    // The second limit is active for many tokens (dt_bias reaches −4), so the clamp is exercised in every form.
    for (groups, bias, limit) in [
        (1, true, (0.0, f32::INFINITY)),
        (2, false, (0.05, 0.8)),
        (3, true, (0.0, 1.5)),
    ] {
        let s = spec(groups, bias, limit);
        let weights = random_weights(&s, &mut rng);
        let mixer = load(&s, &weights);
        let t = 13;
        let x = uniform(&mut rng, t * s.hidden, -1.0, 1.0);

        let mut whole_state = mixer.new_state();
        let whole = mixer.forward(&x, t, &mut whole_state);
        let reference = naive(&s, &weights, &x, t);
        let e = rel(&whole, &reference);
        assert!(e < 1e-4, "groups {groups}: chunked prompt vs reference: {e:e}");

        // The decode path never clamps, like the reference's: it matches the reference without a clamp.
        let mut step_state = mixer.new_state();
        let stepped = steps(&mixer, &x, &mut step_state);
        let unclamped = spec(groups, bias, (0.0, f32::INFINITY));
        let e = rel(&stepped, &naive(&unclamped, &weights, &x, t));
        assert!(e < 1e-4, "groups {groups}: steps vs unclamped reference: {e:e}");
        if limit != (0.0, f32::INFINITY) {
            // Where the prefill clamp bites, prefill and decode legitimately differ (as in transformers).
            assert!(rel(&stepped, &whole) > 1e-4, "groups {groups}: the clamp never bit");
            continue;
        }
        let e = rel(&stepped, &whole);
        assert!(e < 1e-4, "groups {groups}: steps vs chunked: {e:e}");
        assert!(rel(&step_state.ssm, &whole_state.ssm) < 1e-4);
        // The conv state holds raw projections, which differ in the last bits between 1-row and t-row products.
        assert!(rel(&step_state.conv, &whole_state.conv) < 1e-6);

        // Chunked prefix (not a multiple of the chunk size), a chunked middle, then single steps.
        for cut in [2, 5, 9] {
            let mut state = mixer.new_state();
            let hs = s.hidden;
            let mut split = mixer.forward(&x[..cut * hs], cut, &mut state);
            split.extend(mixer.forward(&x[cut * hs..(cut + 3) * hs], 3, &mut state));
            split.extend(steps(&mixer, &x[(cut + 3) * hs..], &mut state));
            let e = rel(&split, &whole);
            assert!(e < 1e-4, "groups {groups}: split at {cut} vs whole: {e:e}");
            assert!(rel(&state.ssm, &whole_state.ssm) < 1e-4);
            assert!(rel(&state.conv, &whole_state.conv) < 1e-6);
        }
    }
}

#[test]
fn clamp_changes_the_output() {
    // Guards the test above against a limit that never bites.
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let free = spec(2, false, (0.0, f32::INFINITY));
    let clamped = spec(2, false, (0.05, 0.8));
    let weights = random_weights(&free, &mut rng);
    let x = uniform(&mut rng, 6 * free.hidden, -1.0, 1.0);
    let a = load(&free, &weights).forward(&x, 6, &mut load(&free, &weights).new_state());
    let b = load(&clamped, &weights).forward(&x, 6, &mut load(&clamped, &weights).new_state());
    assert!(rel(&b, &a) > 1e-3);
}

#[test]
fn load_rejects_bad_checkpoints_and_specs() {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let s = spec(2, true, (0.0, f32::INFINITY));
    let weights = random_weights(&s, &mut rng);

    let mut missing = weights.clone();
    missing.0.remove(&format!("{PREFIX}conv1d.bias"));
    let err = Mamba2Mixer::load(&s, &mut missing, PREFIX).unwrap_err();
    assert!(matches!(err, EngineError::MissingTensor { ref name, .. } if name.ends_with("conv1d.bias")));

    let mut wrong = weights.clone();
    let name = format!("{PREFIX}out_proj.weight");
    wrong.put(&name, &[d_inner(&s), s.hidden], weights.get(&name).to_vec());
    let err = Mamba2Mixer::load(&s, &mut wrong, PREFIX).unwrap_err();
    assert!(matches!(err, EngineError::TensorShape { .. }), "{err}");

    let mut bad = s.clone();
    bad.heads = 3;
    let err = Mamba2Mixer::load(&bad, &mut weights.clone(), PREFIX).unwrap_err();
    assert!(
        matches!(err, EngineError::Config { ref field, .. } if field == "n_groups"),
        "{err}"
    );

    // Without biases in the spec, the bias tensors are left over for `finish` to report.
    let mut extra = weights.clone();
    let no_bias = Mamba2Spec {
        conv_bias: false,
        proj_bias: false,
        ..s.clone()
    };
    Mamba2Mixer::load(&no_bias, &mut extra, PREFIX).expect("load");
    assert!(extra.finish(&[], &[]).is_err());
}
