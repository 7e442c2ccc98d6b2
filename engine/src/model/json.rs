//! Typed access to `config.json` fields with errors that name the field.

use serde_json::{Map, Value};

use crate::error::{EngineError, Result};

/// Parses JSON that Python's `json.dump` may have written: the bare literals `Infinity`, `-Infinity` and `NaN` (found in
/// published Nemotron-H configs, e.g. `time_step_limit`) are not JSON, so outside strings they are read as `null`.
pub fn parse_relaxed(text: &str) -> serde_json::Result<Value> {
    let mut out = String::with_capacity(text.len());
    let mut in_string = false;
    let mut escaped = false;
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if c == '"' {
            in_string = true;
        } else {
            let literal = ["-Infinity", "Infinity", "NaN"]
                .into_iter()
                .find(|lit| rest.starts_with(lit));
            if let Some(lit) = literal {
                out.push_str("null");
                rest = &rest[lit.len()..];
                continue;
            }
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    serde_json::from_str(&out)
}

/// The largest integer a config field may hold. Every size, count and length of a real model is far below it
/// (vocabularies of 2^18, contexts of 2^23 tokens); past it, a corrupt or hostile `config.json` would make the loader
/// loop over billions of experts or heads, or overflow the products of two dimensions, before any tensor shape is
/// compared with the checkpoint.
pub const MAX_CONFIG_INT: u64 = 1 << 24;

/// The largest count of heads, experts, groups or layers: the loader expects tensors per expert and head, so a count
/// of millions would have it build millions of names before the checkpoint could contradict them. Real models stay
/// below 1 000 (512 experts, 128 heads).
pub const MAX_CONFIG_COUNT: u64 = 1 << 14;

/// The fields [`MAX_CONFIG_COUNT`] bounds.
const COUNT_FIELDS: &[&str] = &[
    "num_hidden_layers",
    "mamba_num_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "n_routed_experts",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "n_groups",
    "n_group",
    "topk_group",
    "mtp_num_hidden_layers",
    "num_nextn_predict_layers",
];

/// A JSON object read as a model config; `scope` prefixes field names in errors (e.g. `text_config.`).
#[derive(Clone, Copy)]
pub struct Fields<'a> {
    map: &'a Map<String, Value>,
    scope: &'a str,
}

impl<'a> Fields<'a> {
    /// Wraps `value`, which must be a JSON object.
    pub fn new(value: &'a Value, scope: &'a str) -> Result<Self> {
        match value.as_object() {
            Some(map) => Ok(Fields { map, scope }),
            None => Err(EngineError::config(
                scope.trim_end_matches('.'),
                "expected a JSON object",
            )),
        }
    }

    fn name(&self, field: &str) -> String {
        format!("{}{}", self.scope, field)
    }

    /// The raw value of `field`, treating JSON `null` as absent.
    pub fn raw(&self, field: &str) -> Option<&'a Value> {
        self.map.get(field).filter(|v| !v.is_null())
    }

    /// Whether `field` is present and not null.
    pub fn has(&self, field: &str) -> bool {
        self.raw(field).is_some()
    }

    /// A nested object.
    pub fn object(&self, field: &str) -> Result<Option<&'a Value>> {
        match self.raw(field) {
            None => Ok(None),
            Some(v) if v.is_object() => Ok(Some(v)),
            Some(v) => Err(EngineError::config(
                self.name(field),
                format!("expected an object, found {v}"),
            )),
        }
    }

    /// An optional non-negative integer.
    pub fn opt_usize(&self, field: &str) -> Result<Option<usize>> {
        match self.raw(field) {
            None => Ok(None),
            Some(v) => match self.bounded(field, v) {
                Some(r) => r.map(Some),
                None => Err(self.error(field, format!("expected a non-negative integer, found {v}"))),
            },
        }
    }

    /// `v` as a non-negative integer within the field's limit: None when it is no such integer, an error past the
    /// limit.
    fn bounded(&self, field: &str, v: &Value) -> Option<Result<usize>> {
        v.as_u64().map(|x| {
            if x <= Self::limit(field) {
                Ok(x as usize)
            } else {
                Err(self.too_large(field, x))
            }
        })
    }

    fn limit(field: &str) -> u64 {
        if COUNT_FIELDS.contains(&field) {
            MAX_CONFIG_COUNT
        } else {
            MAX_CONFIG_INT
        }
    }

    fn too_large(&self, field: &str, x: u64) -> EngineError {
        EngineError::config(
            self.name(field),
            format!(
                "{x} is larger than any model this engine loads (at most {})",
                Self::limit(field)
            ),
        )
    }

    /// A required positive integer.
    pub fn positive(&self, field: &str) -> Result<usize> {
        match self.opt_usize(field)? {
            None => Err(EngineError::config(
                self.name(field),
                "missing (a positive integer is required)",
            )),
            Some(0) => Err(EngineError::config(self.name(field), "must be positive, found 0")),
            Some(x) => Ok(x),
        }
    }

    /// A positive integer with a default when absent.
    pub fn positive_or(&self, field: &str, default: usize) -> Result<usize> {
        match self.opt_usize(field)? {
            None => Ok(default),
            Some(0) => Err(EngineError::config(self.name(field), "must be positive, found 0")),
            Some(x) => Ok(x),
        }
    }

    /// An optional finite number.
    pub fn opt_f64(&self, field: &str) -> Result<Option<f64>> {
        match self.raw(field) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() => Ok(Some(x)),
                _ => Err(EngineError::config(
                    self.name(field),
                    format!("expected a finite number, found {v}"),
                )),
            },
        }
    }

    /// A finite number with a default.
    pub fn f64_or(&self, field: &str, default: f64) -> Result<f64> {
        Ok(self.opt_f64(field)?.unwrap_or(default))
    }

    /// A positive finite number with a default.
    pub fn positive_f64_or(&self, field: &str, default: f64) -> Result<f64> {
        let x = self.f64_or(field, default)?;
        if x > 0.0 {
            Ok(x)
        } else {
            Err(EngineError::config(
                self.name(field),
                format!("must be positive, found {x}"),
            ))
        }
    }

    /// A boolean with a default.
    pub fn bool_or(&self, field: &str, default: bool) -> Result<bool> {
        match self.raw(field) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| EngineError::config(self.name(field), format!("expected true or false, found {v}"))),
        }
    }

    /// An optional string.
    pub fn opt_str(&self, field: &str) -> Result<Option<&'a str>> {
        match self.raw(field) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| EngineError::config(self.name(field), format!("expected a string, found {v}"))),
        }
    }

    /// An optional list of strings.
    pub fn opt_str_list(&self, field: &str) -> Result<Option<Vec<String>>> {
        match self.raw(field) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_str().map(str::to_string).ok_or_else(|| {
                        EngineError::config(self.name(field), format!("expected a list of strings, found item {v}"))
                    })
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => Err(EngineError::config(
                self.name(field),
                format!("expected a list of strings, found {v}"),
            )),
        }
    }

    /// An optional list of non-negative integers.
    pub fn opt_usize_list(&self, field: &str) -> Result<Option<Vec<usize>>> {
        match self.raw(field) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    self.bounded(field, v).unwrap_or_else(|| {
                        Err(self.error(field, format!("expected a list of integers, found item {v}")))
                    })
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => Err(EngineError::config(
                self.name(field),
                format!("expected a list of integers, found {v}"),
            )),
        }
    }

    /// Token ids given as one integer or a list of integers (`eos_token_id`).
    pub fn token_ids(&self, field: &str) -> Result<Vec<u32>> {
        match self.raw(field) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(|| {
                        EngineError::config(self.name(field), format!("expected token ids, found item {v}"))
                    })
                })
                .collect(),
            Some(v) => v
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .map(|x| vec![x])
                .ok_or_else(|| EngineError::config(self.name(field), format!("expected a token id, found {v}"))),
        }
    }

    /// An error for `field` in this scope.
    pub fn error(&self, field: &str, message: impl Into<String>) -> EngineError {
        EngineError::config(self.name(field), message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relaxed_reads_python_literals_outside_strings() {
        let v = parse_relaxed(r#"{"a": [0.0, Infinity], "b": -Infinity, "c": NaN, "d": "Infinity \" NaN"}"#)
            .expect("parse");
        assert_eq!(v["a"][1], Value::Null);
        assert_eq!(v["b"], Value::Null);
        assert_eq!(v["c"], Value::Null);
        assert_eq!(v["d"], "Infinity \" NaN");
    }

    #[test]
    fn errors_name_the_field() {
        let v: Value = serde_json::json!({"a": -1, "b": "x", "c": [1, "y"], "d": 0, "e": null});
        let f = Fields::new(&v, "text_config.").expect("object");
        assert!(f.positive("a").unwrap_err().to_string().contains("text_config.a"));
        assert!(f.bool_or("b", true).unwrap_err().to_string().contains("text_config.b"));
        assert!(f.opt_usize_list("c").unwrap_err().to_string().contains("text_config.c"));
        assert!(f.positive("d").unwrap_err().to_string().contains("must be positive"));
        assert_eq!(f.positive_or("e", 7).expect("default"), 7);
        assert!(f.positive("zz").unwrap_err().to_string().contains("missing"));
    }
}
