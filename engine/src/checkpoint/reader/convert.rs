//! Widening stored tensor bytes (BF16, F16, F32, F64, little-endian) to f32, in parallel for large tensors.

use rayon::prelude::*;
use safetensors::tensor::Dtype;

/// Elements converted per parallel chunk: large enough to amortise rayon's scheduling, small enough to balance.
const CHUNK: usize = 1 << 16;
/// Tensors below this many elements are converted on the calling thread.
pub(super) const PARALLEL_MIN: usize = 1 << 18;

/// Converts little-endian `bytes` of `dtype` to f32; `None` for a dtype rewind does not load.
pub(super) fn to_f32(bytes: &[u8], dtype: Dtype) -> Option<Vec<f32>> {
    let width = match dtype {
        Dtype::BF16 | Dtype::F16 => 2,
        Dtype::F32 => 4,
        Dtype::F64 => 8,
        _ => return None,
    };
    let n = bytes.len() / width;
    let mut out = vec![0f32; n];
    let convert = |(dst, src): (&mut [f32], &[u8])| match dtype {
        Dtype::BF16 => bf16_to_f32(src, dst),
        Dtype::F16 => f16_to_f32(src, dst),
        Dtype::F32 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
        _ => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(8)) {
                *d = f64::from_le_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]]) as f32;
            }
        }
    };
    if n >= PARALLEL_MIN {
        out.par_chunks_mut(CHUNK)
            .zip(bytes.par_chunks(CHUNK * width))
            .for_each(convert);
    } else {
        out.chunks_mut(CHUNK).zip(bytes.chunks(CHUNK * width)).for_each(convert);
    }
    Some(out)
}

/// bf16 is the top half of an f32, so widening is exact and a shift (which the compiler vectorises).
fn bf16_to_f32(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = f32::from_bits(u32::from(u16::from_le_bytes([s[0], s[1]])) << 16);
    }
}

/// f16 goes through `half`'s slice conversion (F16C / NEON when available) via an aligned bounce buffer, since the
/// mapped bytes carry no alignment guarantee.
fn f16_to_f32(src: &[u8], dst: &mut [f32]) {
    use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
    let mut bits = [0u16; 1024];
    for (d, s) in dst.chunks_mut(bits.len()).zip(src.chunks(bits.len() * 2)) {
        let bits = &mut bits[..d.len()];
        for (b, s) in bits.iter_mut().zip(s.chunks_exact(2)) {
            *b = u16::from_le_bytes([s[0], s[1]]);
        }
        let halves: &[half::f16] = bits.reinterpret_cast();
        halves.convert_to_f32_slice(d);
    }
}
