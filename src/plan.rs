//! The window planner: a pure function from a stream length and a scoring
//! method to the list of windows the model evaluates.
//!
//! It owns the protocol of which token predicts which (which positions are
//! inputs, which are scored targets, where BOS replaces a token) and the
//! validation of the planner's settings (`--context`, `--stride`, `--chunks`,
//! `--prefill-chunk`), the tokenized [`Stream`] with its windows, and the
//! split of a run's windows into shards ([`Shard`], `--shard K/N`). It does
//! not touch models or scores: the caller slices the stream with the
//! returned positions.
//!
//! Conventions shared by every method, for a stream `x[0..N)`:
//! - a window's input tokens are `x[begin..end)`, evaluated from empty state
//!   (no KV cache carried between windows, streams never share history);
//! - its targets are the stream positions `first_target..end`; target `t` is
//!   predicted by the logits at window position `t - 1 - begin`, i.e. from all
//!   window tokens before it; `scored = end - first_target`;
//! - `replace_first_with_bos`: input token 0 (stream position `begin`) is
//!   replaced by the vocabulary's BOS before evaluation. The replaced token is
//!   never a target of that window (targets start after it).

use anyhow::{bail, Result};

/// Default `--context` of the sliding method (the seed protocol).
pub const DEFAULT_CONTEXT: usize = 4096;
/// Default `--stride` of the sliding method.
pub const DEFAULT_STRIDE: usize = 2048;
/// Default `--prefill-chunk` in tokens.
pub const DEFAULT_PREFILL_CHUNK: usize = 1024;
/// `--prefill-chunk` must be a multiple of this many tokens.
pub const PREFILL_CHUNK_MULTIPLE: usize = 128;

/// How a stream is cut into windows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// Overlapping windows of at most `context` tokens; each window after the
    /// first scores `stride` new targets with `context - stride` tokens of
    /// history in front of them. Every token after `x[0]` is scored once.
    Sliding { context: usize, stride: usize },
    /// llama.cpp's `llama-perplexity` method: non-overlapping chunks of
    /// `context` tokens, the second half of each scored (see [`plan_windows`]).
    Chunks { context: usize },
    /// llama.cpp's strided method, `llama-perplexity -c context --ppl-stride
    /// stride` (its `perplexity_v2`): windows of [`ppl_stride_window`] tokens
    /// starting every `stride` tokens, the last `stride` tokens of each scored.
    PplStride { context: usize, stride: usize },
}

/// The window length llama.cpp's strided method uses for `-c context
/// --ppl-stride stride` when its context holds one sequence (`-b` below
/// `2 * context`): `main()` adds `stride / 2` to `n_ctx` and the context pads
/// it to a multiple of 256 (`GGML_PAD(cparams.n_ctx, 256)` in
/// `src/llama-context.cpp`); `perplexity_v2` then uses `llama_n_ctx(ctx)`.
pub fn ppl_stride_window(context: usize, stride: usize) -> usize {
    (context + stride / 2).div_ceil(256) * 256
}

impl Method {
    /// The method's name as the CLI spells it (`--method`).
    pub fn name(&self) -> &'static str {
        match self {
            Method::Sliding { .. } => "sliding",
            Method::Chunks { .. } => "chunks",
            Method::PplStride { .. } => "ppl-stride",
        }
    }

    /// `--context` as given (for ppl-stride llama.cpp's `-c`, not the window length).
    pub fn context(&self) -> usize {
        match *self {
            Method::Sliding { context, .. } | Method::Chunks { context } | Method::PplStride { context, .. } => context,
        }
    }

    /// The stride of the sliding and ppl-stride methods; `None` for chunks.
    pub fn stride(&self) -> Option<usize> {
        match *self {
            Method::Sliding { stride, .. } | Method::PplStride { stride, .. } => Some(stride),
            Method::Chunks { .. } => None,
        }
    }
}

impl Default for Method {
    fn default() -> Self {
        Method::Sliding { context: DEFAULT_CONTEXT, stride: DEFAULT_STRIDE }
    }
}

/// One evaluation of the model: inputs `stream[begin..end)`, targets
/// `stream[first_target..end)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Window {
    /// Position of the window in the stream's plan, from 0.
    pub index: usize,
    /// First input token (stream position, inclusive).
    pub begin: usize,
    /// One past the last input token and the last target (exclusive).
    pub end: usize,
    /// First scored target (stream position); `begin < first_target <= end`.
    pub first_target: usize,
    /// Whether input token 0 is replaced by the vocabulary's BOS.
    pub replace_first_with_bos: bool,
}

impl Window {
    /// Number of input tokens the model evaluates.
    pub fn n_input(&self) -> usize {
        self.end - self.begin
    }

    /// Number of scored targets.
    pub fn scored(&self) -> usize {
        self.end - self.first_target
    }

    /// Number of window tokens in front of the first target (its history).
    pub fn n_context(&self) -> usize {
        self.first_target - self.begin
    }

    /// Window-relative index of the logits row that predicts the first target;
    /// rows `first_logit_row() .. n_input() - 1` predict the targets in order.
    pub fn first_logit_row(&self) -> usize {
        self.first_target - self.begin - 1
    }
}

/// Plans the windows of one stream of `n_tokens` tokens.
///
/// `bos` is the vocabulary's BOS id when the vocabulary adds BOS
/// (`tokenizer.ggml.add_bos_token`), else `None`; only the chunks method uses
/// it. `max_windows` is `--chunks N`: only the first N windows are returned.
///
/// # Sliding
/// The first window is `[0, min(context, N))` and scores `[1, min(context, N))`.
/// Window `k >= 1` scores the `stride` targets starting at
/// `t_k = context + (k - 1) * stride` (fewer in the last window, which ends at
/// N) and begins `context - stride` tokens before `t_k`, so its length is at
/// most `context`. No BOS is inserted: a stream whose tokenizer adds BOS has
/// it at `x[0]`, which only the first window sees.
///
/// # Chunks (llama.cpp `tools/perplexity/perplexity.cpp`, `perplexity()`)
/// The exact correspondence, with llama.cpp's names:
/// - `n_chunk_max = tokens.size() / n_ctx` (remainder dropped) and
///   `n_chunk = min(params.n_chunks, n_chunk_max)` when `--chunks` is given;
///   here `N / context` and `max_windows`.
/// - chunk `i` decodes `tokens[start .. end)` with `start = i * n_ctx`,
///   `end = start + n_ctx` from a cleared KV cache: here `begin`, `end`.
/// - `if (add_bos && j == 0) tokens[seq_start] = llama_vocab_bos(vocab)` for
///   the decode only (restored afterwards): here `replace_first_with_bos`.
/// - `first = n_ctx/2`; `process_logits(.., all_logits, tokens + start + first,
///   n_ctx - 1 - first, ..)` scores `-log_softmax(logits[first + i])[tokens[start + first + i + 1]]`
///   for `i in 0 .. n_ctx - 1 - first`: logits rows `first ..= n_ctx - 2`
///   predict stream positions `start + first + 1 ..= start + n_ctx - 1`. Here
///   `first_target = begin + context / 2 + 1`, and `scored = context - context/2 - 1`
///   (255 for `n_ctx = 512`, llama.cpp's `count += n_ctx - first - 1`).
/// - `if (tokens.size() < 2*n_ctx)` llama.cpp refuses the input: here an error.
///
/// # PplStride (llama.cpp `perplexity_v2()`, used when `--ppl-stride S > 0`)
/// With `W = ppl_stride_window(context, S)` (llama.cpp's `n_ctx` there):
/// - `n_chunk_max = (N - W + S - 1) / S`, `n_chunk = min(--chunks, n_chunk_max)`;
/// - window `i` decodes `tokens[i*S .. i*S + W)` from a cleared KV cache;
/// - logits rows `j = W - S - 1 ..= W - 2` predict `tokens[start + j + 1]`:
///   the last `S` tokens of the window, `first_target = end - S`. Consecutive
///   windows' targets adjoin; the first `W - S` tokens of the stream and the
///   tail after the last window are never scored;
/// - no token is replaced: the loop writes BOS into `tokens[batch_start]` only
///   after `llama_decode` of the batch has run and restores it before the
///   next one, so the decode sees the stream's own tokens (a stream whose
///   vocabulary adds BOS has it at `x[0]`, which only window 0 sees);
/// - `N < 2 * W` and `N <= W` are refused, `S == 0` too; `S >= W` would index
///   a logits row before the window (llama.cpp does not check): an error here.
///
/// # Errors
/// Sliding: `stride == 0`, `context <= stride`, `N < 2`. Chunks: `context < 3`
/// (no target would be scored), `N < 2 * context`. PplStride: as above.
/// All: `max_windows == Some(0)`.
pub fn plan_windows(
    n_tokens: usize,
    method: &Method,
    bos: Option<u32>,
    max_windows: Option<usize>,
) -> Result<Vec<Window>> {
    if max_windows == Some(0) {
        bail!("--chunks is 0: it must be at least 1 (or left out to score every window)");
    }
    let limit = max_windows.unwrap_or(usize::MAX);
    match *method {
        Method::Sliding { context, stride } => plan_sliding(n_tokens, context, stride, bos.is_some(), limit),
        Method::Chunks { context } => plan_chunks(n_tokens, context, bos.is_some(), limit),
        Method::PplStride { context, stride } => plan_ppl_stride(n_tokens, context, stride, limit),
    }
}

/// Validates llama.cpp's `-c context --ppl-stride stride` and returns the
/// window length ([`ppl_stride_window`]).
pub fn validate_ppl_stride(context: usize, stride: usize) -> Result<usize> {
    if stride == 0 || context == 0 {
        bail!("ppl-stride method: -c {context} and --ppl-stride {stride} must both be at least 1");
    }
    let window = ppl_stride_window(context, stride);
    if stride >= window {
        bail!("--ppl-stride {stride} must be smaller than the window of {window} tokens (-c {context} + stride/2, padded to 256)");
    }
    Ok(window)
}

fn plan_ppl_stride(n_tokens: usize, context: usize, stride: usize, limit: usize) -> Result<Vec<Window>> {
    let window = validate_ppl_stride(context, stride)?;
    let n_min = window.saturating_mul(2);
    if n_tokens < n_min {
        bail!(
            "ppl-stride method: the stream has {n_tokens} tokens, fewer than two windows of {window} tokens \
             ({n_min}, llama.cpp's minimum for -c {context} --ppl-stride {stride})"
        );
    }
    let n_windows = (n_tokens - window).div_ceil(stride).min(limit);
    Ok((0..n_windows)
        .map(|i| {
            let begin = i * stride;
            let end = begin + window;
            Window { index: i, begin, end, first_target: end - stride, replace_first_with_bos: false }
        })
        .collect())
}

/// Windows after the first start mid-stream; when the vocabulary adds BOS,
/// their first input token (context, never a target, since `context > stride`)
/// is replaced by BOS, as llama.cpp does for its chunks, so every window sees
/// the start-of-sequence state the model was trained with.
fn plan_sliding(n_tokens: usize, context: usize, stride: usize, add_bos: bool, limit: usize) -> Result<Vec<Window>> {
    if stride == 0 {
        bail!("--stride is 0: it must be at least 1");
    }
    if context <= stride {
        bail!("--context {context} must be larger than --stride {stride}");
    }
    if n_tokens < 2 {
        bail!("sliding windows: the stream has {n_tokens} token(s); at least 2 are needed to score one");
    }
    let n_history = context - stride;
    let mut windows = Vec::new();
    let first_end = context.min(n_tokens);
    windows.push(Window { index: 0, begin: 0, end: first_end, first_target: 1, replace_first_with_bos: false });
    let mut first_target = first_end;
    while first_target < n_tokens && windows.len() < limit {
        let end = (first_target + stride).min(n_tokens);
        windows.push(Window {
            index: windows.len(),
            begin: first_target - n_history,
            end,
            first_target,
            replace_first_with_bos: add_bos,
        });
        first_target = end;
    }
    Ok(windows)
}

fn plan_chunks(n_tokens: usize, context: usize, add_bos: bool, limit: usize) -> Result<Vec<Window>> {
    if context < 3 {
        bail!("--context {context} is too small for the chunks method: at least 3 (a chunk scores context - context/2 - 1 tokens)");
    }
    let n_min = context.saturating_mul(2);
    if n_tokens < n_min {
        bail!(
            "chunks method: the stream has {n_tokens} tokens, fewer than two chunks of --context {context} \
             ({n_min} tokens, llama.cpp's minimum)"
        );
    }
    let n_chunks = (n_tokens / context).min(limit);
    let first = context / 2;
    Ok((0..n_chunks)
        .map(|k| {
            let begin = k * context;
            Window {
                index: k,
                begin,
                end: begin + context,
                first_target: begin + first + 1,
                replace_first_with_bos: add_bos,
            }
        })
        .collect())
}

/// Validates `--prefill-chunk`: a positive multiple of 128 tokens.
pub fn validate_prefill_chunk(n: usize) -> Result<()> {
    if n == 0 || n % PREFILL_CHUNK_MULTIPLE != 0 {
        bail!("--prefill-chunk {n} must be a positive multiple of {PREFILL_CHUNK_MULTIPLE}");
    }
    Ok(())
}

/// One tokenized input stream and its windows.
#[derive(Clone, Debug)]
pub struct Stream {
    pub name: String,
    pub domain: String,
    pub tokens: Vec<u32>,
    pub token_ids_sha256: String,
    pub windows: Vec<Window>,
    /// (n_tokens) the UTF-8 bytes each token covers (`score::bytes`); `None`
    /// when the tokenizer has no byte rule.
    pub byte_counts: Option<Vec<u32>>,
    /// Bytes of the stream's text (absent for `--tokens`).
    pub text_bytes: Option<usize>,
}

/// `--shard K/N`: shard `index` (0-based, `K`) of `count` (`N`) independent
/// processes. The run's windows are numbered in plan order (stream order, then
/// window order) from 0; window `g` belongs to shard `g % N`. Round-robin keeps
/// the shards' work within one window of each other whatever the streams'
/// lengths, and the same plan always gives the same split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub index: usize,
    pub count: usize,
}

impl Shard {
    /// Parses `K/N` (`0 <= K < N`); errors name the flag and the value.
    pub fn parse(spec: &str) -> Result<Shard> {
        let parsed = spec.split_once('/').and_then(|(k, n)| Some((k.trim().parse::<usize>().ok()?, n.trim().parse::<usize>().ok()?)));
        let Some((index, count)) = parsed else {
            bail!("--shard {spec}: expected K/N with whole numbers, shard K of N counted from 0 (e.g. 0/4)");
        };
        if count == 0 {
            bail!("--shard {spec}: N (the number of shards) must be at least 1");
        }
        if index >= count {
            bail!("--shard {spec}: K must be below N (shards are numbered 0 to {})", count - 1);
        }
        Ok(Shard { index, count })
    }

    /// Whether the window numbered `global_index` in plan order is this shard's.
    pub fn takes(&self, global_index: usize) -> bool {
        global_index % self.count == self.index
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Direct transcription of llama.cpp's `perplexity()` loop (b11434,
    /// tools/perplexity/perplexity.cpp) for n_seq = 1: returns per chunk
    /// (start, end, BOS replaced, [(logit row, target position)]).
    #[allow(clippy::type_complexity)]
    fn llama_cpp_chunks(
        n_tokens: usize,
        n_ctx: usize,
        add_bos: bool,
        n_chunks_param: i64,
    ) -> Option<Vec<(usize, usize, bool, Vec<(usize, usize)>)>> {
        if n_tokens < 2 * n_ctx {
            return None;
        }
        let n_chunk_max = n_tokens / n_ctx;
        let n_chunk = if n_chunks_param < 0 { n_chunk_max } else { (n_chunks_param as usize).min(n_chunk_max) };
        let first = n_ctx / 2;
        let mut out = Vec::new();
        for i in 0..n_chunk {
            let start = i * n_ctx;
            let end = start + n_ctx;
            // process_logits(n_vocab, logits[first..], tokens + start + first, n_ctx - 1 - first):
            // row i of the logits predicts tokens_data[i + 1].
            let n_token = n_ctx - 1 - first;
            let pairs = (0..n_token).map(|i| (first + i, start + first + i + 1)).collect();
            out.push((start, end, add_bos, pairs));
        }
        Some(out)
    }

    /// Direct transcription of llama.cpp's `perplexity_v2()` (b11434), given
    /// its `n_ctx` (the padded window): per window (start, end, [(logit row,
    /// target position)]), or `None` where it refuses the input.
    #[allow(clippy::type_complexity)]
    fn llama_cpp_ppl_stride(
        n_tokens: usize,
        n_ctx: usize,
        stride: usize,
        n_chunks_param: i64,
    ) -> Option<Vec<(usize, usize, Vec<(usize, usize)>)>> {
        if n_tokens < 2 * n_ctx || stride == 0 || n_tokens <= n_ctx {
            return None;
        }
        let n_chunk_max = (n_tokens - n_ctx).div_ceil(stride);
        let n_chunk = if n_chunks_param < 0 { n_chunk_max } else { (n_chunks_param as usize).min(n_chunk_max) };
        let mut out = Vec::new();
        for i in 0..n_chunk {
            let start = i * stride;
            let end = start + n_ctx;
            let pairs = (n_ctx - stride - 1..n_ctx - 1).map(|j| (j, start + j + 1)).collect();
            out.push((start, end, pairs));
        }
        Some(out)
    }

    #[test]
    fn ppl_stride_window_is_llama_cpp_context() {
        // -c 512 --ppl-stride 256: 512 + 128 = 640, padded to 768.
        assert_eq!(ppl_stride_window(512, 256), 768);
        assert_eq!(ppl_stride_window(128, 64), 256);
        assert_eq!(ppl_stride_window(256, 0), 256);
        assert_eq!(ppl_stride_window(2048, 512), 2304);
        let w = plan_windows(2000, &Method::PplStride { context: 512, stride: 256 }, Some(1), None).unwrap();
        // (2000 - 768 + 255) / 256 = 5 windows, targets [512, 768), [768, 1024), ...
        let got: Vec<_> = w.iter().map(|w| (w.begin, w.end, w.first_target)).collect();
        assert_eq!(got, vec![(0, 768, 512), (256, 1024, 768), (512, 1280, 1024), (768, 1536, 1280), (1024, 1792, 1536)]);
        assert!(w.iter().all(|w| w.scored() == 256 && !w.replace_first_with_bos));
        let e = plan_windows(1535, &Method::PplStride { context: 512, stride: 256 }, None, None).unwrap_err();
        assert!(e.to_string().contains("1535") && e.to_string().contains("1536"), "{e}");
        let e = plan_windows(10_000, &Method::PplStride { context: 100, stride: 300 }, None, None).unwrap_err();
        assert!(e.to_string().contains("--ppl-stride 300"), "{e}");
        assert_eq!(Method::PplStride { context: 512, stride: 256 }.name(), "ppl-stride");
    }

    #[test]
    fn sliding_small_example() {
        // N = 10, context 4, stride 2: [0,4) scores 1..4; then targets 4,5 with
        // 2 history tokens: [2,6); [4,8); [6,10).
        let w = plan_windows(10, &Method::Sliding { context: 4, stride: 2 }, None, None).unwrap();
        let got: Vec<_> = w.iter().map(|w| (w.begin, w.end, w.first_target)).collect();
        assert_eq!(got, vec![(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]);
        assert_eq!(w.iter().map(Window::scored).sum::<usize>(), 9);
        // A ragged tail: N = 11 adds a window scoring just target 10.
        let w = plan_windows(11, &Method::Sliding { context: 4, stride: 2 }, None, None).unwrap();
        assert_eq!((w[4].begin, w[4].end, w[4].first_target), (8, 11, 10));
    }

    #[test]
    fn sliding_short_stream_is_one_window() {
        let w = plan_windows(2, &Method::default(), Some(1), None).unwrap();
        assert_eq!(w, vec![Window { index: 0, begin: 0, end: 2, first_target: 1, replace_first_with_bos: false }]);
    }

    #[test]
    fn chunks_512_scores_255() {
        let w = plan_windows(1030, &Method::Chunks { context: 512 }, Some(2), None).unwrap();
        assert_eq!(w.len(), 2);
        assert_eq!((w[1].begin, w[1].end, w[1].first_target), (512, 1024, 512 + 257));
        assert!(w.iter().all(|w| w.scored() == 255 && w.replace_first_with_bos));
        assert_eq!(w[0].first_logit_row(), 256);
        // wiki.test.raw with SmolLM2: 303,415 tokens -> 592 chunks (tests/data/reference/README.md).
        let w = plan_windows(303_415, &Method::Chunks { context: 512 }, None, None).unwrap();
        assert_eq!(w.len(), 592);
        assert!(!w[0].replace_first_with_bos);
        // The first 40 chunks score 10,200 tokens (tests/data/reference/README.md).
        let w = plan_windows(303_415, &Method::Chunks { context: 512 }, None, Some(40)).unwrap();
        assert_eq!(w.iter().map(Window::scored).sum::<usize>(), 10_200);
    }

    #[test]
    fn invalid_settings_are_errors_naming_the_value() {
        let e = plan_windows(100, &Method::Sliding { context: 8, stride: 0 }, None, None).unwrap_err();
        assert!(e.to_string().contains("--stride is 0"), "{e}");
        let e = plan_windows(100, &Method::Sliding { context: 8, stride: 8 }, None, None).unwrap_err();
        assert!(e.to_string().contains("--context 8") && e.to_string().contains("--stride 8"), "{e}");
        let e = plan_windows(1, &Method::Sliding { context: 8, stride: 4 }, None, None).unwrap_err();
        assert!(e.to_string().contains("1 token"), "{e}");
        let e = plan_windows(0, &Method::Sliding { context: 8, stride: 4 }, None, None).unwrap_err();
        assert!(e.to_string().contains("0 token"), "{e}");
        let e = plan_windows(1023, &Method::Chunks { context: 512 }, None, None).unwrap_err();
        assert!(e.to_string().contains("1023") && e.to_string().contains("1024"), "{e}");
        let e = plan_windows(100, &Method::Chunks { context: 2 }, None, None).unwrap_err();
        assert!(e.to_string().contains("--context 2"), "{e}");
        let e = plan_windows(100, &Method::default(), None, Some(0)).unwrap_err();
        assert!(e.to_string().contains("--chunks is 0"), "{e}");
    }

    #[test]
    fn prefill_chunk_validation() {
        assert!(validate_prefill_chunk(1024).is_ok());
        assert!(validate_prefill_chunk(128).is_ok());
        for bad in [0, 1, 100, 1000, 1025] {
            let e = validate_prefill_chunk(bad).unwrap_err();
            assert!(e.to_string().contains(&format!("--prefill-chunk {bad} ")), "{e}");
        }
    }

    fn sliding_params() -> impl Strategy<Value = (usize, usize, usize)> {
        (2usize..64).prop_flat_map(|context| (Just(context), 1..context, 2usize..2000))
    }

    #[test]
    fn sliding_later_windows_start_with_bos_when_the_vocabulary_adds_it() {
        let w = plan_windows(10_000, &Method::Sliding { context: 4096, stride: 2048 }, Some(2), None).unwrap();
        assert!(!w[0].replace_first_with_bos);
        assert!(w[1..].iter().all(|w| w.replace_first_with_bos && w.begin < w.first_target));
        let w = plan_windows(10_000, &Method::Sliding { context: 4096, stride: 2048 }, None, None).unwrap();
        assert!(w.iter().all(|w| !w.replace_first_with_bos));
    }

    proptest! {
        #[test]
        fn sliding_scores_every_target_once((context, stride, n) in sliding_params()) {
            let w = plan_windows(n, &Method::Sliding { context, stride }, None, None).unwrap();
            let mut hits = vec![0u32; n];
            for (i, win) in w.iter().enumerate() {
                prop_assert_eq!(win.index, i);
                prop_assert!(win.begin < win.first_target && win.first_target < win.end);
                prop_assert!(win.end <= n);
                prop_assert!(win.scored() >= 1);
                prop_assert!(!win.replace_first_with_bos);
                for h in &mut hits[win.first_target..win.end] {
                    *h += 1;
                }
            }
            prop_assert_eq!(hits[0], 0);
            prop_assert!(hits[1..].iter().all(|&h| h == 1), "hits {:?}", hits);
            prop_assert_eq!(w.last().unwrap().end, n);
        }

        #[test]
        fn sliding_windows_bounded_and_keep_history((context, stride, n) in sliding_params()) {
            let w = plan_windows(n, &Method::Sliding { context, stride }, None, None).unwrap();
            prop_assert_eq!((w[0].begin, w[0].first_target, w[0].end), (0, 1, context.min(n)));
            for win in &w {
                prop_assert!(win.n_input() <= context);
            }
            for win in &w[1..] {
                prop_assert!(win.begin == 0 || win.n_context() >= context - stride);
                prop_assert!(win.scored() <= stride);
            }
            // Targets advance in order: each window starts where the last ended.
            for pair in w.windows(2) {
                prop_assert_eq!(pair[1].first_target, pair[0].end);
            }
        }

        #[test]
        fn max_windows_respected((context, stride, n) in sliding_params(), limit in 1usize..10) {
            let all = plan_windows(n, &Method::Sliding { context, stride }, None, None).unwrap();
            let some = plan_windows(n, &Method::Sliding { context, stride }, None, Some(limit)).unwrap();
            prop_assert_eq!(some.len(), all.len().min(limit));
            prop_assert_eq!(&some[..], &all[..some.len()]);
            if n >= 2 * context && context >= 3 {
                let all = plan_windows(n, &Method::Chunks { context }, None, None).unwrap();
                let some = plan_windows(n, &Method::Chunks { context }, None, Some(limit)).unwrap();
                prop_assert_eq!(some.len(), all.len().min(limit));
                prop_assert_eq!(&some[..], &all[..some.len()]);
            }
        }

        #[test]
        fn chunks_match_llama_cpp(
            context in 0usize..80,
            n in 0usize..2000,
            bos in proptest::option::of(0u32..10),
            limit in proptest::option::of(1usize..40),
        ) {
            let got = plan_windows(n, &Method::Chunks { context }, bos, limit);
            // Contexts below 3 score nothing per chunk (context 0 divides by zero in llama.cpp): refused.
            let want = if context < 3 {
                None
            } else {
                llama_cpp_chunks(n, context, bos.is_some(), limit.map_or(-1, |l| l as i64))
            };
            match want {
                None => prop_assert!(got.is_err()),
                Some(want) => {
                    let got = got.unwrap();
                    prop_assert_eq!(got.len(), want.len());
                    for (win, (start, end, add_bos, pairs)) in got.iter().zip(&want) {
                        prop_assert_eq!((win.begin, win.end, win.replace_first_with_bos), (*start, *end, *add_bos));
                        let mine: Vec<(usize, usize)> = (win.first_target..win.end)
                            .map(|t| (t - 1 - win.begin, t))
                            .collect();
                        prop_assert_eq!(&mine, pairs);
                        prop_assert_eq!(win.first_logit_row(), context / 2);
                    }
                }
            }
        }

        #[test]
        fn ppl_stride_matches_llama_cpp(
            context in 1usize..700,
            stride in 0usize..400,
            n in 0usize..4000,
            limit in proptest::option::of(1usize..40),
        ) {
            let got = plan_windows(n, &Method::PplStride { context, stride }, None, limit);
            let window = ppl_stride_window(context, stride);
            // S >= W would read logits before the window in llama.cpp: refused here.
            let want = if stride >= window { None } else {
                llama_cpp_ppl_stride(n, window, stride, limit.map_or(-1, |l| l as i64))
            };
            match want {
                None => prop_assert!(got.is_err()),
                Some(want) => {
                    let got = got.unwrap();
                    prop_assert_eq!(got.len(), want.len());
                    for (i, (win, (start, end, pairs))) in got.iter().zip(&want).enumerate() {
                        prop_assert_eq!((win.index, win.begin, win.end), (i, *start, *end));
                        prop_assert!(!win.replace_first_with_bos);
                        prop_assert!(win.end <= n);
                        let mine: Vec<(usize, usize)> = (win.first_target..win.end)
                            .map(|t| (t - 1 - win.begin, t))
                            .collect();
                        prop_assert_eq!(&mine, pairs);
                    }
                    // Targets adjoin: each window's first target is the last one's end.
                    for pair in got.windows(2) {
                        prop_assert_eq!(pair[1].first_target, pair[0].end);
                    }
                }
            }
        }

        #[test]
        fn sliding_invalid_settings_error(context in 0usize..50, stride in 0usize..50, n in 0usize..100) {
            let r = plan_windows(n, &Method::Sliding { context, stride }, None, None);
            prop_assert_eq!(r.is_ok(), stride > 0 && context > stride && n >= 2);
        }
    }

    #[test]
    fn shards_split_round_robin_and_parse_strictly() {
        assert_eq!(Shard::parse("1/3").unwrap(), Shard { index: 1, count: 3 });
        let s = Shard { index: 1, count: 3 };
        assert_eq!((0..7).filter(|&g| s.takes(g)).collect::<Vec<_>>(), vec![1, 4]);
        // Every window in exactly one shard.
        for g in 0..20 {
            assert_eq!((0..3).filter(|&k| Shard { index: k, count: 3 }.takes(g)).count(), 1);
        }
        for (bad, want) in [("0/0", "at least 1"), ("3/2", "below N"), ("a/b", "expected K/N"), ("1", "expected K/N"), ("-1/2", "expected K/N")] {
            let e = Shard::parse(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("--shard {bad}")) && e.contains(want), "{bad}: {e}");
        }
    }
}
