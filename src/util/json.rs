//! serde helpers for report fields: serde_json writes a non-finite `f64` as
//! `null`, so every float a report may hold as NaN or ±Inf is read back
//! through [`f64_or_nan`] (`null` becomes NaN; which non-finite value it was
//! is not recoverable, and no reader needs it).

use serde::{Deserialize, Deserializer};

/// An `f64` field written by serde_json: a number, or `null` for NaN / ±Inf.
pub fn f64_or_nan<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
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
}
