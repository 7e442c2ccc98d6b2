//! Device copies of a rank's weights: bf16 matrices and norm weights, f32 per-head parameters, and the column
//! selections ([`Cols`]) each layer uses to split its projections.

use rayon::prelude::*;
use rewind_kernels::cuda::ops;
use rewind_kernels::cuda::{CudaDevice, CudaSlice, CudaView, DevicePtr, DevicePtrMut, Elem};

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

/// Columns a layer takes out of a wider row (a projection's, the conv output's). Without tensor parallelism every
/// split is a contiguous range, which the kernels that take a row stride read in place and the others copy in
/// 16-byte vectors; a rank's expanded groups may repeat columns, and go through an index map.
pub(crate) enum Cols {
    Range { start: usize, len: usize },
    Map(CudaSlice<i32>),
}

impl Cols {
    /// The selection of `idx`: a range when the columns are consecutive, else an index map. With `REWIND_COLS_MAP=1`
    /// every selection is an index map, as a tensor-parallel rank's repeated groups are: the way to run that path
    /// (the gathers, the strided kernels over gathered rows) on one GPU, e.g. under `rewind selftest`.
    pub(crate) fn new(dev: &CudaDevice, idx: &[usize]) -> Result<Cols> {
        if std::env::var_os("REWIND_COLS_MAP").is_some_and(|v| v == "1") {
            return Ok(Cols::Map(idx_of(dev, idx)?));
        }
        match contiguous(idx) {
            Some(start) => Ok(Cols::Range { start, len: idx.len() }),
            None => Ok(Cols::Map(idx_of(dev, idx)?)),
        }
    }

    /// How many columns the selection takes.
    pub(crate) fn len(&self) -> usize {
        match self {
            Cols::Range { len, .. } => *len,
            Cols::Map(idx) => idx.len(),
        }
    }

    /// The selected columns of `rows` rows of `src` (`width` wide) for a kernel that takes a row stride: in place in
    /// `src` (rows `width` apart) when the selection is a range, else gathered into `scratch` (rows `len` apart).
    /// Returns the view and its row stride.
    pub(crate) fn strided<'a, T: Elem>(
        &self,
        dev: &CudaDevice,
        src: &'a CudaSlice<T>,
        rows: usize,
        width: usize,
        scratch: &'a mut CudaSlice<T>,
    ) -> Result<(CudaView<'a, T>, usize)> {
        let n = self.len();
        if let Cols::Range { start, .. } = self {
            // An empty step has no rows to start a range in.
            let from = if rows == 0 { 0 } else { *start };
            return Ok((src.slice(from..rows * width), width));
        }
        self.gather(
            dev,
            &src.slice(..rows * width),
            rows,
            width,
            &mut scratch.slice_mut(..rows * n),
        )?;
        let scratch: &'a CudaSlice<T> = scratch;
        Ok((scratch.slice(..rows * n), n))
    }

    /// `out[r, j] = src[r, column j]` for `rows` rows of `width`.
    pub(crate) fn gather<T: Elem>(
        &self,
        dev: &CudaDevice,
        src: &impl DevicePtr<T>,
        rows: usize,
        width: usize,
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        match self {
            Cols::Range { start, len } => ops::copy_cols(dev, src, rows, width, *start, *len, out)?,
            Cols::Map(idx) => ops::gather_cols(dev, src, rows, width, idx, out)?,
        }
        Ok(())
    }
}

/// The first of `idx` when its columns are consecutive (an empty list is the empty range at 0).
fn contiguous(idx: &[usize]) -> Option<usize> {
    let start = idx.first().copied().unwrap_or(0);
    idx.iter().enumerate().all(|(j, &c)| c == start + j).then_some(start)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_maps() {
        assert_eq!(range_idx(3, 2), vec![3, 4]);
        assert_eq!(group_idx(10, 2, &[0, 0, 1]), vec![10, 11, 10, 11, 12, 13]);
    }

    #[test]
    fn ranges_are_told_from_maps() {
        assert_eq!(contiguous(&range_idx(7, 5)), Some(7));
        assert_eq!(contiguous(&group_idx(10, 2, &[0, 1, 2])), Some(10));
        // A rank's expanded groups repeat columns; a permutation is not a range either.
        assert_eq!(contiguous(&group_idx(10, 2, &[0, 0, 1])), None);
        assert_eq!(contiguous(&[3, 5, 4]), None);
        assert_eq!(contiguous(&[]), Some(0));
    }
}
