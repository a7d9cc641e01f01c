//! Text side of the evaluator: the tokenizer wrapper that turns corpus text
//! into token ids with the artifact's BOS/EOS policy.

pub mod tokenizer;
