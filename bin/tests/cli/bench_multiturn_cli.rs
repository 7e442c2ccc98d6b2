//! `rewind bench multi-turn` on the CPU with the embedded default model: the cache-off pass prefills every prompt
//! token, the cache-on pass restores most of each later turn's history and replies exactly as the cache-off pass;
//! bad workload flags are refused by name.

use crate::common;
use common::{rewind, stderr};
use serde_json::Value;

#[test]
fn later_turns_restore_their_history_and_reply_alike() {
    let json = std::env::temp_dir().join(format!("rewind-multi-turn-{}.json", std::process::id()));
    let o = rewind(&[
        "bench",
        "multi-turn",
        "--conversations",
        "4",
        "--clients",
        "2",
        "--turns",
        "3",
        "--system",
        "24",
        "--prefix",
        "24",
        "--user",
        "8-12",
        "--reply",
        "4-6",
        "--json",
        json.to_str().expect("utf-8 path"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).expect("json written")).expect("json");
    let _ = std::fs::remove_file(&json);
    let (off, on) = (&v["passes"][0], &v["passes"][1]);
    assert_eq!(off["prefix_cache"], "off");
    assert_eq!(off["requests"], 12);
    assert_eq!(
        off["prefilled_tokens"], off["prompt_tokens"],
        "nothing is cached with the cache off"
    );
    assert_eq!(on["prompt_tokens"], off["prompt_tokens"]);
    // Turns 2 and 3 of every conversation start from the previous turn's sequence (all but its last token).
    let hit = on["cache_hit_tokens"].as_u64().expect("hits");
    let prefilled = on["prefilled_tokens"].as_u64().expect("prefilled");
    assert!(hit > 0, "{on}");
    assert_eq!(prefilled + hit, on["prompt_tokens"].as_u64().expect("prompt"), "{on}");
    assert!(on["prefilled_over_prompt"].as_f64().expect("ratio") < 0.7, "{on}");
    assert_eq!(v["replies_equal"]["turns"], 12, "{}", v["replies_equal"]);
}

#[test]
fn bad_workload_flags_are_named() {
    for (flag, value) in [
        ("--turns", "5-2"),
        ("--user", "0"),
        ("--reply", "x"),
        ("--conversations", "0"),
    ] {
        let o = rewind(&["bench", "multi-turn", flag, value]);
        assert!(!o.status.success(), "{flag} {value} was accepted");
        assert!(stderr(&o).contains(flag), "{flag} {value}: {}", stderr(&o));
    }
}
