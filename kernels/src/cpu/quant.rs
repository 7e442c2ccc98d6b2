//! The 8- and 4-bit number formats of quantized checkpoints, decoded and encoded exactly: FP8 E4M3 ("fn": no
//! infinities, one NaN code per sign, largest finite 448) and FP4 E2M1 (NVFP4's elements: ±{0, 0.5, 1, 1.5, 2, 3, 4,
//! 6}), and one row of each published weight layout dequantized with them. They live below the engine so that the
//! checkpoint reader (`rewind-engine`'s `checkpoint::quant::dequant`) and the quantized GEMVs' CPU twins
//! ([`super::gemv_quant`]) share one definition of every weight value.

/// The largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;
/// The largest E2M1 value.
pub const E2M1_MAX: f32 = 6.0;

/// The value of E4M3 code `b` (bit 7 sign, bits 6–3 exponent with bias 7, bits 2–0 mantissa); NaN for 0x7F / 0xFF.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((b >> 3) & 0x0F);
    let man = f32::from(b & 0x07);
    if exp == 0x0F && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    let mag = if exp == 0 {
        man / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    };
    sign * mag
}

/// The E4M3 code nearest to `x` (ties to the even code), saturating at ±448 as quantizers clamp before casting; NaN
/// gives the NaN code.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    sign | nearest(x.abs().min(E4M3_MAX), 0x7E, e4m3_to_f32)
}

/// The value of E2M1 code `n` (its low 4 bits: bit 3 sign, bits 2–1 exponent with bias 1, bit 0 mantissa).
pub fn e2m1_to_f32(n: u8) -> f32 {
    const MAGNITUDES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let mag = MAGNITUDES[usize::from(n & 0x07)];
    if n & 0x08 != 0 {
        -mag
    } else {
        mag
    }
}

/// The E2M1 code nearest to `x` (ties to the even code), saturating at ±6.
pub fn f32_to_e2m1(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x08 } else { 0 };
    let mag = if x.is_nan() { 0.0 } else { x.abs().min(E2M1_MAX) };
    sign | nearest(mag, 0x07, e2m1_to_f32)
}

/// The code in `0..=top` whose (increasing) value `decode` is nearest to `mag` ≥ 0, ties to the even code.
fn nearest(mag: f32, top: u8, decode: fn(u8) -> f32) -> u8 {
    // Codes 0..=top of the positive half decode in increasing order, so the answer is next to the first code at or
    // above `mag`.
    let (mut lo, mut hi) = (0u8, top);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if decode(mid) < mag {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    if lo == 0 {
        return 0;
    }
    let (below, above) = (decode(lo - 1), decode(lo));
    let (d_below, d_above) = (mag - below, above - mag);
    if d_below < d_above || (d_below == d_above && (lo - 1) % 2 == 0) {
        lo - 1
    } else {
        lo
    }
}

/// One row of a fine-grained FP8 weight: `out[i] = e4m3(codes[i]) · scales[i / block_cols]` (`scales` is the row's
/// run of the block grid; the last block may be partial).
pub fn dequant_fp8_row(codes: &[u8], scales: &[f32], block_cols: usize, out: &mut [f32]) {
    for (i, (d, &c)) in out.iter_mut().zip(codes).enumerate() {
        *d = e4m3_to_f32(c) * scales[i / block_cols];
    }
}

/// One row of an FP8 weight with a single scale for the row (per tensor or per output row): `out[i] = e4m3(codes[i])
/// · scale`.
pub fn dequant_fp8_row_scaled(codes: &[u8], scale: f32, out: &mut [f32]) {
    for (d, &c) in out.iter_mut().zip(codes) {
        *d = e4m3_to_f32(c) * scale;
    }
}

/// One row of an NVFP4 weight: two E2M1 elements per byte of `packed` (element `2j` in the low nibble, `2j + 1` in
/// the high one), one E4M3 code in `scales` per `group` consecutive elements, and the tensor's f32 `global` scale:
/// `out[i] = e2m1 · (e4m3(scale) · global)`. `out` holds the row's `2 · packed.len()` elements.
pub fn dequant_nvfp4_row(packed: &[u8], scales: &[u8], global: f32, group: usize, out: &mut [f32]) {
    for (j, &byte) in packed.iter().enumerate() {
        let scale = e4m3_to_f32(scales[2 * j / group]) * global;
        out[2 * j] = e2m1_to_f32(byte & 0x0F) * scale;
        out[2 * j + 1] = e2m1_to_f32(byte >> 4) * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_decodes_the_published_table() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0xB8), -1.0);
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
    }

    #[test]
    fn every_finite_e4m3_code_round_trips_and_rounding_is_to_nearest_even() {
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            if v.is_nan() || (v == 0.0 && b & 0x80 != 0) {
                continue;
            }
            assert_eq!(f32_to_e4m3(v), b, "code {b:#04x} ({v})");
        }
        // 1 + 1/16 lies halfway between 1 (0x38, even) and 1.125 (0x39): to the even code.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.0626), 0x39);
        assert_eq!(f32_to_e4m3(1e6), 0x7E);
        assert_eq!(f32_to_e4m3(-1e6), 0xFE);
        assert_eq!(f32_to_e4m3(1e-12), 0x00);
    }

    #[test]
    fn e2m1_round_trips_and_rounds_to_nearest_even() {
        for n in 0..16u8 {
            let v = e2m1_to_f32(n);
            if n == 0x08 {
                continue;
            }
            assert_eq!(f32_to_e2m1(v), n, "code {n} ({v})");
        }
        assert_eq!(f32_to_e2m1(0.25), 0); // halfway 0 / 0.5: to 0
        assert_eq!(f32_to_e2m1(2.5), 4); // halfway 2 / 3: to 2 (code 4)
        assert_eq!(f32_to_e2m1(5.0), 6); // halfway 4 / 6: to 4 (code 6)
        assert_eq!(f32_to_e2m1(100.0), 7);
        assert_eq!(f32_to_e2m1(-0.75), 0x08 | 2); // halfway 0.5 / 1: to 1 (code 2)
    }
}
