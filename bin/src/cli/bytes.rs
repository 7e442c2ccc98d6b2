//! Flags given as an amount of memory.

/// Parses a positive amount of memory: a number of bytes, or a number (fractions allowed) with a unit: `KiB`, `MiB`,
/// `GiB`, `TiB` (or `K`, `M`, `G`, `T`: the same binary units), or `KB`, `MB`, `GB`, `TB` (decimal), in any case.
pub fn byte_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let n: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not an amount of memory: give bytes, or a number with a unit (e.g. 8GiB)"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => (1u64 << 10) as f64,
        "m" | "mib" => (1u64 << 20) as f64,
        "g" | "gib" => (1u64 << 30) as f64,
        "t" | "tib" => (1u64 << 40) as f64,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => {
            return Err(format!(
                "unknown unit `{other}` in `{s}`: give bytes, or a number with KiB, MiB, GiB or TiB (e.g. 8GiB)"
            ))
        }
    };
    let bytes = (n * scale).round();
    // 2^63: far above any host's memory, and exact in both f64 and u64.
    if bytes < 1.0 || bytes > (1u64 << 63) as f64 {
        return Err(format!("`{s}` must be at least 1 byte and at most 8 EiB"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::byte_size;

    #[test]
    fn amounts_of_memory_take_binary_and_decimal_units() {
        assert_eq!(byte_size("4096"), Ok(4096));
        assert_eq!(byte_size("8GiB"), Ok(8 << 30));
        assert_eq!(byte_size("8g"), Ok(8 << 30));
        assert_eq!(byte_size("1.5 MiB"), Ok(3 << 19));
        assert_eq!(byte_size("2GB"), Ok(2_000_000_000));
        for (bad, says) in [
            ("0", "at least 1 byte"),
            ("0.1", "at least 1 byte"),
            ("-1GiB", "at least 1 byte"),
            ("GiB", "not an amount of memory"),
            ("lots", "not an amount of memory"),
            ("1.2.3", "not an amount of memory"),
            ("8 gigs", "unknown unit `gigs`"),
            ("99999999999TiB", "at most 8 EiB"),
        ] {
            let e = byte_size(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
