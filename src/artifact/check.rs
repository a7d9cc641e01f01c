//! The one check of an artifact's hyperparameters: ranges (every value the
//! forward pass divides by, exponentiates or indexes with) and agreement with
//! the tensor shapes. `writer` runs it before writing (so `ninfer-convert`
//! refuses a source whose metadata disagrees with its tensors) and `reader`
//! at every open (so an edited or corrupted artifact is refused before any
//! window). Errors name the key (`hparams.d_model`, with the GGUF key it
//! comes from) and the value; callers add the file.
//!
//! It checks the metadata against itself and the shapes; byte-level checks of
//! the tensor table (offsets, lengths, overlaps) are `reader`'s.

use anyhow::{bail, Result};

use super::meta::HParams;
use super::names::{blk, OUTPUT, OUTPUT_NORM, TOKEN_EMBD};

/// The GGUF key (after `<arch>.`) a hyperparameter is read from, for messages.
fn gguf_key(field: &str) -> &'static str {
    match field {
        "n_layers" => "block_count",
        "d_model" => "embedding_length",
        "n_heads" => "attention.head_count",
        "n_kv_heads" => "attention.head_count_kv",
        "d_head" => "attention.key_length",
        "d_head_v" => "attention.value_length",
        "d_ffn" => "feed_forward_length",
        "n_vocab" => "vocab_size / token_embd rows",
        "rms_eps" => "attention.layer_norm_rms_epsilon",
        "rope_base" => "rope.freq_base",
        "rope_base_local" => "rope.local.freq_base",
        "rope_scale" => "rope.scaling.factor",
        "rope_dim" => "rope.dimension_count",
        "sliding_window" => "attention.sliding_window",
        "attn_scale" => "attention.key_length / query_pre_attn_scalar",
        "attn_softcap" => "attn_logit_softcapping",
        "final_softcap" => "final_logit_softcapping",
        "moe.n_experts" => "expert_count",
        "moe.n_experts_used" => "expert_used_count",
        "moe.d_ffn_expert" => "expert_feed_forward_length",
        "hybrid.linear_layers" => "full_attention_interval",
        "hybrid.n_k_heads" => "ssm.group_count",
        "hybrid.n_v_heads" => "ssm.time_step_rank",
        "hybrid.d_k" => "ssm.state_size",
        "hybrid.d_v" => "ssm.inner_size / ssm.time_step_rank",
        "hybrid.conv_kernel" => "ssm.conv_kernel",
        "hybrid.d_ffn_shared" => "expert_shared_feed_forward_length",
        _ => "derived",
    }
}

fn key(field: &str) -> String {
    format!("hparams.{field} (GGUF {})", gguf_key(field))
}

/// Checks the ranges of `hp`.
pub fn check_ranges(hp: &HParams) -> Result<()> {
    let counts = [
        ("n_layers", hp.n_layers),
        ("d_model", hp.d_model),
        ("n_heads", hp.n_heads),
        ("n_kv_heads", hp.n_kv_heads),
        ("d_head", hp.d_head),
        ("d_head_v", hp.d_head_v),
        ("d_ffn", hp.d_ffn),
        ("n_vocab", hp.n_vocab),
    ];
    for (f, v) in counts {
        // 2^24: far above any model's dimension, and products of two stay exact in f64 and u64.
        if !(1..=1 << 24).contains(&v) {
            bail!("{} = {v}: must be in 1..=16777216", key(f));
        }
    }
    if hp.n_heads % hp.n_kv_heads != 0 {
        bail!("{} = {}: must divide hparams.n_heads = {}", key("n_kv_heads"), hp.n_kv_heads, hp.n_heads);
    }
    let positive = |f: &str, v: f64, max: f64| -> Result<()> {
        if !(v.is_finite() && v > 0.0 && v <= max) {
            bail!("{} = {v}: must be finite, > 0 and <= {max}", key(f));
        }
        Ok(())
    };
    positive("rms_eps", hp.rms_eps, 0.1)?;
    positive("rope_scale", hp.rope_scale, 1e6)?;
    positive("embed_scale", hp.embed_scale, 1e6)?;
    // q·k is scaled by d_head^-0.5 or query_pre_attn_scalar^-0.5: never above 1.
    positive("attn_scale", hp.attn_scale, 1.0)?;
    for (f, base) in [("rope_base", hp.rope_base), ("rope_base_local", hp.rope_base_local)] {
        if !(base.is_finite() && base > 1.0) {
            bail!("{} = {base}: must be finite and > 1", key(f));
        }
    }
    if hp.rope_dim < 2 || hp.rope_dim % 2 != 0 || hp.rope_dim > hp.d_head {
        bail!("{} = {}: must be even, >= 2 and <= hparams.d_head = {}", key("rope_dim"), hp.rope_dim, hp.d_head);
    }
    for (f, cap) in [("attn_softcap", hp.attn_softcap), ("final_softcap", hp.final_softcap)] {
        if let Some(c) = cap {
            positive(f, c, 1e6)?;
        }
    }
    if hp.sliding_window.len() != hp.n_layers {
        bail!("{}: {} entries for hparams.n_layers = {} layers", key("sliding_window"), hp.sliding_window.len(), hp.n_layers);
    }
    if let Some(m) = &hp.moe {
        if !(1..=1 << 16).contains(&m.n_experts) {
            bail!("{} = {}: must be in 1..=65536", key("moe.n_experts"), m.n_experts);
        }
        if !(1..=m.n_experts).contains(&m.n_experts_used) {
            bail!("{} = {}: must be in 1..=hparams.moe.n_experts = {}", key("moe.n_experts_used"), m.n_experts_used, m.n_experts);
        }
        if !(1..=1 << 24).contains(&m.d_ffn_expert) {
            bail!("{} = {}: must be in 1..=16777216", key("moe.d_ffn_expert"), m.d_ffn_expert);
        }
    }
    if let Some(h) = &hp.hybrid {
        for (f, v) in [
            ("hybrid.n_k_heads", h.n_k_heads),
            ("hybrid.n_v_heads", h.n_v_heads),
            ("hybrid.d_k", h.d_k),
            ("hybrid.d_v", h.d_v),
            ("hybrid.d_ffn_shared", h.d_ffn_shared),
        ] {
            if !(1..=1 << 24).contains(&v) {
                bail!("{} = {v}: must be in 1..=16777216", key(f));
            }
        }
        if h.n_v_heads % h.n_k_heads != 0 {
            bail!("{} = {}: must be a multiple of hparams.hybrid.n_k_heads = {}", key("hybrid.n_v_heads"), h.n_v_heads, h.n_k_heads);
        }
        if !(1..=64).contains(&h.conv_kernel) {
            bail!("{} = {}: must be in 1..=64", key("hybrid.conv_kernel"), h.conv_kernel);
        }
        if h.linear_layers.len() != hp.n_layers {
            bail!("{}: {} entries for hparams.n_layers = {} layers", key("hybrid.linear_layers"), h.linear_layers.len(), hp.n_layers);
        }
        if hp.moe.is_none() {
            bail!("hparams.hybrid without hparams.moe: the hybrid schedule is only known with routed experts (qwen3next)");
        }
    }
    if let Some(l) = hp.sliding_window.iter().position(|w| *w == Some(0)) {
        bail!("hparams.sliding_window[{l}] (GGUF {}) = 0: a sliding window holds at least the query's own position", gguf_key("sliding_window"));
    }
    Ok(())
}

/// Checks `hp` (ranges, then every tensor the forward pass reads against the
/// shape the hyperparameters imply, then that no block lies beyond
/// `n_layers`). `shape_of` gives a tensor's logical shape (outermost first)
/// or `None` when it is absent; `names` lists every tensor.
pub fn check_hparams<'a>(
    hp: &HParams,
    shape_of: impl Fn(&str) -> Option<&'a [u64]>,
    names: impl Iterator<Item = &'a str>,
) -> Result<()> {
    check_ranges(hp)?;
    let q = (hp.n_heads * hp.d_head) as u64;
    let k = (hp.n_kv_heads * hp.d_head) as u64;
    let v = (hp.n_kv_heads * hp.d_head_v) as u64;
    let o_in = (hp.n_heads * hp.d_head_v) as u64;
    let (d, f, vocab) = (hp.d_model as u64, hp.d_ffn as u64, hp.n_vocab as u64);
    let implied = "n_vocab, d_model, n_heads, n_kv_heads, d_head, d_head_v, d_ffn";
    let want = |name: &str, shape: &[u64]| -> Result<()> {
        match shape_of(name) {
            Some(got) if got == shape => Ok(()),
            Some(got) => bail!(
                "tensor {name} has shape {got:?}, the hyperparameters ({implied}: {}, {}, {}, {}, {}, {}, {}) imply {shape:?}",
                hp.n_vocab,
                hp.d_model,
                hp.n_heads,
                hp.n_kv_heads,
                hp.d_head,
                hp.d_head_v,
                hp.d_ffn
            ),
            None => bail!("tensor {name} is missing (hparams.n_layers = {})", hp.n_layers),
        }
    };
    want(TOKEN_EMBD, &[vocab, d])?;
    want(OUTPUT_NORM, &[d])?;
    if !hp.tied_embeddings {
        want(OUTPUT, &[vocab, d])?;
    }
    for l in 0..hp.n_layers {
        let w = |n: &str| blk(l, &format!("{n}.weight"));
        // llama.cpp names qwen3next's pre-FFN norm post_attention_norm.
        let ffn_norm = if hp.hybrid.is_some() { "post_attention_norm" } else { "ffn_norm" };
        for n in ["attn_norm", ffn_norm] {
            want(&w(n), &[d])?;
        }
        let linear = hp.hybrid.as_ref().filter(|h| h.linear_layers[l]);
        if let Some(h) = linear {
            let (nv, vd, c) = (h.n_v_heads as u64, (h.n_v_heads * h.d_v) as u64, h.conv_channels() as u64);
            let lin_want = |name: &str, shape: &[u64]| -> Result<()> {
                match shape_of(name) {
                    Some(got) if got == shape => Ok(()),
                    Some(got) => bail!(
                        "tensor {name} has shape {got:?}, the hyperparameters (hparams.hybrid n_k_heads, n_v_heads, d_k, d_v, conv_kernel \
                         = {}, {}, {}, {}, {}; d_model {d}) imply {shape:?}",
                        h.n_k_heads,
                        h.n_v_heads,
                        h.d_k,
                        h.d_v,
                        h.conv_kernel
                    ),
                    None => bail!("tensor {name} is missing (layer {l} is a linear-attention layer in hparams.hybrid.linear_layers)"),
                }
            };
            lin_want(&w("attn_qkv"), &[c, d])?;
            lin_want(&w("attn_gate"), &[vd, d])?;
            lin_want(&w("ssm_ba"), &[2 * nv, d])?;
            lin_want(&w("ssm_conv1d"), &[c, h.conv_kernel as u64])?;
            lin_want(&blk(l, "ssm_a"), &[nv])?;
            lin_want(&blk(l, "ssm_dt.bias"), &[nv])?;
            lin_want(&w("ssm_norm"), &[h.d_v as u64])?;
            lin_want(&w("ssm_out"), &[d, vd])?;
        } else {
            // A gated query (qwen3next): per head, d_head query rows then d_head gate rows.
            want(&w("attn_q"), &[if hp.hybrid.is_some() { 2 * q } else { q }, d])?;
            want(&w("attn_k"), &[k, d])?;
            want(&w("attn_v"), &[v, d])?;
            want(&w("attn_output"), &[d, o_in])?;
        }
        if let Some(h) = &hp.hybrid {
            let fs = h.d_ffn_shared as u64;
            want(&w("ffn_gate_inp_shexp"), &[1, d])?;
            want(&w("ffn_gate_shexp"), &[fs, d])?;
            want(&w("ffn_up_shexp"), &[fs, d])?;
            want(&w("ffn_down_shexp"), &[d, fs])?;
        }
        match &hp.moe {
            None => {
                want(&w("ffn_gate"), &[f, d])?;
                want(&w("ffn_up"), &[f, d])?;
                want(&w("ffn_down"), &[d, f])?;
            }
            Some(m) => {
                let (n_e, fe) = (m.n_experts as u64, m.d_ffn_expert as u64);
                let moe_want = |name: &str, shape: &[u64]| -> Result<()> {
                    match shape_of(name) {
                        Some(got) if got == shape => Ok(()),
                        Some(got) => bail!(
                            "tensor {name} has shape {got:?}, the hyperparameters ({}, {}, d_model) = ({n_e}, {fe}, {d}) imply {shape:?}",
                            key("moe.n_experts"),
                            key("moe.d_ffn_expert")
                        ),
                        None => bail!("tensor {name} is missing ({} = {n_e})", key("moe.n_experts")),
                    }
                };
                moe_want(&w("ffn_gate_inp"), &[n_e, d])?;
                moe_want(&w("ffn_gate_exps"), &[n_e, fe, d])?;
                moe_want(&w("ffn_up_exps"), &[n_e, fe, d])?;
                moe_want(&w("ffn_down_exps"), &[n_e, d, fe])?;
            }
        }
        if hp.qkv_bias {
            want(&blk(l, "attn_q.bias"), &[q])?;
            want(&blk(l, "attn_k.bias"), &[k])?;
            want(&blk(l, "attn_v.bias"), &[v])?;
        }
        if hp.qk_norm && linear.is_none() {
            want(&w("attn_q_norm"), &[hp.d_head as u64])?;
            want(&w("attn_k_norm"), &[hp.d_head as u64])?;
        }
        if hp.post_norms {
            want(&w("post_attention_norm"), &[d])?;
            want(&w("post_ffw_norm"), &[d])?;
        }
    }
    for name in names {
        let block = name.strip_prefix("blk.").and_then(|r| r.split_once('.')).and_then(|(n, _)| n.parse::<usize>().ok());
        if let Some(b) = block.filter(|&b| b >= hp.n_layers) {
            bail!("tensor {name} is in block {b}, but {} = {} (the metadata disagrees with the tensors)", key("n_layers"), hp.n_layers);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::artifact::meta::{Activation, RopeStyle};
    use std::collections::HashMap;

    fn hp() -> HParams {
        HParams {
            n_layers: 1,
            d_model: 8,
            n_heads: 2,
            n_kv_heads: 1,
            d_head: 4,
            d_head_v: 4,
            d_ffn: 16,
            n_vocab: 10,
            rms_eps: 1e-5,
            rope_base: 10000.0,
            rope_base_local: 10000.0,
            rope_scale: 1.0,
            rope_dim: 4,
            rope_style: RopeStyle::Normal,
            sliding_window: vec![None],
            context_length: 64,
            embed_scale: 1.0,
            attn_scale: 0.5,
            attn_softcap: None,
            final_softcap: None,
            activation: Activation::Silu,
            qkv_bias: false,
            qk_norm: false,
            post_norms: false,
            tied_embeddings: true,
            moe: None, hybrid: None,
        }
    }

    fn shapes() -> HashMap<String, Vec<u64>> {
        let mut m = HashMap::new();
        m.insert(TOKEN_EMBD.to_string(), vec![10, 8]);
        m.insert(OUTPUT_NORM.to_string(), vec![8]);
        for (n, s) in [
            ("attn_norm", vec![8]),
            ("ffn_norm", vec![8]),
            ("attn_q", vec![8, 8]),
            ("attn_k", vec![4, 8]),
            ("attn_v", vec![4, 8]),
            ("attn_output", vec![8, 8]),
            ("ffn_gate", vec![16, 8]),
            ("ffn_up", vec![16, 8]),
            ("ffn_down", vec![8, 16]),
        ] {
            m.insert(blk(0, &format!("{n}.weight")), s);
        }
        m
    }

    fn check(hp: &HParams, m: &HashMap<String, Vec<u64>>) -> Result<()> {
        check_hparams(hp, |n| m.get(n).map(Vec::as_slice), m.keys().map(String::as_str))
    }

    #[test]
    fn consistent_geometry_passes() {
        check(&hp(), &shapes()).unwrap();
    }

    #[test]
    fn every_bad_range_names_its_key() {
        let cases: Vec<(Box<dyn Fn(&mut HParams)>, &str)> = vec![
            (Box::new(|h| h.rms_eps = -1.0), "hparams.rms_eps"),
            (Box::new(|h| h.rms_eps = 0.0), "hparams.rms_eps"),
            (Box::new(|h| h.rope_base = 0.0), "hparams.rope_base"),
            (Box::new(|h| h.rope_base_local = f64::NAN), "hparams.rope_base_local"),
            (Box::new(|h| h.rope_dim = 0), "hparams.rope_dim"),
            (Box::new(|h| h.rope_dim = 3), "hparams.rope_dim"),
            (Box::new(|h| h.rope_dim = 8), "hparams.rope_dim"),
            (Box::new(|h| h.attn_scale = 1e6), "hparams.attn_scale"),
            (Box::new(|h| h.attn_scale = 0.0), "hparams.attn_scale"),
            (Box::new(|h| h.embed_scale = f64::INFINITY), "hparams.embed_scale"),
            (Box::new(|h| h.sliding_window = vec![Some(0)]), "hparams.sliding_window[0]"),
            (Box::new(|h| h.sliding_window = vec![]), "hparams.sliding_window"),
            (Box::new(|h| h.n_kv_heads = 3), "hparams.n_kv_heads"),
            (Box::new(|h| h.d_model = 0), "hparams.d_model"),
            (Box::new(|h| h.final_softcap = Some(-1.0)), "hparams.final_softcap"),
        ];
        for (edit, want) in cases {
            let mut h = hp();
            edit(&mut h);
            let e = format!("{:#}", check(&h, &shapes()).unwrap_err());
            assert!(e.contains(want), "want {want}: {e}");
        }
    }

    #[test]
    fn shapes_must_agree_with_the_hyperparameters() {
        let mut h = hp();
        h.d_model = 16;
        assert!(format!("{:#}", check(&h, &shapes()).unwrap_err()).contains("token_embd.weight has shape [10, 8]"));
        let mut h = hp();
        h.n_vocab = 11;
        assert!(check(&h, &shapes()).is_err());
        let mut m = shapes();
        m.insert(blk(0, "attn_q.weight"), vec![8, 8].into_iter().rev().collect::<Vec<u64>>());
        m.insert(blk(0, "ffn_down.weight"), vec![16, 8]);
        assert!(format!("{:#}", check(&hp(), &m).unwrap_err()).contains("ffn_down.weight has shape [16, 8]"));
        let mut m = shapes();
        m.insert(blk(1, "attn_q.weight"), vec![8, 8]);
        assert!(format!("{:#}", check(&hp(), &m).unwrap_err()).contains("hparams.n_layers (GGUF block_count) = 1"));
        let mut h = hp();
        h.n_layers = 2;
        h.sliding_window = vec![None, None];
        assert!(format!("{:#}", check(&h, &shapes()).unwrap_err()).contains("blk.1.attn_norm.weight is missing"));
    }

    #[test]
    fn expert_banks_must_agree_with_the_expert_geometry() {
        use crate::artifact::meta::MoeParams;
        let mut h = hp();
        h.moe = Some(MoeParams { n_experts: 4, n_experts_used: 2, d_ffn_expert: 6, norm_topk_prob: true });
        let mut m = shapes();
        for n in ["ffn_gate", "ffn_up", "ffn_down"] {
            m.remove(&blk(0, &format!("{n}.weight")));
        }
        m.insert(blk(0, "ffn_gate_inp.weight"), vec![4, 8]);
        m.insert(blk(0, "ffn_gate_exps.weight"), vec![4, 6, 8]);
        m.insert(blk(0, "ffn_up_exps.weight"), vec![4, 6, 8]);
        m.insert(blk(0, "ffn_down_exps.weight"), vec![4, 8, 6]);
        check(&h, &m).unwrap();
        let mut three = h.clone();
        three.moe.as_mut().unwrap().n_experts = 3;
        let e = format!("{:#}", check(&three, &m).unwrap_err());
        assert!(e.contains("blk.0.ffn_gate_inp.weight has shape [4, 8]") && e.contains("GGUF expert_count"), "{e}");
        let mut topk = h.clone();
        topk.moe.as_mut().unwrap().n_experts_used = 5;
        let e = format!("{:#}", check(&topk, &m).unwrap_err());
        assert!(e.contains("hparams.moe.n_experts_used (GGUF expert_used_count) = 5"), "{e}");
        let mut gone = m.clone();
        gone.remove(&blk(0, "ffn_up_exps.weight"));
        assert!(format!("{:#}", check(&h, &gone).unwrap_err()).contains("tensor blk.0.ffn_up_exps.weight is missing"));
    }
}
