//! The resource use ptxas reports per entry point when NVRTC runs it verbosely (`--ptxas-options=-v`): registers a
//! thread, stack frame and spills. `rewind compile-kernels` prints it for every kernel module and target without a GPU,
//! so a change that makes a kernel spill shows before any device run.

/// One entry point's resource use, as ptxas reported it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EntryUse {
    /// The entry point's (unmangled, `extern "C"`) name.
    pub name: String,
    /// Registers a thread.
    pub registers: u32,
    /// Stack frame, bytes a thread.
    pub stack_bytes: u32,
    /// Bytes spilled to local memory (stores), a thread.
    pub spill_stores: u32,
    /// Bytes read back from spills, a thread.
    pub spill_loads: u32,
}

impl EntryUse {
    /// Whether the entry point spills registers to local memory.
    pub fn spills(&self) -> bool {
        self.spill_stores > 0 || self.spill_loads > 0
    }
}

/// The number in `text` just before `unit` (`"128 registers"` → 128), if any.
fn count_before(text: &str, unit: &str) -> Option<u32> {
    let at = text.find(unit)?;
    text[..at].split_whitespace().last()?.parse().ok()
}

/// The text between the first pair of single quotes after `prefix`.
fn quoted_after<'a>(line: &'a str, prefix: &str) -> Option<&'a str> {
    let rest = &line[line.find(prefix)? + prefix.len()..];
    let start = rest.find('\'')? + 1;
    let len = rest[start..].find('\'')?;
    Some(&rest[start..start + len])
}

/// The entry points of a verbose ptxas log, in the order it compiled them. A stack / spill line belongs to the
/// function its "Function properties for" line names, so a called device function's properties never land on an
/// entry point.
pub fn parse(log: &str) -> Vec<EntryUse> {
    let mut entries: Vec<EntryUse> = Vec::new();
    let mut props_for: Option<String> = None;
    for line in log.lines() {
        if let Some(name) = quoted_after(line, "Compiling entry function") {
            entries.push(EntryUse {
                name: name.to_string(),
                ..EntryUse::default()
            });
            props_for = None;
        } else if let Some(at) = line.find("Function properties for ") {
            props_for = Some(line[at + "Function properties for ".len()..].trim().to_string());
        } else if line.contains("bytes stack frame") {
            let entry = entries
                .last_mut()
                .filter(|e| props_for.as_deref() == Some(e.name.as_str()));
            if let Some(e) = entry {
                e.stack_bytes = count_before(line, "bytes stack frame").unwrap_or(0);
                e.spill_stores = count_before(line, "bytes spill stores").unwrap_or(0);
                e.spill_loads = count_before(line, "bytes spill loads").unwrap_or(0);
            }
        } else if let Some(n) = line
            .contains("Used ")
            .then(|| count_before(line, "registers"))
            .flatten()
        {
            if let Some(e) = entries.last_mut() {
                e.registers = n;
            }
        }
    }
    entries
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What NVRTC 13.0's ptxas printed for two entry points of `replay_gdn` and one with a called function.
    const LOG: &str = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'gdn_replay_nc4_sb4_bf16' for 'sm_90'
ptxas info    : Function properties for gdn_replay_nc4_sb4_bf16
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 127 registers, used 0 barriers
ptxas info    : Compiling entry function 'gdn_replay_nc8_sb1_f32' for 'sm_90'
ptxas info    : Function properties for gdn_replay_nc8_sb1_f32
ptxas         .     112 bytes stack frame, 336 bytes spill stores, 208 bytes spill loads
ptxas info    : Used 80 registers, used 0 barriers, 112 bytes cumulative stack size
ptxas info    : Function properties for helper
ptxas         .     64 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Compiling entry function 'attn' for 'sm_100'
ptxas info    : Function properties for attn
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers, 384 bytes smem, 400 bytes cmem[0]
";

    #[test]
    fn reads_each_entry_points_registers_stack_and_spills() {
        let e = parse(LOG);
        assert_eq!(e.len(), 3);
        assert_eq!(
            e[0],
            EntryUse {
                name: "gdn_replay_nc4_sb4_bf16".into(),
                registers: 127,
                ..EntryUse::default()
            }
        );
        assert_eq!(
            (e[1].registers, e[1].stack_bytes, e[1].spill_stores, e[1].spill_loads),
            (80, 112, 336, 208)
        );
        assert!(e[1].spills() && !e[0].spills());
        // The helper's properties do not overwrite the entry point's; the last entry reads its smem line's registers.
        assert_eq!((e[2].name.as_str(), e[2].registers, e[2].stack_bytes), ("attn", 96, 0));
    }

    #[test]
    fn a_log_without_entry_points_gives_none() {
        assert!(parse("").is_empty());
        assert!(parse("ptxas info    : 0 bytes gmem\n").is_empty());
    }
}
