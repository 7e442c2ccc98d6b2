//! The ring of `(u, k, g)` entries one sequence slot keeps per GDN layer, and the state rebuild from it.

use crate::cpu::gdn::GdnDims;
use crate::cpu::gemm::matmul_tn;
use crate::cpu::ring::RingIndex;

/// A borrowed view of one slot's ring for one GDN layer: storage plus counters.
///
/// Storage (row-major, `L` = the index's capacity): `u [L, v_heads, v_dim]`, `k [L, k_heads, k_dim]`, `g [L, v_heads]`,
/// so a physical row of each array is one token's entry. The engine keeps these in slot-indexed pools and borrows one
/// slot's rows (lengths from [`GdnRing::storage_lens`]) and its [`RingIndex`] per call. Rows outside the committed and
/// pending ranges are stale and never read.
#[derive(Debug)]
pub struct GdnRing<'a> {
    pub(super) dims: GdnDims,
    u: &'a mut [f32],
    k: &'a mut [f32],
    g: &'a mut [f32],
    pub(super) index: &'a mut RingIndex,
}

/// One logical entry of a GDN ring, borrowed: `u [v_heads, v_dim]`, `k [k_heads, k_dim]`, `g [v_heads]`.
#[derive(Clone, Copy, Debug)]
pub struct GdnEntry<'a> {
    /// Corrected values.
    pub u: &'a [f32],
    /// Keys (L2-normalised).
    pub k: &'a [f32],
    /// Log-decays.
    pub g: &'a [f32],
}

impl<'a> GdnRing<'a> {
    /// Lengths of the `u`, `k` and `g` storage of one ring of `capacity` entries.
    pub fn storage_lens(dims: GdnDims, capacity: usize) -> (usize, usize, usize) {
        (
            capacity * dims.v_heads * dims.v_dim,
            capacity * dims.k_heads * dims.k_dim,
            capacity * dims.v_heads,
        )
    }

    /// Views `u`, `k`, `g` (lengths from [`GdnRing::storage_lens`] at `index.capacity`) and `index` as a ring; panics
    /// on a shape mismatch.
    pub fn new(dims: GdnDims, u: &'a mut [f32], k: &'a mut [f32], g: &'a mut [f32], index: &'a mut RingIndex) -> Self {
        assert!(
            dims.k_heads > 0 && dims.v_heads.is_multiple_of(dims.k_heads),
            "replay_gdn: v_heads must be a non-zero multiple of k_heads"
        );
        index.check();
        let lens = Self::storage_lens(dims, index.capacity);
        assert_eq!((u.len(), k.len(), g.len()), lens, "replay_gdn: ring storage");
        GdnRing { dims, u, k, g, index }
    }

    /// The layer shape the ring was built for.
    pub fn dims(&self) -> GdnDims {
        self.dims
    }

    /// Entries the ring holds at most (`L`).
    pub fn capacity(&self) -> usize {
        self.index.capacity
    }

    /// The counters.
    pub fn index(&self) -> RingIndex {
        *self.index
    }

    /// Committed entries since the checkpoint (`h`).
    pub fn len(&self) -> usize {
        self.index.len
    }

    /// Whether no committed entry is cached (the checkpoint is the whole state).
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Starts a new sequence in this slot ([`RingIndex::reset`]).
    pub fn reset(&mut self) {
        self.index.reset();
    }

    /// Physical row of logical entry `j`.
    pub fn physical(&self, j: usize) -> usize {
        self.index.physical(j)
    }

    /// Logical entry `j`, committed or pending (`j < len + pending`).
    pub fn entry(&self, j: usize) -> GdnEntry<'_> {
        assert!(
            j < self.index.len + self.index.pending,
            "replay_gdn: entry {j} not in {:?}",
            self.index
        );
        let p = self.physical(j);
        let GdnDims {
            k_heads,
            v_heads,
            k_dim,
            v_dim,
        } = self.dims;
        GdnEntry {
            u: &self.u[p * v_heads * v_dim..(p + 1) * v_heads * v_dim],
            k: &self.k[p * k_heads * k_dim..(p + 1) * k_heads * k_dim],
            g: &self.g[p * v_heads..(p + 1) * v_heads],
        }
    }

    /// Value head `h`'s first `n` logical entries, each `u_j` weighted by its decay to the end of the span.
    pub(super) fn history(&self, h: usize, n: usize) -> History {
        let GdnDims {
            k_heads,
            v_heads,
            k_dim: dk,
            v_dim: dv,
        } = self.dims;
        let kh = h / (v_heads / k_heads);
        let (mut wu, mut k) = (vec![0.0f32; n * dv], vec![0.0f32; n * dk]);
        // Suffix sums of the gates, newest first: the weight of entry j is exp(g_{j+1} + … + g_{n−1}).
        let mut span = 0.0f32;
        for j in (0..n).rev() {
            let p = self.physical(j);
            let w = span.exp();
            let src = &self.u[(p * v_heads + h) * dv..(p * v_heads + h + 1) * dv];
            for (d, s) in wu[j * dv..(j + 1) * dv].iter_mut().zip(src) {
                *d = w * s;
            }
            k[j * dk..(j + 1) * dk].copy_from_slice(&self.k[(p * k_heads + kh) * dk..(p * k_heads + kh + 1) * dk]);
            span += self.g[p * v_heads + h];
        }
        History {
            n,
            decay: span.exp(),
            wu,
            k,
        }
    }

    /// Writes `t` tokens as logical entries `at .. at + t`: keys `k [t, k_heads, k_dim]`, gates `g [t, v_heads]`, and
    /// value head `h`'s corrected values `u[h]` (`[t, v_dim]`).
    pub(super) fn append(&mut self, at: usize, t: usize, k: &[f32], g: &[f32], u: &[&[f32]]) {
        let GdnDims {
            k_heads,
            v_heads,
            k_dim: dk,
            v_dim: dv,
        } = self.dims;
        for s in 0..t {
            let p = self.physical(at + s);
            for (h, uh) in u.iter().enumerate() {
                self.u[(p * v_heads + h) * dv..(p * v_heads + h + 1) * dv].copy_from_slice(&uh[s * dv..(s + 1) * dv]);
            }
            self.k[p * k_heads * dk..(p + 1) * k_heads * dk]
                .copy_from_slice(&k[s * k_heads * dk..(s + 1) * k_heads * dk]);
            self.g[p * v_heads..(p + 1) * v_heads].copy_from_slice(&g[s * v_heads..(s + 1) * v_heads]);
        }
    }
}

/// A ring that owns its storage (tests, single-sequence use); [`GdnRingBuf::view`] gives the [`GdnRing`] the ops take.
#[derive(Clone, Debug)]
pub struct GdnRingBuf {
    dims: GdnDims,
    /// `[capacity, v_heads, v_dim]`.
    pub u: Vec<f32>,
    /// `[capacity, k_heads, k_dim]`.
    pub k: Vec<f32>,
    /// `[capacity, v_heads]`.
    pub g: Vec<f32>,
    /// The counters.
    pub index: RingIndex,
}

impl GdnRingBuf {
    /// An empty ring of `capacity` entries (storage zeroed).
    pub fn new(dims: GdnDims, capacity: usize) -> Self {
        let (lu, lk, lg) = GdnRing::storage_lens(dims, capacity);
        GdnRingBuf {
            dims,
            u: vec![0.0; lu],
            k: vec![0.0; lk],
            g: vec![0.0; lg],
            index: RingIndex::new(capacity),
        }
    }

    /// The ring as the ops take it.
    pub fn view(&mut self) -> GdnRing<'_> {
        GdnRing::new(self.dims, &mut self.u, &mut self.k, &mut self.g, &mut self.index)
    }
}

/// `S_n` of one value head: `decay · S0 + Σ_j w_j u_j k_jᵀ` over the first `n` entries.
pub(super) struct History {
    pub(super) n: usize,
    /// `Π_j e^{g_j}` over the span.
    pub(super) decay: f32,
    /// `[n, v_dim]`: `w_j u_j` with `w_j = Π_{i>j} e^{g_i}`.
    pub(super) wu: Vec<f32>,
    /// `[n, k_dim]`.
    pub(super) k: Vec<f32>,
}

impl History {
    /// `out = decay · s0 + wuᵀ k` (`[v_dim, k_dim]`, one GEMM of inner dimension `n`); `None` is a zero `s0`.
    pub(super) fn fold(&self, dims: GdnDims, s0: Option<&[f32]>, out: &mut [f32]) {
        matmul_tn(&self.wu, &self.k, out, dims.v_dim, self.n, dims.k_dim);
        if let Some(s0) = s0 {
            for (o, s) in out.iter_mut().zip(s0) {
                *o += self.decay * s;
            }
        }
    }
}
