//! infernix-perplexity: scores a fixed text corpus with a quantized LLM
//! artifact and reports causal perplexity, KL divergence against a recorded
//! reference, and CI quality gates.
//!
//! The modules follow the pipeline: `artifact` (the `.ninfer` container),
//! `convert` (GGUF / Hugging Face sources into artifacts), `text` (corpus and
//! tokenizer), `plan` (windows), `model` + `backend` (the forward pass),
//! `score` (NLL statistics) and `report` (report.json and the table);
//! `compare` is the CI quality gate between two reports, `merge` joins the
//! reports of `--shard` runs.
//!
//! The library entry point is [`evaluate()`]: one evaluation from a
//! [`config::RunConfig`] to a typed [`report::Report`] (see
//! `examples/evaluate.rs`). `app` is the command line's wrapper around it.

pub mod app;
pub mod artifact;
pub mod backend;
pub mod cli;
pub mod compare;
pub mod kv;
pub mod top_tokens;
pub mod config;
pub mod convert;
pub mod evaluate;
pub mod merge;
pub mod model;
pub mod plan;
pub mod report;
pub mod resume;
pub mod score;
pub mod text;
pub mod util;

pub use evaluate::{evaluate, Event};
