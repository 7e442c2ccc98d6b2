//! Elementwise activations, matching PyTorch's definitions in f32.

/// `x · σ(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `σ(x) = 1 / (1 + e^{−x})`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// PyTorch's `softplus` with `beta = 1, threshold = 20`: linear above the threshold.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `relu(x)²`, Nemotron-H's MLP activation.
#[inline]
pub fn relu2(x: f32) -> f32 {
    let r = x.max(0.0);
    r * r
}

/// Applies `f` to every element in place.
pub fn map_inplace(xs: &mut [f32], f: impl Fn(f32) -> f32) {
    for x in xs {
        *x = f(*x);
    }
}

/// `out[i] = silu(gate[i]) · up[i]` (SwiGLU), written into `gate`.
pub fn swiglu_inplace(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "swiglu: gate and up differ in length");
    for (g, u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
        assert!((sigmoid(0.0) - 0.5).abs() < 1e-7);
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-6);
        assert_eq!(softplus(25.0), 25.0);
        assert!((softplus(-30.0) - (-30.0f32).exp()).abs() < 1e-12);
        assert_eq!(relu2(-2.0), 0.0);
        assert_eq!(relu2(3.0), 9.0);
    }
}
