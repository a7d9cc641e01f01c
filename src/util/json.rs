//! serde helpers for report fields: serde_json writes a non-finite `f64` as
//! `null`, so every float a report may hold as NaN or ±Inf is read back
//! through [`f64_or_nan`] (`null` becomes NaN; which non-finite value it was
//! is not recoverable, and no reader needs it); and [`first_difference`],
//! which names the first field where two JSON blocks differ.

use serde::{Deserialize, Deserializer};
use serde_json::Value;

/// An `f64` field written by serde_json: a number, or `null` for NaN / ±Inf.
pub fn f64_or_nan<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// The first leaf where two JSON values differ, as a dotted path.
pub fn first_difference(a: &Value, b: &Value, at: &str) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            keys.into_iter().find_map(|k| {
                let (va, vb) = (x.get(k).unwrap_or(&Value::Null), y.get(k).unwrap_or(&Value::Null));
                first_difference(va, vb, &format!("{at}.{k}"))
            })
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            x.iter().zip(y).enumerate().find_map(|(i, (va, vb))| first_difference(va, vb, &format!("{at}[{i}]")))
        }
        _ if a == b => None,
        _ => Some(format!("{at} is {a} there and {b} here")),
    }
}

#[cfg(test)]
mod tests {
    #[derive(serde::Deserialize)]
    struct T {
        #[serde(deserialize_with = "super::f64_or_nan")]
        x: f64,
    }

    #[test]
    fn null_reads_as_nan() {
        let t: T = serde_json::from_str(r#"{"x": null}"#).unwrap();
        assert!(t.x.is_nan());
        let t: T = serde_json::from_str(r#"{"x": 1.5}"#).unwrap();
        assert_eq!(t.x, 1.5);
        assert!(serde_json::from_str::<T>(r#"{"x": "a"}"#).is_err());
    }

    use super::first_difference;

    #[test]
    fn first_difference_names_the_leaf() {
        let a = serde_json::json!({"x": {"kv_format": "fp8", "n": [1, 2]}, "y": 1});
        assert_eq!(first_difference(&a, &a, "execution"), None);
        let b = serde_json::json!({"x": {"kv_format": "bf16", "n": [1, 2]}, "y": 1});
        assert_eq!(first_difference(&a, &b, "execution").unwrap(), "execution.x.kv_format is \"fp8\" there and \"bf16\" here");
        let c = serde_json::json!({"x": {"kv_format": "fp8", "n": [1, 3]}, "y": 1});
        assert!(first_difference(&a, &c, "e").unwrap().starts_with("e.x.n[1]"));
    }
}
