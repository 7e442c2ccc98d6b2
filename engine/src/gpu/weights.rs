//! Device copies of a rank's weights: bf16 matrices and norm weights, f32 per-head parameters, and the column maps
//! (`gather_cols` indices) each layer uses to split its projections.

use rayon::prelude::*;
use rewind_kernels::cuda::{CudaDevice, CudaSlice};

use crate::error::Result;

/// Converts to the storage type (round to nearest even for bf16) on all cores and uploads.
pub(crate) fn stored<A: super::Act>(dev: &CudaDevice, data: &[f32]) -> Result<CudaSlice<A>> {
    let v: Vec<A> = data.par_iter().map(|&x| A::from_f32(x)).collect();
    Ok(dev.upload(&v)?)
}

/// Uploads in the activation type (the weights elementwise kernels read next to activations: norms, conv).
pub(crate) fn act_of<A: super::Act>(dev: &CudaDevice, data: &[f32]) -> Result<CudaSlice<A>> {
    Ok(dev.upload_as::<A>(data)?)
}

/// Uploads f32 values as they are.
pub(crate) fn f32_of(dev: &CudaDevice, data: &[f32]) -> Result<CudaSlice<f32>> {
    Ok(dev.upload(data)?)
}

/// Uploads a column map (indices fit i32: every width is checked below 2³¹ by the kernels' wrappers).
pub(crate) fn idx_of(dev: &CudaDevice, idx: &[usize]) -> Result<CudaSlice<i32>> {
    let v: Vec<i32> = idx.iter().map(|&i| i as i32).collect();
    Ok(dev.upload(&v)?)
}

/// `x · Wᵀ (+ b)`: a weight `[out, in]` in the storage type and an optional f32 bias.
pub(crate) struct DeviceLinear<A: super::Act> {
    pub(crate) w: CudaSlice<A>,
    pub(crate) b: Option<CudaSlice<f32>>,
    pub(crate) in_dim: usize,
    pub(crate) out_dim: usize,
}

impl<A: super::Act> DeviceLinear<A> {
    pub(crate) fn new(dev: &CudaDevice, w: &[f32], b: Option<&[f32]>, out_dim: usize, in_dim: usize) -> Result<Self> {
        debug_assert_eq!(w.len(), out_dim * in_dim);
        Ok(DeviceLinear {
            w: stored(dev, w)?,
            b: b.map(|b| f32_of(dev, b)).transpose()?,
            in_dim,
            out_dim,
        })
    }
}

/// `start .. start + len`, as a column map.
pub(crate) fn range_idx(start: usize, len: usize) -> Vec<usize> {
    (start..start + len).collect()
}

/// Columns of groups `virtual_groups` (indices into the `width`-wide groups that start at column `start`), in order:
/// expands the B/C (or q/k) groups a tensor-parallel rank holds to its virtual groups.
pub(crate) fn group_idx(start: usize, width: usize, virtual_groups: &[usize]) -> Vec<usize> {
    virtual_groups
        .iter()
        .flat_map(|&g| start + g * width..start + (g + 1) * width)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_maps() {
        assert_eq!(range_idx(3, 2), vec![3, 4]);
        assert_eq!(group_idx(10, 2, &[0, 0, 1]), vec![10, 11, 10, 11, 12, 13]);
    }
}
