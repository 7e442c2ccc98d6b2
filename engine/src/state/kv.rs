//! Paged attention KV: fixed-size blocks of tokens, a free-block list, and one block table per slot shared by every
//! attention layer (a sequence has the same length in all of them, so one table maps all layers' storage).
//!
//! Growth allocates blocks as the length crosses block boundaries; rollback only moves the length, and the blocks
//! past the new length go back to the free list once they are entirely unused.

use super::{filled, zeroed, PoolError};

/// Table entry of an unused position in a slot's block table.
pub const NO_BLOCK: u32 = u32::MAX;

/// Block tables and the free-block list.
#[derive(Clone, Debug)]
pub struct KvBlocks {
    block_size: usize,
    blocks_per_slot: usize,
    total: usize,
    /// `[slots, blocks_per_slot]`; the first `held[slot]` entries of a row are valid, the rest [`NO_BLOCK`].
    table: Vec<u32>,
    held: Vec<u32>,
    /// Free blocks, the next one to hand out last.
    free: Vec<u32>,
    /// Table changes so far: a copy of the tables (a GPU rank's) is current while this count is.
    changes: u64,
}

impl KvBlocks {
    /// `total` blocks of `block_size` tokens for `slots` slots, each able to map up to `blocks_per_slot` blocks.
    /// Fails when the tables cannot be allocated or block ids do not fit `u32`.
    pub fn new(slots: usize, block_size: usize, blocks_per_slot: usize, total: usize) -> Result<Self, PoolError> {
        if block_size == 0 || total >= NO_BLOCK as usize {
            return Err(PoolError::Config(format!(
                "{total} KV blocks of {block_size} tokens: need a positive block size and fewer than {NO_BLOCK} blocks"
            )));
        }
        let table_len = slots
            .checked_mul(blocks_per_slot)
            .ok_or_else(|| PoolError::Config(format!("{slots} block tables of {blocks_per_slot} entries overflow")))?;
        let mut free = filled(total, 0u32, "the free-block list")?;
        for (i, b) in free.iter_mut().enumerate() {
            *b = (total - 1 - i) as u32;
        }
        Ok(KvBlocks {
            block_size,
            blocks_per_slot,
            total,
            table: filled(table_len, NO_BLOCK, "KV block tables")?,
            held: vec![0; slots],
            free,
            changes: 0,
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// Width of each slot's block table (most blocks one slot can hold).
    pub fn blocks_per_slot(&self) -> usize {
        self.blocks_per_slot
    }
    /// Blocks in the pool.
    pub fn total(&self) -> usize {
        self.total
    }
    /// Blocks on the free list.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }
    /// Blocks held by slots.
    pub fn used_count(&self) -> usize {
        self.held.iter().map(|&h| h as usize).sum()
    }
    /// Blocks needed for `len` tokens.
    pub fn blocks_for(&self, len: usize) -> usize {
        len.div_ceil(self.block_size)
    }
    /// Blocks held by `slot`.
    pub fn held(&self, slot: usize) -> usize {
        self.held[slot] as usize
    }
    /// The blocks of `slot`, in position order.
    pub fn table(&self, slot: usize) -> &[u32] {
        let row = slot * self.blocks_per_slot;
        &self.table[row..row + self.held[slot] as usize]
    }
    /// Every slot's block table, `[slots, blocks_per_slot]`, padded with [`NO_BLOCK`]: the layout a kernel reads.
    pub fn tables(&self) -> &[u32] {
        &self.table
    }
    /// How many times the tables have changed. Block counts alone cannot tell: two slots that each give a block back
    /// and take one again can swap blocks while every count stays the same.
    pub fn changes(&self) -> u64 {
        self.changes
    }
    /// The free list (for invariant checks).
    pub fn free_blocks(&self) -> &[u32] {
        &self.free
    }

    /// Makes `slot` hold exactly the blocks `len` tokens need: allocates on growth, returns whole unused blocks on
    /// shrink. On error nothing changes.
    pub fn fit(&mut self, slot: usize, len: usize) -> Result<(), PoolError> {
        let want = self.blocks_for(len);
        if want > self.blocks_per_slot {
            return Err(PoolError::KvTooLong {
                slot,
                len,
                max: self.blocks_per_slot * self.block_size,
            });
        }
        let have = self.held[slot] as usize;
        let row = slot * self.blocks_per_slot;
        if want > have {
            let needed = want - have;
            if needed > self.free.len() {
                return Err(PoolError::KvBlocksFull {
                    slot,
                    needed,
                    free: self.free.len(),
                });
            }
            for i in have..want {
                // Checked above: the free list holds at least `needed` blocks.
                self.table[row + i] = self.free.pop().expect("free block");
            }
        } else {
            for i in (want..have).rev() {
                self.free.push(self.table[row + i]);
                self.table[row + i] = NO_BLOCK;
            }
        }
        self.changes += u64::from(want != have);
        self.held[slot] = want as u32;
        Ok(())
    }
}

/// The K and V storage of one attention layer: `[blocks, block_size, kv_heads, head_dim]` each.
#[derive(Clone, Debug)]
pub struct KvLayerPool {
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl KvLayerPool {
    /// Zeroed storage for `blocks` blocks.
    pub fn new(kv_heads: usize, head_dim: usize, block_size: usize, blocks: usize) -> Result<Self, PoolError> {
        let n = blocks * block_size * kv_heads * head_dim;
        Ok(KvLayerPool {
            kv_heads,
            head_dim,
            block_size,
            k: zeroed(n, "KV blocks")?,
            v: zeroed(n, "KV blocks")?,
        })
    }

    /// Values per token: `kv_heads · head_dim`.
    pub fn row(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Values of storage this layer holds (K and V).
    pub fn len_values(&self) -> usize {
        self.k.len() + self.v.len()
    }

    /// A slot's view: the whole layer storage plus the slot's block table and length.
    pub fn slot_mut<'a>(&'a mut self, blocks: &'a [u32], len: usize) -> KvSlotMut<'a> {
        KvSlotMut {
            row: self.kv_heads * self.head_dim,
            block_size: self.block_size,
            k: &mut self.k,
            v: &mut self.v,
            blocks,
            len,
        }
    }
}

/// One slot of one attention layer: paged storage plus the slot's block table. Position `p` lives in row
/// `blocks[p / block_size] · block_size + p % block_size`.
#[derive(Debug)]
pub struct KvSlotMut<'a> {
    /// The whole layer's K storage, `[blocks, block_size, kv_heads, head_dim]`.
    pub k: &'a mut [f32],
    /// The whole layer's V storage.
    pub v: &'a mut [f32],
    /// The slot's blocks in position order (covering at least `len` positions).
    pub blocks: &'a [u32],
    /// Valid positions.
    pub len: usize,
    pub block_size: usize,
    /// Values per position.
    pub row: usize,
}

impl KvSlotMut<'_> {
    /// Offset of position `pos` in the layer storage; `pos` must be covered by the slot's blocks.
    pub fn offset(&self, pos: usize) -> usize {
        let block = self.blocks[pos / self.block_size] as usize;
        (block * self.block_size + pos % self.block_size) * self.row
    }

    /// Key of position `pos`, `[kv_heads, head_dim]`.
    pub fn key(&self, pos: usize) -> &[f32] {
        let o = self.offset(pos);
        &self.k[o..o + self.row]
    }

    /// Value of position `pos`.
    pub fn value(&self, pos: usize) -> &[f32] {
        let o = self.offset(pos);
        &self.v[o..o + self.row]
    }

    /// Writes position `pos` (which must be covered by the slot's blocks).
    pub fn write(&mut self, pos: usize, key: &[f32], value: &[f32]) {
        assert_eq!((key.len(), value.len()), (self.row, self.row), "kv write: row width");
        let o = self.offset(pos);
        self.k[o..o + self.row].copy_from_slice(key);
        self.v[o..o + self.row].copy_from_slice(value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swapped_blocks_count_as_a_change() {
        // Two slots give back their last block and take one again, in that order: they swap blocks, every count
        // stays the same, and only the change count tells a copy of the tables that it is stale.
        let mut kv = KvBlocks::new(2, 4, 4, 8).expect("pool");
        kv.fit(0, 5).expect("fit");
        kv.fit(1, 5).expect("fit");
        let (before, changes) = (kv.tables().to_vec(), kv.changes());
        kv.fit(0, 4).expect("shrink");
        kv.fit(1, 4).expect("shrink");
        kv.fit(0, 5).expect("grow");
        kv.fit(1, 5).expect("grow");
        assert_eq!((kv.held(0), kv.held(1)), (2, 2));
        assert_ne!(kv.tables(), &before[..], "the slots swapped their second blocks");
        assert_eq!(kv.changes(), changes + 4);
        kv.fit(1, 6).expect("same block count");
        assert_eq!(kv.changes(), changes + 4, "no table entry changed");
    }

    #[test]
    fn grow_truncate_return_whole_blocks() {
        let mut b = KvBlocks::new(2, 4, 3, 5).expect("blocks");
        b.fit(0, 5).expect("two blocks");
        assert_eq!((b.table(0), b.free_count()), (&[0, 1][..], 3));
        b.fit(1, 12).expect("three blocks");
        assert_eq!(b.table(1), &[2, 3, 4]);
        assert_eq!(
            b.fit(0, 9),
            Err(PoolError::KvBlocksFull {
                slot: 0,
                needed: 1,
                free: 0
            })
        );
        assert_eq!(b.table(0), &[0, 1], "a failed growth changes nothing");
        assert!(matches!(b.fit(0, 13), Err(PoolError::KvTooLong { max: 12, .. })));
        b.fit(1, 9).expect("still three blocks");
        assert_eq!(b.held(1), 3);
        b.fit(1, 8).expect("the third block is now entirely unused");
        assert_eq!((b.table(1), b.free_blocks()), (&[2, 3][..], &[4][..]));
        b.fit(0, 0).expect("release");
        assert_eq!((b.free_count(), b.used_count()), (3, 2));
        assert_eq!(&b.tables()[..3], &[NO_BLOCK; 3]);
    }

    #[test]
    fn paged_positions_round_trip() {
        let mut blocks = KvBlocks::new(2, 2, 4, 8).expect("blocks");
        blocks.fit(0, 3).expect("slot 0");
        blocks.fit(1, 5).expect("slot 1");
        blocks.fit(0, 7).expect("slot 0 grows past slot 1's blocks");
        let mut layer = KvLayerPool::new(2, 3, 2, 8).expect("layer");
        let row = |s: usize, p: usize| -> Vec<f32> { (0..6).map(|c| (s * 100 + p * 10 + c) as f32).collect() };
        for s in 0..2 {
            let len = [7, 5][s];
            let table = blocks.table(s).to_vec();
            let mut view = layer.slot_mut(&table, len);
            for p in 0..len {
                let r = row(s, p);
                let neg: Vec<f32> = r.iter().map(|x| -x).collect();
                view.write(p, &r, &neg);
            }
        }
        for s in 0..2 {
            let table = blocks.table(s).to_vec();
            let view = layer.slot_mut(&table, 0);
            for p in 0..[7, 5][s] {
                assert_eq!(view.key(p), &row(s, p)[..], "slot {s} pos {p}");
                assert_eq!(view.value(p)[1], -row(s, p)[1]);
            }
        }
    }
}
