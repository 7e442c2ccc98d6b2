//! The API's enum fields (stored as `i32` by prost) by name: in lower case without the enum's prefix (`length`,
//! `serving`), an unknown value as its number. `build.rs` points the generated fields' JSON serialization here, and
//! `rewind client` prints them with the same names.

use serde::Serializer;

use super::pb;

/// `FINISH_REASON_STOP_STRING` as `stop_string`.
fn short(prefix: &str, full: Option<&str>, value: i32) -> String {
    match full {
        Some(n) => n.strip_prefix(prefix).unwrap_or(n).to_ascii_lowercase(),
        None => value.to_string(),
    }
}

/// A [`pb::FinishReason`] value's name.
pub fn finish_reason_name(v: i32) -> String {
    short(
        "FINISH_REASON_",
        pb::FinishReason::try_from(v).ok().map(|r| r.as_str_name()),
        v,
    )
}

/// A [`pb::ServingStatus`] value's name.
pub fn serving_status_name(v: i32) -> String {
    short(
        "SERVING_STATUS_",
        pb::ServingStatus::try_from(v).ok().map(|r| r.as_str_name()),
        v,
    )
}

/// Serializes a [`pb::FinishReason`] field by name.
pub fn finish_reason<S: Serializer>(v: &i32, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&finish_reason_name(*v))
}

/// Serializes a [`pb::ServingStatus`] field by name.
pub fn serving_status<S: Serializer>(v: &i32, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&serving_status_name(*v))
}

#[cfg(test)]
mod tests {
    use super::pb;

    #[test]
    fn enum_fields_serialize_by_name() {
        let c = pb::GenerateChunk {
            finish_reason: pb::FinishReason::StopString as i32,
            ..Default::default()
        };
        let v = serde_json::to_value(&c).expect("json");
        assert_eq!(v["finish_reason"], "stop_string");
        let h = pb::HealthResponse {
            status: 99,
            ..Default::default()
        };
        assert_eq!(serde_json::to_value(&h).expect("json")["status"], "99");
        assert_eq!(
            super::serving_status_name(pb::ServingStatus::Draining as i32),
            "draining"
        );
    }
}
