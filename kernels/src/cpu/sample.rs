//! CPU twins of the device token-selection kernels: [`argmax`] (greedy) with the engine Sampler's tie rule.

/// Index of the largest value, the lowest index on ties (−0 and +0 are equal), as the engine's `sample::argmax`.
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in values.iter().enumerate().skip(1) {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_the_lowest_index_of_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]), 1);
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, -1e30]), 1);
    }
}
