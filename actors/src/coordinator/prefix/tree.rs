//! A radix tree over token ids whose nodes may hold an entry (a saved state of exactly the tokens on the path to the
//! node), with the entries' bytes accounted and evicted least recently used first. Generic over the entry's value so
//! its bookkeeping is tested on its own (`tests` below); the coordinator keeps saved states in it (`super`).
//!
//! Edges are compressed (SGLang's radix cache shape): a node that holds no entry has at least two children, so the
//! tree has at most twice as many nodes as entries and a lookup walks one node per branching point.

use std::collections::{BTreeMap, HashMap};

/// The root's index in the node slab.
const ROOT: usize = 0;

/// A node: the edge of tokens from its parent, and maybe an entry.
#[derive(Debug)]
struct Node<V> {
    edge: Vec<u32>,
    /// Tokens from the root to the end of `edge`.
    depth: usize,
    parent: usize,
    /// Children by the first token of their edge.
    children: HashMap<u32, usize>,
    entry: Option<Entry<V>>,
}

#[derive(Debug)]
struct Entry<V> {
    value: V,
    bytes: usize,
    /// The tick of its last use (its key in the LRU order).
    used: u64,
}

/// See the module docs.
#[derive(Debug)]
pub struct PrefixTree<V> {
    /// A slab: removed nodes leave `None` and their index on `free`.
    nodes: Vec<Option<Node<V>>>,
    free: Vec<usize>,
    /// Entries by last use, oldest first.
    lru: BTreeMap<u64, usize>,
    tick: u64,
    bytes: usize,
}

impl<V: Clone> Default for PrefixTree<V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<V: Clone> PrefixTree<V> {
    /// An empty tree.
    pub fn new() -> Self {
        PrefixTree {
            nodes: vec![Some(Node {
                edge: Vec::new(),
                depth: 0,
                parent: ROOT,
                children: HashMap::new(),
                entry: None,
            })],
            free: Vec::new(),
            lru: BTreeMap::new(),
            tick: 0,
            bytes: 0,
        }
    }

    /// Bytes of every entry together.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.lru.len()
    }

    fn node(&self, i: usize) -> &Node<V> {
        // Indices come from the tree's own links, which only point at live nodes.
        self.nodes[i].as_ref().expect("a live node")
    }

    fn node_mut(&mut self, i: usize) -> &mut Node<V> {
        self.nodes[i].as_mut().expect("a live node")
    }

    fn touch(&mut self, i: usize) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(e) = self.node_mut(i).entry.as_mut() {
            let old = std::mem::replace(&mut e.used, tick);
            self.lru.remove(&old);
            self.lru.insert(tick, i);
        }
    }

    /// The nodes along `tokens` whose whole path `tokens` starts with, root excluded, shallowest first.
    fn path(&self, tokens: &[u32]) -> Vec<usize> {
        let mut out = Vec::new();
        let mut at = ROOT;
        loop {
            let depth = self.node(at).depth;
            let Some(&next) = tokens.get(depth).and_then(|t| self.node(at).children.get(t)) else {
                return out;
            };
            let n = self.node(next);
            if !tokens[depth..].starts_with(&n.edge) {
                return out;
            }
            out.push(next);
            at = next;
        }
    }

    /// The deepest entry whose tokens `tokens` starts with and which holds at most `max` tokens: its length and
    /// value. Counts as a use of the entry.
    pub fn longest(&mut self, tokens: &[u32], max: usize) -> Option<(usize, V)> {
        let found = self
            .path(tokens)
            .into_iter()
            .rev()
            .find(|&i| self.node(i).depth <= max && self.node(i).entry.is_some())?;
        self.touch(found);
        let n = self.node(found);
        n.entry.as_ref().map(|e| (n.depth, e.value.clone()))
    }

    /// How many leading tokens of `tokens` lie along the tree's paths, entry or not: where `tokens` leaves what the
    /// tree holds (inside an edge, or at a node). Not a use of any entry.
    pub fn common(&self, tokens: &[u32]) -> usize {
        let at = self.path(tokens).last().copied().unwrap_or(ROOT);
        let depth = self.node(at).depth;
        match tokens.get(depth).and_then(|t| self.node(at).children.get(t)) {
            Some(&c) => {
                let edge = &self.node(c).edge;
                depth + edge.iter().zip(&tokens[depth..]).take_while(|(a, b)| a == b).count()
            }
            None => depth,
        }
    }

    /// Whether an entry holds exactly `tokens`; counts as a use of it.
    pub fn contains(&mut self, tokens: &[u32]) -> bool {
        let Some(&last) = self.path(tokens).last() else {
            return false;
        };
        if self.node(last).depth != tokens.len() || self.node(last).entry.is_none() {
            return false;
        }
        self.touch(last);
        true
    }

    /// Holds `value` (of `bytes`) as the entry of exactly `tokens` (not empty), replacing the one there.
    pub fn insert(&mut self, tokens: &[u32], value: V, bytes: usize) {
        debug_assert!(!tokens.is_empty(), "the root holds no entry");
        let at = self.node_for(tokens);
        if let Some(old) = self.node_mut(at).entry.take() {
            self.lru.remove(&old.used);
            self.bytes -= old.bytes;
        }
        self.tick += 1;
        let used = self.tick;
        self.node_mut(at).entry = Some(Entry { value, bytes, used });
        self.lru.insert(used, at);
        self.bytes += bytes;
    }

    /// The node of exactly `tokens`, made (splitting an edge where `tokens` ends or leaves it) when missing.
    fn node_for(&mut self, tokens: &[u32]) -> usize {
        let mut at = ROOT;
        loop {
            let depth = self.node(at).depth;
            if depth == tokens.len() {
                return at;
            }
            let first = tokens[depth];
            let Some(&child) = self.node(at).children.get(&first) else {
                let leaf = self.alloc(Node {
                    edge: tokens[depth..].to_vec(),
                    depth: tokens.len(),
                    parent: at,
                    children: HashMap::new(),
                    entry: None,
                });
                self.node_mut(at).children.insert(first, leaf);
                return leaf;
            };
            let (common, edge_len) = {
                let edge = &self.node(child).edge;
                let n = edge.iter().zip(&tokens[depth..]).take_while(|(a, b)| a == b).count();
                (n, edge.len())
            };
            if common == edge_len {
                at = child;
                continue;
            }
            // Split the child's edge after `common` tokens: a middle node takes the shared part.
            let tail = self.node_mut(child).edge.split_off(common);
            let child_first = tail[0];
            let head = std::mem::replace(&mut self.node_mut(child).edge, tail);
            let middle = self.alloc(Node {
                edge: head,
                depth: depth + common,
                parent: at,
                children: HashMap::from([(child_first, child)]),
                entry: None,
            });
            self.node_mut(child).parent = middle;
            self.node_mut(at).children.insert(first, middle);
            at = middle;
        }
    }

    fn alloc(&mut self, n: Node<V>) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i] = Some(n);
                i
            }
            None => {
                self.nodes.push(Some(n));
                self.nodes.len() - 1
            }
        }
    }

    /// Removes every entry.
    pub fn clear(&mut self) {
        *self = PrefixTree::new();
    }

    /// Evicts entries, least recently used first, until the entries hold at most `budget` bytes; returns how many
    /// went.
    pub fn evict_to(&mut self, budget: usize) -> usize {
        let mut n = 0;
        while self.bytes > budget {
            let Some((_, i)) = self.lru.pop_first() else { break };
            if let Some(e) = self.node_mut(i).entry.take() {
                self.bytes -= e.bytes;
            }
            self.prune(i);
            n += 1;
        }
        n
    }

    /// Removes `i` if it holds nothing, or merges it into its one child; then its parent the same way.
    fn prune(&mut self, mut i: usize) {
        while i != ROOT {
            let n = self.node(i);
            if n.entry.is_some() || n.children.len() > 1 {
                return;
            }
            let parent = n.parent;
            let first = n.edge[0];
            match n.children.values().next().copied() {
                None => {
                    self.node_mut(parent).children.remove(&first);
                    self.nodes[i] = None;
                    self.free.push(i);
                    i = parent;
                }
                Some(child) => {
                    // The child takes this node's edge in front of its own and hangs from the parent.
                    let mut edge = std::mem::take(&mut self.node_mut(i).edge);
                    edge.append(&mut self.node_mut(child).edge);
                    let c = self.node_mut(child);
                    c.edge = edge;
                    c.parent = parent;
                    self.node_mut(parent).children.insert(first, child);
                    self.nodes[i] = None;
                    self.free.push(i);
                    return;
                }
            }
        }
    }

    /// Every entry's tokens and bytes (for tests and checks).
    #[cfg(test)]
    fn entries(&self) -> Vec<(Vec<u32>, usize)> {
        self.lru
            .values()
            .map(|&i| {
                let mut tokens = Vec::new();
                let mut at = i;
                while at != ROOT {
                    let n = self.node(at);
                    let mut e = n.edge.clone();
                    e.append(&mut tokens);
                    tokens = e;
                    at = n.parent;
                }
                (tokens, self.node(i).entry.as_ref().map_or(0, |e| e.bytes))
            })
            .collect()
    }

    /// Checks the tree's invariants: the bytes are the entries' sum, the LRU order lists exactly the entries, every
    /// node hangs from its parent under its first token at the right depth, and a node without an entry branches.
    #[cfg(test)]
    fn check(&self) {
        let mut bytes = 0;
        let mut entries = 0;
        for (i, n) in self.nodes.iter().enumerate() {
            let Some(n) = n else {
                assert!(self.free.contains(&i), "a dead node {i} is not free");
                continue;
            };
            if let Some(e) = &n.entry {
                bytes += e.bytes;
                entries += 1;
                assert_eq!(self.lru.get(&e.used), Some(&i), "node {i}'s LRU key");
            }
            for (&t, &c) in &n.children {
                let child = self.node(c);
                assert_eq!((child.parent, child.edge[0]), (i, t), "child {c} of {i}");
                assert_eq!(child.depth, n.depth + child.edge.len(), "child {c}'s depth");
            }
            if i != ROOT {
                assert!(!n.edge.is_empty(), "node {i} has an empty edge");
                assert!(
                    n.entry.is_some() || n.children.len() >= 2,
                    "node {i} neither holds nor branches"
                );
            } else {
                assert!(n.entry.is_none(), "the root holds no entry");
            }
        }
        assert_eq!((bytes, entries), (self.bytes, self.lru.len()));
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn splits_and_finds_the_deepest_entry_within_the_limit() {
        let mut t = PrefixTree::new();
        t.insert(&[1, 2, 3, 4, 5], "a", 10);
        t.insert(&[1, 2, 9], "b", 20);
        t.insert(&[1, 2], "c", 5);
        t.check();
        assert_eq!(t.longest(&[1, 2, 3, 4, 5, 6], 10), Some((5, "a")));
        assert_eq!(
            t.longest(&[1, 2, 3, 4, 5, 6], 4),
            Some((2, "c")),
            "a is longer than allowed"
        );
        assert_eq!(
            t.longest(&[1, 2, 3, 7], 10),
            Some((2, "c")),
            "diverging inside a's edge"
        );
        assert_eq!(t.common(&[1, 2, 3, 7]), 3, "leaves inside a's edge");
        assert_eq!(t.common(&[1, 2, 3, 4, 5, 6]), 5, "runs past a");
        assert_eq!(t.common(&[1, 2, 8]), 2, "leaves at the branching node");
        assert_eq!(t.common(&[1, 2, 9]), 3);
        assert_eq!(t.common(&[7]), 0);
        assert_eq!(t.longest(&[1, 2, 9], 3), Some((3, "b")));
        assert_eq!(t.longest(&[1, 3], 10), None);
        assert!(t.contains(&[1, 2]) && !t.contains(&[1, 2, 3]) && !t.contains(&[1]));
        assert_eq!((t.len(), t.bytes()), (3, 35));
    }

    #[test]
    fn evicts_least_recently_used_and_merges_what_is_left() {
        let mut t = PrefixTree::new();
        t.insert(&[1, 2, 3], 1, 10);
        t.insert(&[1, 2, 4], 2, 10);
        t.insert(&[5], 3, 10);
        assert_eq!(t.longest(&[1, 2, 3], 3), Some((3, 1)), "a use moves 1 to the back");
        assert_eq!(t.evict_to(20), 1);
        t.check();
        assert!(!t.contains(&[1, 2, 4]), "2 was the least recently used");
        assert_eq!(t.evict_to(0), 2);
        t.check();
        assert_eq!((t.len(), t.bytes()), (0, 0));
        assert_eq!(t.nodes.iter().flatten().count(), 1, "only the root is left");
    }

    #[test]
    fn replacing_an_entry_keeps_the_accounts() {
        let mut t = PrefixTree::new();
        t.insert(&[1, 2], 1, 10);
        t.insert(&[1, 2], 2, 30);
        t.check();
        assert_eq!((t.len(), t.bytes(), t.longest(&[1, 2, 3], 9)), (1, 30, Some((2, 2))));
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(Vec<u32>, usize),
        Lookup(Vec<u32>, usize),
        Evict(usize),
    }

    fn tokens() -> impl Strategy<Value = Vec<u32>> {
        // A small alphabet, so that paths share prefixes and diverge at every depth.
        prop::collection::vec(0u32..3, 1..8)
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (tokens(), 1usize..50).prop_map(|(t, b)| Op::Insert(t, b)),
            (tokens(), 0usize..9).prop_map(|(t, m)| Op::Lookup(t, m)),
            (0usize..200).prop_map(Op::Evict),
        ]
    }

    proptest! {
        /// Against a list of entries with their last use: the same lookups, the same evictions, and the tree's
        /// accounts (bytes, entries, nodes) consistent after every operation.
        #[test]
        fn matches_a_list_of_entries(ops in prop::collection::vec(op(), 1..60)) {
            let mut t = PrefixTree::new();
            // (tokens, value, bytes, last use)
            let mut model: Vec<(Vec<u32>, usize, usize, u64)> = Vec::new();
            let mut clock = 0u64;
            for (k, op) in ops.into_iter().enumerate() {
                clock += 1;
                match op {
                    Op::Insert(tokens, bytes) => {
                        t.insert(&tokens, k, bytes);
                        model.retain(|e| e.0 != tokens);
                        model.push((tokens, k, bytes, clock));
                    }
                    Op::Lookup(tokens, max) => {
                        let want = model
                            .iter_mut()
                            .filter(|e| e.0.len() <= max && tokens.starts_with(&e.0))
                            .max_by_key(|e| e.0.len());
                        let want = want.map(|e| {
                            e.3 = clock;
                            (e.0.len(), e.1)
                        });
                        prop_assert_eq!(t.longest(&tokens, max), want);
                    }
                    Op::Evict(budget) => {
                        let mut evicted = 0;
                        model.sort_by_key(|e| e.3);
                        while model.iter().map(|e| e.2).sum::<usize>() > budget {
                            model.remove(0);
                            evicted += 1;
                        }
                        prop_assert_eq!(t.evict_to(budget), evicted);
                    }
                }
                t.check();
                let mut got = t.entries();
                got.sort();
                let mut want: Vec<_> = model.iter().map(|e| (e.0.clone(), e.2)).collect();
                want.sort();
                prop_assert_eq!(got, want);
                prop_assert!(t.nodes.iter().flatten().count() <= 2 * t.len() + 1, "compressed");
            }
        }
    }
}
