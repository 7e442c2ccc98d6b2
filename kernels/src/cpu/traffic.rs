//! Memory traffic accounting: every decode-path op reports the bytes a GPU kernel doing the same work must move, so the
//! CUDA kernels can be judged against these numbers (their byte roofline) and the byte models of ReplaySSM.
//!
//! Conventions (the GPU layout, whatever precision the CPU reference computes in): SSM states are fp32; ring entries'
//! vectors (x, B, u, k, ...) are bf16 (2 bytes an element); per-head scalars (dt, g, β) are fp32.

use std::ops::{Add, AddAssign};

/// Bytes moved by one op, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Checkpoint / recurrent state read.
    pub state_read: u64,
    /// Checkpoint / recurrent state written (including per-draft snapshots).
    pub state_written: u64,
    /// Input ring entries read.
    pub ring_read: u64,
    /// Input ring entries appended or rewritten.
    pub ring_written: u64,
    /// Fresh per-token inputs read (the step's own x, B, C, dt, q, k, v, ...).
    pub inputs: u64,
    /// Outputs written.
    pub outputs: u64,
}

impl Traffic {
    /// Bytes of an fp32 tensor of `n` elements.
    pub const fn f32s(n: usize) -> u64 {
        4 * n as u64
    }

    /// Bytes of a bf16 tensor of `n` elements.
    pub const fn bf16s(n: usize) -> u64 {
        2 * n as u64
    }

    /// Everything moved.
    pub fn total(&self) -> u64 {
        self.state_read + self.state_written + self.ring_read + self.ring_written + self.inputs + self.outputs
    }
}

impl Add for Traffic {
    type Output = Traffic;

    fn add(self, o: Traffic) -> Traffic {
        Traffic {
            state_read: self.state_read + o.state_read,
            state_written: self.state_written + o.state_written,
            ring_read: self.ring_read + o.ring_read,
            ring_written: self.ring_written + o.ring_written,
            inputs: self.inputs + o.inputs,
            outputs: self.outputs + o.outputs,
        }
    }
}

impl AddAssign for Traffic {
    fn add_assign(&mut self, o: Traffic) {
        *self = *self + o;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_by_kind() {
        let a = Traffic {
            state_read: 1,
            ring_written: 2,
            ..Traffic::default()
        };
        let mut b = Traffic {
            state_read: 10,
            outputs: 3,
            ..Traffic::default()
        };
        b += a;
        assert_eq!((b.state_read, b.ring_written, b.outputs, b.total()), (11, 2, 3, 16));
        assert_eq!((Traffic::f32s(3), Traffic::bf16s(3)), (12, 6));
    }
}
