//! Text input: corpus manifests and the tokenizer.

pub mod corpus;
