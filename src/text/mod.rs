//! Text input: corpus manifests (streams, data root, checksums) and the
//! tokenizer wrapper that turns text into token ids with the artifact's
//! BOS/EOS policy.

pub mod corpus;
pub mod tokenizer;
