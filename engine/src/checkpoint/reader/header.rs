//! Mapping one safetensors file and reading its header into tensor entries with absolute byte ranges, every
//! malformation an error that names the file.

use std::fs::File;
use std::path::Path;

use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensorError};
use safetensors::SafeTensors;

use crate::error::{EngineError, Result};

/// Where one tensor lives: its shard and the absolute byte range in that shard's mapping.
#[derive(Debug)]
pub(super) struct Entry {
    pub(super) shard: usize,
    pub(super) dtype: Dtype,
    pub(super) shape: Vec<usize>,
    pub(super) start: usize,
    pub(super) end: usize,
}

pub(super) fn map_file(path: &Path) -> Result<Mmap> {
    let file = File::open(path).map_err(|e| EngineError::io(path, e))?;
    let len = file.metadata().map_err(|e| EngineError::io(path, e))?.len();
    if len < 8 {
        return Err(EngineError::Checkpoint(format!(
            "{}: file is {len} bytes, too short to hold a safetensors header",
            path.display()
        )));
    }
    // SAFETY: the mapping is read-only. Like every mmap-based loader (transformers, candle), this assumes nobody
    // truncates or rewrites the checkpoint while it is open; doing so is outside what rewind can defend against.
    unsafe { Mmap::map(&file) }.map_err(|e| EngineError::io(path, e))
}

/// Parses a shard's header into entries with absolute byte ranges, turning every malformation into an error that
/// names the file.
pub(super) fn parse_header(path: &Path, buf: &[u8], shard: usize) -> Result<Vec<(String, Entry)>> {
    let (n, metadata) = SafeTensors::read_metadata(buf).map_err(|e| header_error(path, buf, e))?;
    let base = 8 + n;
    Ok(metadata
        .tensors()
        .into_iter()
        .map(|(name, info)| {
            let entry = Entry {
                shard,
                dtype: info.dtype,
                shape: info.shape.clone(),
                start: base + info.data_offsets.0,
                end: base + info.data_offsets.1,
            };
            (name, entry)
        })
        .collect())
}

fn header_error(path: &Path, buf: &[u8], e: SafeTensorError) -> EngineError {
    let declared = buf
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_le_bytes);
    let what = match e {
        SafeTensorError::InvalidHeaderLength | SafeTensorError::HeaderTooLarge => format!(
            "header declares {declared} bytes but only {} follow its 8-byte length (truncated, or not a safetensors file)",
            buf.len().saturating_sub(8)
        ),
        SafeTensorError::MetadataIncompleteBuffer => format!(
            "the header's tensors do not cover the {} data bytes exactly (file truncated or corrupt)",
            (buf.len() as u64).saturating_sub(8 + declared)
        ),
        other => format!("malformed safetensors header: {other}"),
    };
    EngineError::Checkpoint(format!("{}: {what}", path.display()))
}
