//! Tensor names inside an artifact (GGUF's naming, for every source); the
//! set each geometry requires is checked by `check`.

pub const TOKEN_EMBD: &str = "token_embd.weight";
pub const OUTPUT_NORM: &str = "output_norm.weight";
pub const OUTPUT: &str = "output.weight";

/// `blk.{layer}.{name}`.
pub fn blk(layer: usize, name: &str) -> String {
    format!("blk.{layer}.{name}")
}

/// The tensor group of a name: `blk.3.attn_q.weight` -> `attn_q`.
pub fn group_of(name: &str) -> String {
    let rest = name.strip_prefix("blk.").map_or(name, |r| r.split_once('.').map_or(r, |(_, t)| t));
    rest.trim_end_matches(".weight").trim_end_matches(".bias").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn groups() {
        assert_eq!(group_of("blk.12.attn_q.weight"), "attn_q");
        assert_eq!(group_of("blk.0.attn_q.bias"), "attn_q");
        assert_eq!(group_of("token_embd.weight"), "token_embd");
    }
}
