//! Tensor names inside an artifact (GGUF's naming, for every source) and the
//! set each architecture requires.

use super::meta::{Architecture, HParams};

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

/// Tensors the forward pass reads for this architecture and shape.
pub fn required_tensors(hp: &HParams, arch: Architecture) -> Vec<String> {
    let mut v = vec![TOKEN_EMBD.to_string(), OUTPUT_NORM.to_string()];
    if !hp.tied_embeddings {
        v.push(OUTPUT.to_string());
    }
    for l in 0..hp.n_layers {
        for n in ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"] {
            v.push(blk(l, &format!("{n}.weight")));
        }
        if hp.qkv_bias {
            for n in ["attn_q", "attn_k", "attn_v"] {
                v.push(blk(l, &format!("{n}.bias")));
            }
        }
        if hp.qk_norm {
            v.push(blk(l, "attn_q_norm.weight"));
            v.push(blk(l, "attn_k_norm.weight"));
        }
        if hp.post_norms {
            v.push(blk(l, "post_attention_norm.weight"));
            v.push(blk(l, "post_ffw_norm.weight"));
        }
    }
    let _ = arch;
    v
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
