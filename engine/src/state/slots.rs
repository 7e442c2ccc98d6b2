//! The sequence-slot allocator: a fixed set of slot indices, handed out and taken back.

use super::PoolError;

/// Hands out slot indices `0..capacity`. Freed slots are reused last-in first-out, so a busy server keeps touching
/// the same (cache-warm) rows of the pools. Double frees are detected, not silently absorbed.
#[derive(Clone, Debug)]
pub struct SlotAllocator {
    /// Free slots, the next one to hand out last.
    free: Vec<u32>,
    in_use: Vec<bool>,
}

impl SlotAllocator {
    /// An allocator of `capacity` slots, all free; the first `alloc` returns slot 0.
    pub fn new(capacity: usize) -> Self {
        SlotAllocator {
            free: (0..capacity as u32).rev().collect(),
            in_use: vec![false; capacity],
        }
    }

    /// Total number of slots.
    pub fn capacity(&self) -> usize {
        self.in_use.len()
    }

    /// Number of free slots.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Number of allocated slots.
    pub fn used_count(&self) -> usize {
        self.capacity() - self.free.len()
    }

    /// Takes a free slot.
    pub fn alloc(&mut self) -> Result<usize, PoolError> {
        let slot = self.free.pop().ok_or(PoolError::SlotsFull {
            capacity: self.capacity(),
        })? as usize;
        self.in_use[slot] = true;
        Ok(slot)
    }

    /// Takes the specific free slot `slot` (the others keep their order).
    pub fn claim(&mut self, slot: usize) -> Result<(), PoolError> {
        self.check_range(slot)?;
        if self.in_use[slot] {
            return Err(PoolError::InUse { slot });
        }
        self.free.retain(|&s| s as usize != slot);
        self.in_use[slot] = true;
        Ok(())
    }

    /// Returns `slot` to the free list.
    pub fn free(&mut self, slot: usize) -> Result<(), PoolError> {
        self.check_range(slot)?;
        if !self.in_use[slot] {
            return Err(PoolError::DoubleFree { slot });
        }
        self.in_use[slot] = false;
        self.free.push(slot as u32);
        Ok(())
    }

    /// Whether `slot` is allocated (false for out-of-range slots).
    pub fn is_allocated(&self, slot: usize) -> bool {
        self.in_use.get(slot).copied().unwrap_or(false)
    }

    /// `Ok` if `slot` is allocated, the precise error otherwise.
    pub fn check_allocated(&self, slot: usize) -> Result<(), PoolError> {
        self.check_range(slot)?;
        if !self.in_use[slot] {
            return Err(PoolError::NotAllocated { slot });
        }
        Ok(())
    }

    fn check_range(&self, slot: usize) -> Result<(), PoolError> {
        if slot >= self.capacity() {
            return Err(PoolError::SlotOutOfRange {
                slot,
                capacity: self.capacity(),
            });
        }
        Ok(())
    }

    /// Allocated slots in increasing order.
    pub fn allocated(&self) -> impl Iterator<Item = usize> + '_ {
        self.in_use.iter().enumerate().filter(|(_, u)| **u).map(|(s, _)| s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_reuse_and_errors() {
        let mut a = SlotAllocator::new(3);
        assert_eq!((a.alloc(), a.alloc(), a.alloc()), (Ok(0), Ok(1), Ok(2)));
        assert_eq!(a.alloc(), Err(PoolError::SlotsFull { capacity: 3 }));
        assert!(a.alloc().unwrap_err().to_string().contains("all 3 sequence slots"));
        a.free(1).expect("free 1");
        assert_eq!(a.free(1), Err(PoolError::DoubleFree { slot: 1 }));
        assert_eq!(a.check_allocated(1), Err(PoolError::NotAllocated { slot: 1 }));
        assert_eq!(a.free(7), Err(PoolError::SlotOutOfRange { slot: 7, capacity: 3 }));
        assert_eq!((a.free_count(), a.used_count()), (1, 2));
        assert_eq!(a.alloc(), Ok(1), "the freed slot is reused");
        a.free(2).expect("free 2");
        a.free(0).expect("free 0");
        assert_eq!(a.alloc(), Ok(0), "last freed, first reused");
        assert_eq!(a.allocated().collect::<Vec<_>>(), [0, 1]);
    }

    #[test]
    fn claim_takes_a_given_slot() {
        let mut a = SlotAllocator::new(3);
        a.claim(1).expect("claim 1");
        assert_eq!(a.claim(1), Err(PoolError::InUse { slot: 1 }));
        assert_eq!(a.claim(3), Err(PoolError::SlotOutOfRange { slot: 3, capacity: 3 }));
        assert_eq!((a.alloc(), a.alloc()), (Ok(0), Ok(2)), "the others keep their order");
        assert_eq!(a.alloc(), Err(PoolError::SlotsFull { capacity: 3 }));
    }

    #[test]
    fn zero_capacity_is_always_full() {
        let mut a = SlotAllocator::new(0);
        assert_eq!(a.alloc(), Err(PoolError::SlotsFull { capacity: 0 }));
    }
}
