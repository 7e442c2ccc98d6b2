//! Depthwise causal conv1d, carrying the previous `K − 1` inputs as state.

/// Depthwise causal conv1d over `seq` steps of `channels` inputs (`x` is `[seq, channels]`).
///
/// `weight` is `[channels, K]` (HF's `[channels, 1, K]` squeezed), `state` is `[K − 1, channels]` holding the previous
/// `K − 1` inputs, oldest first (zeros for a new sequence); it is updated to the last `K − 1` inputs. The output is
/// written to `out` (`[seq, channels]`) without activation.
pub fn causal_conv1d(
    x: &[f32],
    seq: usize,
    channels: usize,
    weight: &[f32],
    bias: Option<&[f32]>,
    state: &mut [f32],
    out: &mut [f32],
) {
    assert!(
        channels > 0 && weight.len().is_multiple_of(channels),
        "conv1d: weight is not [channels, K]"
    );
    let k = weight.len() / channels;
    assert!(k >= 1, "conv1d: kernel width 0");
    assert_eq!(x.len(), seq * channels, "conv1d: x");
    assert_eq!(out.len(), seq * channels, "conv1d: out");
    assert_eq!(state.len(), (k - 1) * channels, "conv1d: state");
    if let Some(b) = bias {
        assert_eq!(b.len(), channels, "conv1d: bias");
    }
    // Input at time t - (K-1) + j, with t >= 0 in x and negative times in the state.
    let input = |time: isize, c: usize| -> f32 {
        if time >= 0 {
            x[time as usize * channels + c]
        } else {
            state[((k - 1) as isize + time) as usize * channels + c]
        }
    };
    for t in 0..seq {
        for c in 0..channels {
            let mut acc = bias.map_or(0.0, |b| b[c]);
            for j in 0..k {
                acc += weight[c * k + j] * input(t as isize - (k - 1) as isize + j as isize, c);
            }
            out[t * channels + c] = acc;
        }
    }
    if k > 1 {
        let mut next = vec![0.0f32; state.len()];
        for (slot, row) in next.chunks_exact_mut(channels).enumerate() {
            let time = seq as isize - (k - 1) as isize + slot as isize;
            for (c, v) in row.iter_mut().enumerate() {
                *v = input(time, c);
            }
        }
        state.copy_from_slice(&next);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_sequence_matches_whole() {
        let (channels, k, seq) = (3, 4, 9);
        let x: Vec<f32> = (0..seq * channels).map(|i| (i as f32 * 0.37).sin()).collect();
        let w: Vec<f32> = (0..channels * k).map(|i| (i as f32 * 0.11).cos()).collect();
        let b = [0.1, -0.2, 0.3];
        let mut s_whole = vec![0.0; (k - 1) * channels];
        let mut whole = vec![0.0; seq * channels];
        causal_conv1d(&x, seq, channels, &w, Some(&b), &mut s_whole, &mut whole);
        let mut s = vec![0.0; (k - 1) * channels];
        let mut parts = Vec::new();
        for (start, len) in [(0, 2), (2, 1), (3, 6)] {
            let mut o = vec![0.0; len * channels];
            causal_conv1d(
                &x[start * channels..(start + len) * channels],
                len,
                channels,
                &w,
                Some(&b),
                &mut s,
                &mut o,
            );
            parts.extend(o);
        }
        assert!(whole.iter().zip(&parts).all(|(a, b)| (a - b).abs() < 1e-6));
        assert_eq!(s, s_whole);
        // First output of channel 0 sees only x[0] (zero history): w[0, K-1]·x + b.
        assert!((whole[0] - (w[k - 1] * x[0] + b[0])).abs() < 1e-6);
    }
}
