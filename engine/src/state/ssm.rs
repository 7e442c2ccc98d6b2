//! The pools of one SSM layer: checkpoint states, input rings and conv rings for every slot.
//!
//! Layouts (row-major, slot outermost), CPU storage f32:
//! - checkpoint: Mamba-2 `[slots, heads, head_dim, state_dim]`, GDN `[slots, v_heads, v_dim, k_dim]`;
//! - input ring, three fields of `R` rows per slot (`R` the largest capacity a slot may use: `L`, or `threshold + T`
//!   for a kv-only slot; a slot uses the first `capacity` rows of its block, its capacity in the counters): Mamba-2 `x [slots, L, heads, head_dim]`, `dt [slots, L, heads]`,
//!   `B [slots, L, groups, state_dim]`; GDN `u [slots, L, v_heads, v_dim]`, `k [slots, L, k_heads, k_dim]`,
//!   `g [slots, L, v_heads]`. GDN caches the corrected value `u = β(v − S k)`, never the raw `v`: replaying raw
//!   values would need the state after every entry, the serial dependency replay removes;
//! - conv ring `[slots, K − 1 + T, conv_dim]`: the last `K − 1` pre-conv inputs plus room for the `T` speculative
//!   ones, so accepting tokens moves the conv head instead of shifting rows.

use super::{zeroed, PoolError, RingIndex};
use crate::model::spec::{GdnSpec, Mamba2Spec};

/// Which SSM mixer a pool serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SsmKind {
    Mamba2,
    Gdn,
}

/// The GPU element type of an input-ring field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingElem {
    /// A vector (`x`, `B`, `u`, `k`), stored in the activation type like the conv inputs it comes from.
    Act,
    /// A per-head scalar (`dt`, `g`), fp32 whatever the activation type: it is a decay's exponent, which the replay
    /// kernels' byte model reads in fp32.
    F32,
}

/// One input-ring field: its name, its width per entry and its GPU element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingField {
    pub name: &'static str,
    /// Values per entry.
    pub width: usize,
    /// Element type in the GPU layout ([`super::memory::LayerValues::ring_entry_bytes`] counts its size).
    pub elem: RingElem,
}

/// The per-slot sizes of one SSM layer's pools.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SsmDims {
    pub kind: SsmKind,
    /// Checkpoint shape per slot: `[heads, head_dim, state_dim]` or `[v_heads, v_dim, k_dim]`.
    pub state_shape: [usize; 3],
    /// Ring fields in storage order: `(x, dt, B)` or `(u, k, g)`.
    pub ring_fields: [RingField; 3],
    /// Channels of the pre-conv input: Mamba-2 `d_inner + 2·groups·state_dim`, GDN `2·k_heads·k_dim + v_heads·v_dim`.
    pub conv_dim: usize,
    /// `K − 1`: conv inputs of history a step needs.
    pub conv_window: usize,
    /// The key dimension of the state (Mamba-2 `state_dim`, GDN `k_dim`): the default kv-only threshold.
    pub key_dim: usize,
}

impl SsmDims {
    /// The pools of a Mamba-2 layer.
    pub fn mamba2(s: &Mamba2Spec) -> Self {
        let d_inner = s.heads * s.head_dim;
        SsmDims {
            kind: SsmKind::Mamba2,
            state_shape: [s.heads, s.head_dim, s.state_dim],
            ring_fields: [
                RingField {
                    name: "x",
                    width: d_inner,
                    elem: RingElem::Act,
                },
                RingField {
                    name: "dt",
                    width: s.heads,
                    elem: RingElem::F32,
                },
                RingField {
                    name: "B",
                    width: s.groups * s.state_dim,
                    elem: RingElem::Act,
                },
            ],
            conv_dim: d_inner + 2 * s.groups * s.state_dim,
            conv_window: s.conv_kernel.saturating_sub(1),
            key_dim: s.state_dim,
        }
    }

    /// The pools of a Gated DeltaNet layer.
    pub fn gdn(s: &GdnSpec) -> Self {
        let value_dim = s.v_heads * s.v_head_dim;
        let key_dim = s.k_heads * s.k_head_dim;
        SsmDims {
            kind: SsmKind::Gdn,
            state_shape: [s.v_heads, s.v_head_dim, s.k_head_dim],
            ring_fields: [
                RingField {
                    name: "u",
                    width: value_dim,
                    elem: RingElem::Act,
                },
                RingField {
                    name: "k",
                    width: key_dim,
                    elem: RingElem::Act,
                },
                RingField {
                    name: "g",
                    width: s.v_heads,
                    elem: RingElem::F32,
                },
            ],
            conv_dim: 2 * key_dim + value_dim,
            conv_window: s.conv_kernel.saturating_sub(1),
            key_dim: s.k_head_dim,
        }
    }

    /// Checkpoint values per slot.
    pub fn state_len(&self) -> usize {
        self.state_shape.iter().product()
    }

    /// Ring values per entry, all fields.
    pub fn entry_len(&self) -> usize {
        self.ring_fields.iter().map(|f| f.width).sum()
    }
}

/// One slot's storage in one SSM layer, for the decode kernels: slices of the slot's rows plus the ring indices.
/// Ring entry `j` of field `f` is `ring[f][ring_index.physical(j) * width .. + width]`; conv history entry `j`
/// (0 = oldest of `K − 1`) is `conv[conv_index.physical(j) * conv_dim ..]`.
#[derive(Debug)]
pub struct SsmSlotMut<'a> {
    pub kind: SsmKind,
    pub state: &'a mut [f32],
    pub ring: [&'a mut [f32]; 3],
    pub ring_index: RingIndex,
    pub conv: &'a mut [f32],
    pub conv_index: RingIndex,
}

/// A Mamba-2 slot view: checkpoint `[heads, head_dim, state_dim]`, ring `x [L, heads·head_dim]`, `dt [L, heads]`,
/// `b [L, groups·state_dim]`, conv ring `[K − 1 + T, conv_dim]`.
#[derive(Debug)]
pub struct Mamba2SlotMut<'a> {
    pub state: &'a mut [f32],
    pub x: &'a mut [f32],
    pub dt: &'a mut [f32],
    pub b: &'a mut [f32],
    pub ring: RingIndex,
    pub conv: &'a mut [f32],
    pub conv_ring: RingIndex,
}

/// A GDN slot view: checkpoint `[v_heads, v_dim, k_dim]`, ring `u [L, v_heads·v_dim]`, `k [L, k_heads·k_dim]`,
/// `g [L, v_heads]`, conv ring `[K − 1 + T, conv_dim]`.
#[derive(Debug)]
pub struct GdnSlotMut<'a> {
    pub state: &'a mut [f32],
    pub u: &'a mut [f32],
    pub k: &'a mut [f32],
    pub g: &'a mut [f32],
    pub ring: RingIndex,
    pub conv: &'a mut [f32],
    pub conv_ring: RingIndex,
}

/// Checkpoint, input-ring and conv-ring storage of one SSM layer for every slot.
#[derive(Clone, Debug)]
pub struct SsmLayerPool {
    dims: SsmDims,
    slots: usize,
    ring_rows: usize,
    conv_capacity: usize,
    state: Vec<f32>,
    ring: [Vec<f32>; 3],
    conv: Vec<f32>,
}

impl SsmLayerPool {
    /// Zeroed pools for `slots` slots, `ring_rows` input-ring rows per slot (the largest capacity any form uses) and
    /// a conv ring of `dims.conv_window + spec_window` entries.
    pub fn new(dims: SsmDims, slots: usize, ring_rows: usize, spec_window: usize) -> Result<Self, PoolError> {
        let conv_capacity = dims.conv_window + spec_window;
        let [f0, f1, f2] = dims.ring_fields;
        let ring = [
            zeroed(slots * ring_rows * f0.width, "input rings")?,
            zeroed(slots * ring_rows * f1.width, "input rings")?,
            zeroed(slots * ring_rows * f2.width, "input rings")?,
        ];
        Ok(SsmLayerPool {
            state: zeroed(slots * dims.state_len(), "checkpoint states")?,
            conv: zeroed(slots * conv_capacity * dims.conv_dim, "conv rings")?,
            ring,
            dims,
            slots,
            ring_rows,
            conv_capacity,
        })
    }

    /// The layer's sizes.
    pub fn dims(&self) -> &SsmDims {
        &self.dims
    }

    /// Every slot's checkpoint, `[slots, ...state_shape]`.
    pub fn states(&self) -> &[f32] {
        &self.state
    }

    /// Input-ring rows per slot (the stride between slots in the ring fields).
    pub fn ring_rows(&self) -> usize {
        self.ring_rows
    }

    /// Ring field `f` for every slot, `[slots, ring_rows, width]`.
    pub fn ring_field(&self, f: usize) -> &[f32] {
        &self.ring[f]
    }

    /// Every slot's conv ring, `[slots, K − 1 + T, conv_dim]`.
    pub fn conv_rings(&self) -> &[f32] {
        &self.conv
    }

    /// Values of storage this pool holds (all slots, all tensors).
    pub fn len_values(&self) -> usize {
        self.state.len() + self.ring.iter().map(Vec::len).sum::<usize>() + self.conv.len()
    }

    /// One slot's storage with the given ring indices (from [`super::SlotCounters`]): the ring fields are the first
    /// `ring_index.capacity` rows of the slot's block.
    pub fn slot_mut(&mut self, slot: usize, ring_index: RingIndex, conv_index: RingIndex) -> SsmSlotMut<'_> {
        assert!(slot < self.slots, "ssm pool: slot {slot} of {}", self.slots);
        let (rows, cap) = (self.ring_rows, ring_index.capacity);
        assert!(cap <= rows, "ssm pool: a ring of {cap} entries in {rows} rows");
        let sl = self.dims.state_len();
        let (cc, cd) = (self.conv_capacity, self.dims.conv_dim);
        let w = self.dims.ring_fields.map(|f| f.width);
        let [r0, r1, r2] = &mut self.ring;
        let field = |w: usize| slot * rows * w..(slot * rows + cap) * w;
        SsmSlotMut {
            kind: self.dims.kind,
            state: &mut self.state[slot * sl..(slot + 1) * sl],
            ring: [&mut r0[field(w[0])], &mut r1[field(w[1])], &mut r2[field(w[2])]],
            ring_index,
            conv: &mut self.conv[slot * cc * cd..(slot + 1) * cc * cd],
            conv_index,
        }
    }

    /// Zeroes a slot's checkpoint and conv ring, the state of a new sequence. Ring rows are left as they are: no
    /// entry is read before it is written again, because the slot's `h` starts at 0.
    pub fn reset_slot(&mut self, slot: usize) {
        let sl = self.dims.state_len();
        let c = self.conv_capacity * self.dims.conv_dim;
        self.state[slot * sl..(slot + 1) * sl].fill(0.0);
        self.conv[slot * c..(slot + 1) * c].fill(0.0);
    }
}

impl<'a> SsmSlotMut<'a> {
    /// The Mamba-2 view; `None` for a GDN layer.
    pub fn into_mamba2(self) -> Option<Mamba2SlotMut<'a>> {
        if self.kind != SsmKind::Mamba2 {
            return None;
        }
        let [x, dt, b] = self.ring;
        Some(Mamba2SlotMut {
            state: self.state,
            x,
            dt,
            b,
            ring: self.ring_index,
            conv: self.conv,
            conv_ring: self.conv_index,
        })
    }

    /// The GDN view; `None` for a Mamba-2 layer.
    pub fn into_gdn(self) -> Option<GdnSlotMut<'a>> {
        if self.kind != SsmKind::Gdn {
            return None;
        }
        let [u, k, g] = self.ring;
        Some(GdnSlotMut {
            state: self.state,
            u,
            k,
            g,
            ring: self.ring_index,
            conv: self.conv,
            conv_ring: self.conv_index,
        })
    }
}
