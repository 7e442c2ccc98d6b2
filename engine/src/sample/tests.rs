use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::rank::SampleRow;
use crate::sched::OutputStream;

fn random_logits(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-8.0f32..8.0)).collect()
}

fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = SamplingParams {
        seed: Some(1234),
        ..SamplingParams::default()
    };
    f(&mut p);
    p
}

fn softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = logits.iter().map(|&l| f64::from(l - max).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

/// Samples as a rank does ([`SampleRow::sample`]) with the request's draws taken in order from its seeded stream
/// ([`Sampler::draw_at`]), as the coordinator hands them out.
struct Draws {
    params: SamplingParams,
    seed: u64,
    index: u64,
}

impl Draws {
    fn new(params: SamplingParams) -> Result<Self> {
        let seed = Sampler::new(params.clone())?.seed();
        Ok(Draws { params, seed, index: 0 })
    }

    /// The row of a step after `previous_tokens`, all of them generated ones (the additive penalties' context too),
    /// with EOS id 0.
    fn row(&self, uniform: f32, previous_tokens: &[u32]) -> SampleRow {
        let p = &self.params;
        let mut bias = Vec::new();
        p.logit_bias_at(previous_tokens, &[0], &mut bias);
        SampleRow {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            history: previous_tokens.to_vec(),
            bias,
            mask: None,
            uniform,
        }
    }

    /// The next token from `logits` with `previous_tokens` as the penalty's context; an out-of-range previous token
    /// is the rank's refusal ([`SampleRow::validate`]).
    fn sample(&mut self, logits: &[f32], previous_tokens: &[u32]) -> Result<u32> {
        let row = self.row(Sampler::draw_at(self.seed, self.index), previous_tokens);
        self.index += 1;
        row.validate(logits.len())?;
        Ok(row.sample(logits))
    }
}

/// Empirical token frequencies over `n` draws.
fn histogram(p: SamplingParams, logits: &[f32], n: usize) -> Vec<f64> {
    let mut s = Draws::new(p).unwrap();
    let mut h = vec![0.0; logits.len()];
    for _ in 0..n {
        h[s.sample(logits, &[]).unwrap() as usize] += 1.0;
    }
    h.iter().map(|c| c / n as f64).collect()
}

#[test]
fn validate_names_the_parameter_and_value() {
    assert!(SamplingParams::default().validate(10).is_ok());
    assert!(SamplingParams::greedy().validate(10).is_ok());
    let cases: Vec<(SamplingParams, &str)> = vec![
        (
            params(|p| p.temperature = f32::NAN),
            "temperature must be a finite number >= 0, got NaN",
        ),
        (
            params(|p| p.temperature = -0.5),
            "temperature must be a finite number >= 0, got -0.5",
        ),
        (
            params(|p| p.temperature = f32::INFINITY),
            "temperature must be a finite number >= 0, got inf",
        ),
        (params(|p| p.top_p = 0.0), "top_p must be in (0, 1], got 0"),
        (params(|p| p.top_p = 1.5), "top_p must be in (0, 1], got 1.5"),
        (params(|p| p.top_p = f32::NAN), "top_p must be in (0, 1], got NaN"),
        (params(|p| p.min_p = -0.1), "min_p must be in [0, 1], got -0.1"),
        (params(|p| p.min_p = f32::NAN), "min_p must be in [0, 1], got NaN"),
        (
            params(|p| p.repetition_penalty = 0.0),
            "repetition_penalty must be a finite number > 0, got 0",
        ),
        (
            params(|p| p.repetition_penalty = f32::NAN),
            "repetition_penalty must be a finite number > 0, got NaN",
        ),
        (
            params(|p| p.max_tokens = Some(0)),
            "max_tokens must be at least 1, got 0",
        ),
        (
            params(|p| p.presence_penalty = 2.5),
            "presence_penalty must be in [-2, 2], got 2.5",
        ),
        (
            params(|p| p.frequency_penalty = f32::NAN),
            "frequency_penalty must be in [-2, 2], got NaN",
        ),
        (
            params(|p| p.logit_bias = [(3, 1.0), (5, -101.0)].into()),
            "logit_bias[5] must be in [-100, 100], got -101",
        ),
        (
            params(|p| p.logit_bias = [(10, 1.0)].into()),
            "logit_bias: token id 10 is out of range",
        ),
        (
            params(|p| {
                p.min_tokens = 5;
                p.max_tokens = Some(4);
            }),
            "min_tokens must be at most max_tokens (4), got 5",
        ),
        (
            params(|p| p.stop_strings = vec!["a".into(), String::new()]),
            "stop_strings[1] must not be empty",
        ),
        (
            params(|p| p.stop_token_ids = vec![3, 10]),
            "stop_token_ids: token id 10 is out of range",
        ),
    ];
    for (p, want) in cases {
        let e = p.validate(10).unwrap_err().to_string();
        assert!(e.contains(want), "{e:?} should contain {want:?}");
        assert!(e.starts_with("invalid input: "), "{e}");
    }
    assert!(Sampler::new(params(|p| p.top_p = 2.0)).is_err());
}

#[test]
fn greedy_takes_lowest_id_on_ties_and_ignores_rng() {
    let mut s = Draws::new(SamplingParams::greedy()).unwrap();
    assert_eq!(s.sample(&[1.0, 3.0, -2.0, 3.0], &[]).unwrap(), 1);
    assert_eq!(s.sample(&[5.0], &[]).unwrap(), 0);
    assert_eq!(argmax(&[-1.0, -1.0]), 0);
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    for _ in 0..50 {
        let l = random_logits(&mut rng, 257);
        assert_eq!(s.sample(&l, &[]).unwrap(), argmax(&l));
    }
}

#[test]
fn same_seed_same_tokens_different_seed_different_tokens() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let rows: Vec<Vec<f32>> = (0..200).map(|_| random_logits(&mut rng, 64)).collect();
    let run = |seed: u64| {
        let p = SamplingParams {
            temperature: 1.3,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.01,
            repetition_penalty: 1.1,
            seed: Some(seed),
            ..SamplingParams::default()
        };
        let mut s = Draws::new(p).unwrap();
        let mut out: Vec<u32> = Vec::new();
        for row in &rows {
            let t = s.sample(row, &out).unwrap();
            out.push(t);
        }
        out
    };
    assert_eq!(run(42), run(42));
    assert_ne!(run(42), run(43));
    // A random seed is reported so the run can be reproduced.
    let s = Sampler::new(SamplingParams::default()).unwrap();
    let again = Sampler::new(params(|p| p.seed = Some(s.seed()))).unwrap();
    assert_eq!(again.seed(), s.seed());
}

#[test]
fn top_k_one_and_tiny_top_p_equal_greedy() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let mut k1 = Draws::new(params(|p| {
        p.top_k = 1;
        p.temperature = 2.0;
    }))
    .unwrap();
    let mut p_tiny = Draws::new(params(|p| p.top_p = 1e-6)).unwrap();
    let mut min_p_one = Draws::new(params(|p| p.min_p = 1.0)).unwrap();
    for _ in 0..300 {
        let l = random_logits(&mut rng, 1000);
        let g = argmax(&l);
        assert_eq!(k1.sample(&l, &[]).unwrap(), g);
        assert_eq!(p_tiny.sample(&l, &[]).unwrap(), g);
        assert_eq!(min_p_one.sample(&l, &[]).unwrap(), g);
    }
}

#[test]
fn unfiltered_sampling_matches_softmax() {
    let logits = [1.0f32, 2.0, 0.5, -1.0, 2.5];
    let h = histogram(params(|_| ()), &logits, 40_000);
    for (got, want) in h.iter().zip(softmax(&logits)) {
        assert!((got - want).abs() < 0.012, "{h:?}");
    }
    // Temperature 0.5 is softmax of doubled logits.
    let h = histogram(params(|p| p.temperature = 0.5), &logits, 40_000);
    let doubled: Vec<f32> = logits.iter().map(|l| l * 2.0).collect();
    for (got, want) in h.iter().zip(softmax(&doubled)) {
        assert!((got - want).abs() < 0.012, "{h:?}");
    }
}

#[test]
fn top_k_top_p_and_min_p_keep_the_right_sets() {
    // Probabilities 0.5, 0.3, 0.15, 0.05 (in shuffled id order).
    let probs = [0.15f32, 0.5, 0.05, 0.3];
    let logits: Vec<f32> = probs.iter().map(|p| p.ln()).collect();
    let renorm = |keep: &[usize]| -> Vec<f64> {
        let s: f32 = keep.iter().map(|&i| probs[i]).sum();
        (0..4)
            .map(|i| {
                if keep.contains(&i) {
                    f64::from(probs[i] / s)
                } else {
                    0.0
                }
            })
            .collect()
    };
    let check = |p: SamplingParams, keep: &[usize]| {
        let h = histogram(p, &logits, 30_000);
        for (got, want) in h.iter().zip(renorm(keep)) {
            if want == 0.0 {
                assert_eq!(*got, 0.0, "{h:?} keep {keep:?}");
            } else {
                assert!((got - want).abs() < 0.015, "{h:?} keep {keep:?}");
            }
        }
    };
    check(params(|p| p.top_k = 2), &[1, 3]);
    check(params(|p| p.top_k = 3), &[1, 3, 0]);
    check(params(|p| p.top_p = 0.7), &[1, 3]);
    check(params(|p| p.top_p = 0.85), &[1, 3, 0]);
    // min_p 0.35: keep p >= 0.35 * 0.5 = 0.175.
    check(params(|p| p.min_p = 0.35), &[1, 3]);
    check(params(|p| p.min_p = 0.1), &[1, 3, 0]);
    // Combined: top-k 3 then top-p 0.9 over the renormalized three (0.526, 0.316, 0.158) keeps all three,
    // then min-p 0.4 drops the 0.158 one.
    check(
        params(|p| {
            p.top_k = 3;
            p.top_p = 0.9;
            p.min_p = 0.4;
        }),
        &[1, 3],
    );
}

#[test]
fn repetition_penalty_follows_hf_semantics() {
    let greedy_pen = |penalty: f32| {
        Draws::new(SamplingParams {
            repetition_penalty: penalty,
            ..SamplingParams::greedy()
        })
        .unwrap()
    };
    // Positive logits are divided.
    assert_eq!(greedy_pen(2.0).sample(&[2.0, 1.9, -1.0], &[0]).unwrap(), 1);
    // Negative logits are multiplied.
    assert_eq!(greedy_pen(1.5).sample(&[-1.0, -1.2], &[0]).unwrap(), 1);
    // The penalty applies once per distinct token: 2.0 / 1.1 = 1.82 > 1.7, but 2.0 / 1.1^3 = 1.50 would not be.
    assert_eq!(greedy_pen(1.1).sample(&[2.0, 1.7], &[0, 0, 0]).unwrap(), 0);
    // A penalty below 1 encourages repetition.
    assert_eq!(greedy_pen(0.5).sample(&[1.0, 1.5], &[0]).unwrap(), 0);
    let e = greedy_pen(1.2).sample(&[1.0, 2.0], &[7]).unwrap_err().to_string();
    assert!(e.contains("previous token id 7"), "{e}");
    // With sampling the penalized logits are what gets sampled: 3.0 / 50 = 0.06 gives p0 = e^0.06 / (e^0.06 + 2).
    let mut s = Draws::new(params(|p| p.repetition_penalty = 50.0)).unwrap();
    let hits = (0..20_000)
        .filter(|_| s.sample(&[3.0, 0.0, 0.0], &[0]).unwrap() == 0)
        .count();
    let want = 0.06f64.exp() / (0.06f64.exp() + 2.0);
    assert!((hits as f64 / 20_000.0 - want).abs() < 0.015, "{hits}");
}

#[test]
fn stops_on_respects_ignore_eos() {
    // Whether generating `token` ends a request of `p` whose model's EOS id is 2.
    let stops_on = |p: &SamplingParams, token: u32| {
        let mut out = OutputStream::new(None, p, &[2], 100);
        out.push(token).expect("push").finish.is_some()
    };
    let p = params(|p| p.stop_token_ids = vec![9]);
    assert!(stops_on(&p, 9));
    assert!(stops_on(&p, 2));
    assert!(!stops_on(&p, 3));
    let p = params(|p| p.ignore_eos = true);
    assert!(!stops_on(&p, 2));
}

#[test]
fn a_tiny_temperature_is_greedy_not_a_crash() {
    let logits = [0.5f32, 2.0, -1.0, 1.9];
    for t in [1e-45f32, 1e-40, 1e-30] {
        for min_p in [0.0f32, 0.5] {
            let params = SamplingParams {
                temperature: t,
                min_p,
                seed: Some(1),
                ..SamplingParams::default()
            };
            let mut s = Draws::new(params).expect("valid");
            assert_eq!(s.sample(&logits, &[]).expect("sample"), 1, "t {t}, min_p {min_p}");
        }
    }
}

#[test]
fn uniform_draws_are_reproducible_and_in_range() {
    let params = SamplingParams {
        seed: Some(11),
        ..SamplingParams::default()
    };
    let (a, b) = (
        Sampler::new(params.clone()).expect("sampler").seed(),
        Sampler::new(params).expect("sampler").seed(),
    );
    let xs: Vec<f32> = (0..1000).map(|i| Sampler::draw_at(a, i)).collect();
    let ys: Vec<f32> = (0..1000).map(|i| Sampler::draw_at(b, i)).collect();
    assert_eq!(xs, ys, "the same seed gives the same draws");
    assert!(xs.iter().all(|u| (0.0..1.0).contains(u)));
    let mean = xs.iter().map(|&u| f64::from(u)).sum::<f64>() / xs.len() as f64;
    assert!((mean - 0.5).abs() < 0.05, "mean {mean}");
}

#[test]
fn stop_strings_are_bounded_in_number_and_length() {
    use super::{MAX_STOP_BYTES, MAX_STOP_STRINGS};
    let many = params(|p| p.stop_strings = vec!["x".into(); MAX_STOP_STRINGS]);
    assert!(many.validate(10).is_ok());
    let too_many = params(|p| p.stop_strings = vec!["x".into(); MAX_STOP_STRINGS + 1]);
    let e = too_many.validate(10).unwrap_err().to_string();
    assert!(e.contains("at most 64 strings, got 65"), "{e}");
    let long = params(|p| p.stop_strings = vec!["a".into(), "q".repeat(MAX_STOP_BYTES + 1)]);
    let e = long.validate(10).unwrap_err().to_string();
    assert!(e.contains("stop_strings[1]") && e.contains("4097"), "{e}");
    assert!(params(|p| p.stop_strings = vec!["q".repeat(MAX_STOP_BYTES)])
        .validate(10)
        .is_ok());
}

#[test]
fn additive_adjustments_follow_openai_and_vllm() {
    let p = SamplingParams {
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        logit_bias: [(1, 2.0), (4, -100.0), (6, 3.0)].into(),
        min_tokens: 5,
        stop_token_ids: vec![6],
        ..SamplingParams::greedy()
    };
    let mut bias = Vec::new();
    // Token 1 generated once: -(0.5 + 0.25) + 2; token 3 three times: -(0.5 + 0.75); 4 only biased; EOS 0 and stop
    // id 6 masked (its bias is dropped) while fewer than 5 tokens are generated.
    p.logit_bias_at(&[3, 1, 3, 3], &[0], &mut bias);
    assert_eq!(bias, [(0, MASKED), (1, 1.25), (3, -1.25), (4, -100.0), (6, MASKED)]);
    // From the 5th generated token on, nothing is masked.
    p.logit_bias_at(&[3, 1, 3, 3, 2], &[0], &mut bias);
    assert_eq!(bias, [(1, 1.25), (2, -0.75), (3, -1.25), (4, -100.0), (6, 3.0)]);
    // ignore_eos leaves EOS unmasked; stop ids still are.
    let ignore = SamplingParams {
        ignore_eos: true,
        ..p.clone()
    };
    ignore.logit_bias_at(&[], &[0], &mut bias);
    assert_eq!(bias, [(1, 2.0), (4, -100.0), (6, MASKED)]);
    // Nothing to add by default; any of them makes the request adjust its logits.
    SamplingParams::greedy().logit_bias_at(&[1, 2], &[0], &mut bias);
    assert!(bias.is_empty());
    assert!(!SamplingParams::greedy().adjusts_logits());
    assert!(p.adjusts_logits());
    // Applied as sums.
    let mut row = [1.0f32, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0];
    apply_logit_bias(&mut row, &[(1, 1.25), (3, -1.25)]);
    assert_eq!(row, [1.0, 2.25, 1.0, -0.25, 1.0, 1.0, 1.0]);
}

#[test]
fn penalties_and_bias_change_the_greedy_pick() {
    let greedy = |f: fn(&mut SamplingParams)| {
        let mut p = SamplingParams::greedy();
        f(&mut p);
        Draws::new(p).unwrap()
    };
    // Token 1 generated twice: frequency 0.3 takes 0.6 (2.0 -> 1.4 < 1.5); presence 0.3 takes 0.3 once (1.7 > 1.5).
    let logits = [0.0, 2.0, 1.5];
    assert_eq!(
        greedy(|p| p.frequency_penalty = 0.3).sample(&logits, &[1, 1]).unwrap(),
        2
    );
    assert_eq!(
        greedy(|p| p.presence_penalty = 0.3).sample(&logits, &[1, 1]).unwrap(),
        1
    );
    // A negative penalty encourages repetition.
    assert_eq!(
        greedy(|p| p.presence_penalty = -1.0)
            .sample(&[0.0, 1.0, 1.5], &[1])
            .unwrap(),
        1
    );
    // Only generated tokens count (the rank's context is the row's): nothing generated, nothing taken.
    assert_eq!(greedy(|p| p.frequency_penalty = 2.0).sample(&logits, &[]).unwrap(), 1);
    // +100 forces a token, -100 bans one.
    assert_eq!(
        greedy(|p| p.logit_bias = [(0, 100.0)].into())
            .sample(&logits, &[])
            .unwrap(),
        0
    );
    assert_eq!(
        greedy(|p| p.logit_bias = [(1, -100.0)].into())
            .sample(&logits, &[])
            .unwrap(),
        2
    );
    // min_tokens masks EOS (id 0 here) even when it is far ahead; not once enough tokens are generated.
    let eos_first = [9.0, 2.0, 1.5];
    assert_eq!(greedy(|p| p.min_tokens = 2).sample(&eos_first, &[1]).unwrap(), 1);
    assert_eq!(greedy(|p| p.min_tokens = 2).sample(&eos_first, &[1, 2]).unwrap(), 0);
    // The same with the repetition penalty first: 2.0 / 2 = 1.0, then -0.6 = 0.4 < 0.5.
    let mut both = greedy(|p| {
        p.repetition_penalty = 2.0;
        p.frequency_penalty = 0.3;
    });
    assert_eq!(both.sample(&[0.0, 2.0, 0.5], &[1, 1]).unwrap(), 2);
    // A masked token is never drawn, however hot the sampling.
    let mut hot = Draws::new(params(|p| {
        p.temperature = 5.0;
        p.min_tokens = 1;
    }))
    .unwrap();
    assert!((0..2000).all(|_| hot.sample(&[3.0, 0.0, 0.0], &[]).unwrap() != 0));
}
