//! Turning model sources (GGUF files, Hugging Face folders, seeded synthetic
//! geometries) into `.ninfer` v3 artifacts without requantization.

pub mod gguf;
pub mod tokenizer;
