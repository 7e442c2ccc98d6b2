//! A quantized weight taken from the checkpoint: its scale tensors found beside it, every shape and dtype checked
//! against the checkpoint's [`Method`], and the weight dequantized exactly to f32
//! (`crate::checkpoint::quant::dequant`). The scales are taken with the weight, so a scale nobody used is reported
//! like any other leftover tensor.

use safetensors::tensor::Dtype;

use super::convert::to_f32;
use super::header::Entry;
use super::source::SafetensorsSource;
use crate::checkpoint::quant::{dequant, Method};
use crate::error::{EngineError, Result};
use crate::model::tensors::shape_error;

fn bad(name: &str, what: String) -> EngineError {
    EngineError::Checkpoint(format!("quantized tensor `{name}`: {what}"))
}

/// Whether `shape` holds one value: `[]` or `[1]`.
fn is_scalar(shape: &[usize]) -> bool {
    shape.iter().product::<usize>() == 1 && shape.len() <= 1
}

impl SafetensorsSource {
    /// The shape a model asks for when it takes the tensor of `entry`: NVFP4 packs two elements per stored byte.
    pub(super) fn logical_shape(&self, entry: &Entry) -> Vec<usize> {
        let mut shape = entry.shape.clone();
        let packed = entry.dtype == Dtype::U8
            && self
                .quant
                .as_ref()
                .is_some_and(|q| matches!(q.method, Method::Nvfp4 { .. }));
        if let (true, Some(last)) = (packed, shape.last_mut()) {
            *last *= 2;
        }
        shape
    }

    fn bytes(&self, entry: &Entry) -> &[u8] {
        &self.shards[entry.shard].mmap[entry.start..entry.end]
    }

    /// Takes scale tensor `name` (an f32 / bf16 / f16 one): its shape and values.
    fn take_scale(&mut self, weight: &str, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let entry = self
            .entries
            .get(name)
            .filter(|_| !self.taken.contains(name))
            .ok_or_else(|| bad(weight, format!("its scale `{name}` is missing")))?;
        let values = to_f32(self.bytes(entry), entry.dtype).ok_or_else(|| {
            bad(
                weight,
                format!(
                    "its scale `{name}` has dtype {}, expected F32, BF16 or F16",
                    entry.dtype
                ),
            )
        })?;
        let shape = entry.shape.clone();
        self.taken.insert(name.to_string());
        Ok((shape, values))
    }

    /// Takes a static activation scale `name` if the checkpoint has one (a scalar): quantized kernels would use it;
    /// the exact weights do not need it.
    fn take_activation_scale(&mut self, weight: &str, name: &str) -> Result<()> {
        if self.entries.contains_key(name) && !self.taken.contains(name) {
            let (shape, values) = self.take_scale(weight, name)?;
            if !is_scalar(&shape) || !values[0].is_finite() {
                return Err(bad(
                    weight,
                    format!("its activation scale `{name}` must be one finite value, got shape {shape:?}"),
                ));
            }
        }
        Ok(())
    }

    /// Dequantizes weight `name`, which the model takes as `shape`, with its scales.
    pub(super) fn dequantize(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let entry = &self.entries[name];
        let dtype = entry.dtype;
        let Some(method) = self.quant.as_ref().map(|q| q.method) else {
            return Err(bad(
                name,
                format!("stored as {dtype}, but the checkpoint's config.json has no quantization_config saying how"),
            ));
        };
        let base = name.strip_suffix(".weight").ok_or_else(|| {
            bad(
                name,
                format!("stored as {dtype}, but only `.weight` tensors are quantized"),
            )
        })?;
        if shape.len() < 2 {
            return Err(bad(
                name,
                format!("a quantized weight must be a matrix, the model takes {shape:?}"),
            ));
        }
        let logical = self.logical_shape(entry);
        if logical != shape {
            return Err(shape_error(name, &logical, shape));
        }
        let lead: Vec<usize> = shape[..shape.len() - 2].to_vec();
        let (rows, cols) = (shape[shape.len() - 2], shape[shape.len() - 1]);
        match method {
            Method::Fp8 { block } => {
                if dtype != Dtype::F8_E4M3 {
                    return Err(bad(
                        name,
                        format!("stored as {dtype}, an fp8 checkpoint stores F8_E4M3"),
                    ));
                }
                let (sshape, scales) = self.take_scale(name, &format!("{base}.weight_scale_inv"))?;
                self.take_activation_scale(name, &format!("{base}.input_scale"))?;
                let codes = self.bytes(&self.entries[name]);
                match block {
                    Some(b) => {
                        let want = [lead, vec![rows.div_ceil(b[0]), cols.div_ceil(b[1])]].concat();
                        if sshape != want {
                            return Err(bad(
                                name,
                                format!(
                                    "`{base}.weight_scale_inv` has shape {sshape:?}, {b:?} blocks of {shape:?} need {want:?}"
                                ),
                            ));
                        }
                        Ok(dequant::fp8_blocks(codes, shape, &scales, b))
                    }
                    None if is_scalar(&sshape) => Ok(dequant::fp8_scaled(codes, shape, &scales)),
                    None => Err(bad(
                        name,
                        format!(
                            "`{base}.weight_scale_inv` has shape {sshape:?}; without weight_block_size it is one value"
                        ),
                    )),
                }
            }
            Method::ModelOptFp8 => {
                if dtype != Dtype::F8_E4M3 {
                    return Err(bad(
                        name,
                        format!("stored as {dtype}, a ModelOpt FP8 checkpoint stores F8_E4M3"),
                    ));
                }
                let (sshape, scales) = self.take_scale(name, &format!("{base}.weight_scale"))?;
                self.take_activation_scale(name, &format!("{base}.input_scale"))?;
                let per_row = lead.iter().product::<usize>() * rows;
                let per_row_shape = sshape.iter().product::<usize>() == per_row
                    && (sshape == [lead.clone(), vec![rows]].concat()
                        || sshape == [lead.clone(), vec![rows, 1]].concat());
                if !is_scalar(&sshape) && !per_row_shape {
                    return Err(bad(
                        name,
                        format!("`{base}.weight_scale` has shape {sshape:?}: expected one value or one per row of {shape:?}"),
                    ));
                }
                let codes = self.bytes(&self.entries[name]);
                Ok(dequant::fp8_scaled(codes, shape, &scales))
            }
            Method::Nvfp4 { group } => {
                if dtype != Dtype::U8 {
                    return Err(bad(
                        name,
                        format!("stored as {dtype}, an NVFP4 checkpoint packs weights as U8"),
                    ));
                }
                if cols % group != 0 {
                    return Err(bad(
                        name,
                        format!("{cols} columns are not a whole number of {group}-element groups"),
                    ));
                }
                let sname = format!("{base}.weight_scale");
                let sentry = self
                    .entries
                    .get(&sname)
                    .filter(|_| !self.taken.contains(&sname))
                    .ok_or_else(|| bad(name, format!("its scale `{sname}` is missing")))?;
                let want = [lead, vec![rows, cols / group]].concat();
                if sentry.dtype != Dtype::F8_E4M3 || sentry.shape != want {
                    return Err(bad(
                        name,
                        format!(
                            "`{sname}` is {} {:?}, expected F8_E4M3 {want:?} (one scale per {group} elements)",
                            sentry.dtype, sentry.shape
                        ),
                    ));
                }
                let (gshape, global) = self.take_scale(name, &format!("{base}.weight_scale_2"))?;
                if !is_scalar(&gshape) || !global[0].is_finite() {
                    return Err(bad(
                        name,
                        format!("`{base}.weight_scale_2` must be one finite value, got shape {gshape:?}"),
                    ));
                }
                self.take_activation_scale(name, &format!("{base}.input_scale"))?;
                self.taken.insert(sname.clone());
                let scales = self.bytes(&self.entries[&sname]);
                let packed = self.bytes(&self.entries[name]);
                Ok(dequant::nvfp4(packed, shape, scales, global[0], group))
            }
        }
    }
}
