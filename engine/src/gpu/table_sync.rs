//! Block tables kept on the device and updated in place: the host remembers what it last uploaded and sends only
//! the runs of entries that changed since, so a step in which a few sequences crossed into a new KV block uploads a
//! few words, not every slot's table (at 256 sequences of 32k tokens that is half a megabyte a step).

use rewind_kernels::cuda::{CudaDevice, CudaSlice};

use crate::error::{EngineError, Result};

/// Unchanged entries between two changed runs up to which the runs are sent as one copy: a copy costs a few
/// microseconds of host time whatever its size, a few hundred bytes more cost nothing.
const MERGE_GAP: usize = 64;

/// The ranges of `new` that differ from `old` (all of `new` when the lengths differ), runs closer than `gap`
/// unchanged entries merged.
pub(crate) fn changed_runs(old: &[i32], new: &[i32], gap: usize) -> Vec<std::ops::Range<usize>> {
    if old.len() != new.len() {
        return std::iter::once(0..new.len()).filter(|r| !r.is_empty()).collect();
    }
    let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
    let mut i = 0;
    while i < new.len() {
        if old[i] == new[i] {
            i += 1;
            continue;
        }
        let start = i;
        while i < new.len() && old[i] != new[i] {
            i += 1;
        }
        match runs.last_mut() {
            Some(last) if start - last.end <= gap => last.end = i,
            _ => runs.push(start..i),
        }
    }
    runs
}

/// What a device table holds, as last uploaded.
#[derive(Default)]
pub(crate) struct TableMirror {
    host: Vec<i32>,
}

impl TableMirror {
    /// Makes `buf` hold `new` (at its front), uploading only the entries that differ from the last upload.
    pub(crate) fn sync(&mut self, dev: &CudaDevice, buf: &mut CudaSlice<i32>, new: &[i32], what: &str) -> Result<()> {
        if new.len() > buf.len() {
            return Err(EngineError::InvalidInput(format!(
                "{} entries of {what} do not fit the rank's buffer of {}",
                new.len(),
                buf.len()
            )));
        }
        for r in changed_runs(&self.host, new, MERGE_GAP) {
            dev.stream()
                .memcpy_htod(&new[r.clone()], &mut buf.slice_mut(r.clone()))
                .map_err(|e| EngineError::Gpu(format!("uploading {what}: {e}")))?;
        }
        if self.host.len() == new.len() {
            self.host.copy_from_slice(new);
        } else {
            self.host = new.to_vec();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_changed_runs_are_sent_and_near_runs_merge() {
        let old = vec![0i32; 20];
        let mut new = old.clone();
        new[2] = 5;
        new[3] = 6;
        new[6] = 7;
        new[15] = 8;
        // Runs 2..4 and 6..7 are two apart: merged at gap 2, not at gap 1; 15 stays alone.
        assert_eq!(changed_runs(&old, &new, 2), vec![2..7, 15..16]);
        assert_eq!(changed_runs(&old, &new, 1), vec![2..4, 6..7, 15..16]);
        // Nothing changed: nothing sent; a change at the very end is found.
        assert!(changed_runs(&old, &old, 4).is_empty());
        let mut end = old.clone();
        end[19] = 1;
        assert_eq!(changed_runs(&old, &end, 0), vec![19..20]);
        // A first upload (or a table of another size) is sent whole.
        assert_eq!(changed_runs(&[], &new, 4), vec![0..20]);
        assert_eq!(changed_runs(&old[..4], &new, 4), vec![0..20]);
        assert!(changed_runs(&old, &[], 4).is_empty());
    }
}
