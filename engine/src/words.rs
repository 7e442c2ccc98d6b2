//! Counts in messages: "1 layer", "2 layers", never "1 layers".

/// `n` and `noun`, the noun in the plural unless `n` is 1 (English's regular plural: `-s`, a consonant's `-y` as
/// `-ies`).
pub fn count(n: impl Into<u128>, noun: &str) -> String {
    let n = n.into();
    if n == 1 {
        return format!("1 {noun}");
    }
    let mut chars = noun.chars().rev();
    match (chars.next(), chars.next()) {
        (Some('y'), Some(c)) if !"aeiou".contains(c) => format!("{n} {}ies", &noun[..noun.len() - 1]),
        _ => format!("{n} {noun}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::count;

    #[test]
    fn one_is_singular_and_every_other_count_plural() {
        assert_eq!(count(1u64, "turn"), "1 turn");
        assert_eq!(count(0u64, "turn"), "0 turns");
        assert_eq!(count(2u32, "layer"), "2 layers");
        assert_eq!(count(3u64, "recovery"), "3 recoveries");
        assert_eq!(count(1u64, "recovery"), "1 recovery");
        assert_eq!(count(2u64, "key"), "2 keys");
    }
}
