//! Sampling responses from a policy model with a KV cache (paper §6 "Deployment-time
//! adaptation": n responses per prompt at temperature T).
//!
//! Prompts are rendered with the policy's chat template and `add_generation_prompt`, grouped
//! into batches of up to `batch_prompts` prompts (left-padded, the pads masked), prefilled once
//! per prompt, and each prompt's cache rows repeated for its n samples. Every sample draws its
//! tokens from its own ChaCha20 stream keyed by (seed, prompt, sample index), so a sample does
//! not depend on which prompts share its batch or in which order prompts come. Rows stop at an
//! end-of-turn token or after `max_new_tokens`; finished rows leave the batch.

use crate::extract::Backbone;
use crate::sampling::SampleOptions;
use crate::template::Message;
use crate::Error;
use candle_core::Tensor;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// One sampled response.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub text: String,
    /// New tokens, the stop token included when there was one.
    pub tokens: usize,
    /// Stopped at an end-of-turn token (false: cut at max_new_tokens).
    pub stopped: bool,
    /// The sampled token ids, the stop token included (what a policy update scores; decoding
    /// and re-encoding the text need not give them back). Empty in caches written before.
    #[serde(default)]
    pub ids: Vec<u32>,
    /// log π(token | prompt, earlier tokens) of each sampled id under the generating weights at
    /// temperature 1 (the policy's own distribution, whatever temperature sampled it): what an
    /// evaluation reads as the policy's log-probabilities instead of scoring the samples again.
    /// Empty where the sampler did not record them (a server's samples, older caches).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logprobs: Vec<f32>,
}

impl Sample {
    /// The recorded log-probabilities, when there is one per token.
    pub fn recorded_logprobs(&self) -> Option<&[f32]> {
        (!self.ids.is_empty() && self.logprobs.len() == self.ids.len()).then_some(self.logprobs.as_slice())
    }
}

/// Progress of a generation: prompts finished, new tokens so far, seconds so far.
#[derive(Clone, Copy, Debug, Default)]
pub struct GenProgress {
    pub prompts_done: usize,
    pub tokens: usize,
    pub seconds: f64,
}

/// The next token from `logits`: argmax at temperature 0, else a draw from
/// softmax(logits / T) restricted to the top-p nucleus, using the uniform `u` ∈ [0, 1).
/// Ties in the argmax go to the lowest id.
pub fn sample_token(logits: &[f32], temperature: f64, top_p: f64, u: f64) -> u32 {
    sample_scored(logits, temperature, top_p, u).0
}

/// [`sample_token`], with (max logit, ln Σ exp(logit − max)) when the draw summed the full
/// distribution at temperature 1: the normaliser [`token_logprob`] would sum again, the same
/// terms in the same order.
fn sample_scored(logits: &[f32], temperature: f64, top_p: f64, u: f64) -> (u32, Option<(f64, f64)>) {
    let argmax = || {
        let mut best = 0;
        for (i, &l) in logits.iter().enumerate() {
            if l > logits[best] {
                best = i;
            }
        }
        best as u32
    };
    if temperature == 0.0 {
        return (argmax(), None);
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    if !max.is_finite() {
        return (argmax(), None);
    }
    let w: Vec<f64> = logits.iter().map(|&l| ((l as f64 - max) / temperature).exp()).collect();
    let total: f64 = w.iter().sum();
    let norm = (temperature == 1.0).then(|| (max, total.ln()));
    if top_p >= 1.0 {
        // the whole distribution in id order: the walk below without its copy of (id, weight)
        // pairs (the kept mass is the total, summed in the same order)
        let mut target = u * total;
        for (id, &x) in w.iter().enumerate() {
            if target < x {
                return (id as u32, norm);
            }
            target -= x;
        }
        return (w.len().saturating_sub(1) as u32, norm);
    }
    // the nucleus: the most probable ids until their mass reaches top_p
    let mut p: Vec<(u32, f64)> = w.into_iter().enumerate().map(|(i, x)| (i as u32, x)).collect();
    p.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut acc = 0.0;
    let mut keep = p.len();
    for (i, x) in p.iter().enumerate() {
        acc += x.1 / total;
        if acc >= top_p {
            keep = i + 1;
            break;
        }
    }
    p.truncate(keep);
    let kept: f64 = p.iter().map(|x| x.1).sum();
    let mut target = u * kept;
    for &(id, w) in &p {
        if target < w {
            return (id, norm);
        }
        target -= w;
    }
    (p.last().map_or(0, |x| x.0), norm)
}

/// log softmax(logits)[tok]: the token's log-probability at temperature 1, the normaliser
/// summed in f64 from the largest logit.
pub fn token_logprob(logits: &[f32], tok: u32) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    (logits[tok as usize] as f64 - max - sum.ln()) as f32
}

/// The stream of one sample: (seed, prompt text, sample index).
fn sample_rng(seed: u64, prompt_key: &[u8; 32], index: usize) -> ChaCha20Rng {
    let mut h = blake3::Hasher::new();
    h.update(b"onepass-sample");
    h.update(&seed.to_le_bytes());
    h.update(prompt_key);
    h.update(&(index as u64).to_le_bytes());
    ChaCha20Rng::from_seed(*h.finalize().as_bytes())
}

struct Row {
    prompt: usize,
    sample: usize,
    rng: ChaCha20Rng,
    out: Vec<u32>,
    /// log π of each token of `out` (temperature 1).
    lps: Vec<f32>,
}

impl Backbone {
    /// Token ids of a prompt rendered for generation (the assistant turn opened).
    pub fn prompt_ids(&self, prompt: &[Message]) -> Result<Vec<u32>, Error> {
        let text = self.template.render(prompt, true)?;
        let ids = self.tok.encode(&text)?;
        if ids.is_empty() {
            return Err(Error::Input("the prompt tokenizes to nothing".into()));
        }
        Ok(ids)
    }

    /// Token ids of a written response (e.g. a preference dataset's) as the policy would have
    /// sampled it: the text's tokens, cut to `max_new_tokens`, closed by the chat format's
    /// end-of-turn token (`<|im_end|>`, `<|eot_id|>`, else the tokenizer's EOS) when not cut.
    pub fn response_ids(&self, text: &str, max_new_tokens: usize) -> Result<Vec<u32>, Error> {
        let mut ids = self.tok.encode(text)?;
        let end = ["<|im_end|>", "<|eot_id|>"]
            .iter()
            .find_map(|s| self.tok.inner.token_to_id(s))
            .or_else(|| self.tok.eos.as_ref().map(|e| e.1));
        if ids.len() + usize::from(end.is_some()) > max_new_tokens {
            ids.truncate(max_new_tokens);
        } else if let Some(e) = end {
            ids.push(e);
        }
        if ids.is_empty() {
            return Err(Error::Input("the response tokenizes to nothing".into()));
        }
        Ok(ids)
    }

    /// Token ids that end a response: the tokenizer's EOS and the end-of-turn tokens of the
    /// chat formats onepass knows (ChatML `<|im_end|>`, Llama-3 `<|eot_id|>`), where present.
    pub fn stop_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.tok.eos.iter().map(|e| e.1).collect();
        for s in ["<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>"] {
            if let Some(i) = self.tok.inner.token_to_id(s) {
                if !ids.contains(&i) {
                    ids.push(i);
                }
            }
        }
        ids
    }

    /// n samples for each prompt from an OpenAI-compatible server (`model`: the base's served
    /// name or an adapter's), in prompt order: the prompts templated and tokenised here, the
    /// samples' ids as the server sampled them, their text decoded here as [`Backbone::generate`]
    /// decodes its own. Each prompt's seed derives from `opts.seed` and the prompt (the server's
    /// sampler, not onepass's: the same seed gives other samples than the candle backend).
    /// `progress` is called once, when every prompt is done.
    pub fn generate_remote(
        &self,
        server: &crate::openai::Server,
        model: &str,
        prompts: &[Vec<Message>],
        opts: &SampleOptions,
        progress: &mut dyn FnMut(GenProgress),
    ) -> Result<Vec<Vec<Sample>>, Error> {
        let stops = self.stop_ids();
        if stops.is_empty() {
            return Err(Error::Input(
                "the tokenizer names no EOS or end-of-turn token: generation could not stop".into(),
            ));
        }
        let ids: Vec<Vec<u32>> = prompts.iter().map(|p| self.prompt_ids(p)).collect::<Result<_, _>>()?;
        let seeds: Vec<u64> = prompts
            .iter()
            .map(|p| {
                let mut h = blake3::Hasher::new();
                h.update(b"onepass-remote-sample");
                h.update(&opts.seed.to_le_bytes());
                h.update(&crate::cache::text_key(p));
                u64::from_le_bytes(h.finalize().as_bytes()[..8].try_into().expect("8 bytes"))
            })
            .collect();
        let reqs: Vec<crate::openai::Request<'_>> =
            ids.iter().zip(&seeds).map(|(i, &seed)| crate::openai::Request { ids: i, seed }).collect();
        let t0 = std::time::Instant::now();
        let got = server.complete(model, &reqs, opts, &stops, &|_| {})?;
        let mut out = Vec::with_capacity(prompts.len());
        let mut prog = GenProgress::default();
        for cs in got {
            let mut samples = Vec::with_capacity(cs.len());
            for c in cs {
                let body = if c.stopped { &c.ids[..c.ids.len() - 1] } else { &c.ids[..] };
                let text = self.tok.decode(body)?;
                prog.tokens += c.ids.len();
                // the server's log-probabilities are its own (its kernels, its sampler's
                // processing): onepass scores these samples itself
                samples.push(Sample {
                    text,
                    tokens: c.ids.len(),
                    stopped: c.stopped,
                    ids: c.ids,
                    logprobs: Vec::new(),
                });
            }
            out.push(samples);
        }
        prog.prompts_done = prompts.len();
        prog.seconds = t0.elapsed().as_secs_f64();
        progress(prog);
        Ok(out)
    }

    /// n samples for each prompt, in prompt order. `batch_prompts` prompts share a batch
    /// (n · batch_prompts rows). `progress` is called after every decoding step.
    pub fn generate(
        &self,
        prompts: &[Vec<Message>],
        opts: &SampleOptions,
        batch_prompts: usize,
        progress: &mut dyn FnMut(GenProgress),
    ) -> Result<Vec<Vec<Sample>>, Error> {
        self.generate_on(&self.model, prompts, opts, batch_prompts, progress)
    }

    /// [`Backbone::generate`] with other weights of the same architecture (a policy whose
    /// adapters are merged in), this backbone's tokenizer and chat template.
    pub fn generate_on(
        &self,
        model: &crate::model::Model,
        prompts: &[Vec<Message>],
        opts: &SampleOptions,
        batch_prompts: usize,
        progress: &mut dyn FnMut(GenProgress),
    ) -> Result<Vec<Vec<Sample>>, Error> {
        opts.check()?;
        let stops = self.stop_ids();
        if stops.is_empty() {
            return Err(Error::Input(
                "the tokenizer names no EOS or end-of-turn token: generation could not stop".into(),
            ));
        }
        let ids: Vec<Vec<u32>> = prompts.iter().map(|p| self.prompt_ids(p)).collect::<Result<_, _>>()?;
        let keys: Vec<[u8; 32]> = prompts.iter().map(|p| crate::cache::text_key(p)).collect();
        let mut out: Vec<Vec<Sample>> = vec![Vec::new(); prompts.len()];
        let t0 = std::time::Instant::now();
        let mut prog = GenProgress::default();
        // longest prompts first within a batch keeps the padding small
        let mut order: Vec<usize> = (0..prompts.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(ids[i].len()));
        for group in order.chunks(batch_prompts.max(1)) {
            let (mut cache, logits) = prefill(model, group, &ids, stops[0], opts.max_new_tokens)?;
            let mut rows: Vec<Row> = Vec::new();
            let mut expand = Vec::new();
            for (g, &i) in group.iter().enumerate() {
                for s in 0..opts.n {
                    rows.push(Row {
                        prompt: i,
                        sample: s,
                        rng: sample_rng(opts.seed, &keys[i], s),
                        out: Vec::new(),
                        lps: Vec::new(),
                    });
                    expand.push(g);
                }
            }
            cache.select(&expand)?;
            let next: Vec<(u32, f32)> =
                rows.par_iter_mut().zip(&expand).map(|(r, &g)| draw(&logits[g], opts, r)).collect();
            let mut step = |tokens: usize| {
                prog.tokens += tokens;
                prog.seconds = t0.elapsed().as_secs_f64();
                progress(prog);
            };
            let mut done = decode(model, &mut cache, rows, next, &stops, opts, &mut step)?;
            done.sort_by_key(|(r, _)| (r.prompt, r.sample));
            for (r, stopped) in done {
                let body = if stopped { &r.out[..r.out.len() - 1] } else { &r.out[..] };
                let text = self.tok.decode(body)?;
                out[r.prompt].push(Sample { text, tokens: r.out.len(), stopped, ids: r.out, logprobs: r.lps });
            }
            prog.prompts_done += group.len();
            progress(prog);
        }
        Ok(out)
    }
}

/// One batch's prompts (`group`, indices into `ids`) left-padded to the longest with `pad_id`
/// and prefilled: the KV cache (room for `max_new` more positions) and each prompt's logits at
/// its last position.
fn prefill(
    model: &crate::model::Model,
    group: &[usize],
    ids: &[Vec<u32>],
    pad_id: u32,
    max_new: usize,
) -> Result<(crate::model::KvCache, Vec<Vec<f32>>), Error> {
    let longest = group.iter().map(|&i| ids[i].len()).max().unwrap_or(0);
    let pads: Vec<usize> = group.iter().map(|&i| longest - ids[i].len()).collect();
    let mut flat = Vec::with_capacity(group.len() * longest);
    for (&i, &p) in group.iter().zip(&pads) {
        flat.extend(std::iter::repeat_n(pad_id, p));
        flat.extend_from_slice(&ids[i]);
    }
    let mut cache = model.new_cache(pads, longest + max_new)?;
    let logits = model.forward_cached(&Tensor::from_vec(flat, (group.len(), longest), model.device())?, &mut cache)?;
    Ok((cache, logits.to_vec2()?))
}

/// Decodes `rows` (one per sample; `next` holds each row's first drawn token) one token per
/// step until each row draws a stop id or reaches `max_new_tokens`, retiring finished rows from
/// the cache; `step` is told how many tokens each step added. Returns every row with whether it
/// stopped at a stop id.
fn decode(
    model: &crate::model::Model,
    cache: &mut crate::model::KvCache,
    mut rows: Vec<Row>,
    mut next: Vec<(u32, f32)>,
    stops: &[u32],
    opts: &SampleOptions,
    step: &mut dyn FnMut(usize),
) -> Result<Vec<(Row, bool)>, Error> {
    let mut done: Vec<(Row, bool)> = Vec::new();
    loop {
        // record the new tokens; retire rows that stopped or reached the limit
        let added = next.len();
        let mut keep = Vec::new();
        let mut live = Vec::new();
        for (k, (mut r, (tok, lp))) in rows.drain(..).zip(next.iter().copied()).enumerate() {
            r.out.push(tok);
            r.lps.push(lp);
            if stops.contains(&tok) {
                done.push((r, true));
            } else if r.out.len() >= opts.max_new_tokens {
                done.push((r, false));
            } else {
                keep.push(k);
                live.push(r);
            }
        }
        rows = live;
        step(added);
        if rows.is_empty() {
            return Ok(done);
        }
        if keep.len() < cache.rows() {
            cache.select(&keep)?;
        }
        let feed: Vec<u32> = rows.iter().map(|r| *r.out.last().expect("one token at least")).collect();
        let logits = model.forward_cached(&Tensor::from_vec(feed, (rows.len(), 1), model.device())?, cache)?;
        let logits: Vec<Vec<f32>> = logits.to_vec2()?;
        // each row draws from its own stream: the draws (a pass over the vocabulary each, as
        // long as a small batch's forward on bf16 products) run on every thread, same bits
        next = rows.par_iter_mut().zip(&logits).map(|(r, l)| draw(l, opts, r)).collect();
    }
}

/// A row's next token from its logits and its stream, with the token's log π at temperature 1
/// (at T = 1 from the draw's own normaliser: no second pass over the vocabulary).
fn draw(logits: &[f32], opts: &SampleOptions, r: &mut Row) -> (u32, f32) {
    match sample_scored(logits, opts.temperature, opts.top_p, r.rng.random()) {
        (tok, Some((max, ln_total))) => (tok, (logits[tok as usize] as f64 - max - ln_total) as f32),
        (tok, None) => (tok, token_logprob(logits, tok)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole-distribution walk (top_p = 1) draws the token the general nucleus code draws
    /// with its cutoff at the full mass: every id in order, the kept mass the total. Checked
    /// against that code written out here at several temperatures and 2,000 uniforms, near-ties
    /// and u near 1 included; negative control: a walk from the most probable id draws other
    /// tokens for some u.
    #[test]
    fn the_whole_distribution_walk_draws_what_the_general_walk_draws() {
        let logits: Vec<f32> = (0..1499).map(|i| ((i * 7919 % 1013) as f32 / 97.0).cos() * 5.0).collect();
        let general = |t: f64, u: f64, sorted: bool| {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let mut p: Vec<(u32, f64)> =
                logits.iter().enumerate().map(|(i, &l)| (i as u32, ((l as f64 - max) / t).exp())).collect();
            if sorted {
                p.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            }
            let kept: f64 = p.iter().map(|x| x.1).sum();
            let mut target = u * kept;
            for &(id, w) in &p {
                if target < w {
                    return id;
                }
                target -= w;
            }
            p.last().unwrap().0
        };
        let mut moved = 0;
        for t in [1.0, 0.7, 1.3] {
            for k in 0..2000 {
                let u = if k < 1990 { (k as f64 + 0.5) / 1990.0 } else { 1.0 - 1e-12 * (k - 1989) as f64 };
                assert_eq!(sample_token(&logits, t, 1.0, u), general(t, u, false), "T {t} u {u}");
                moved += usize::from(general(t, u, true) != general(t, u, false));
            }
        }
        assert!(moved > 100, "the control should draw other tokens for some u: {moved}");
    }

    /// At T = 1 the draw's normaliser gives each token's log π with the bits of a separate
    /// [`token_logprob`] pass, nucleus or not; at other temperatures there is none to reuse.
    #[test]
    fn the_draws_normaliser_is_token_logprobs() {
        let logits: Vec<f32> = (0..997).map(|i| ((i * 7919 % 1013) as f32 / 97.0).sin() * 6.0).collect();
        for top_p in [1.0, 0.9] {
            for k in 0..50 {
                let u = (k as f64 + 0.5) / 50.0;
                let (tok, norm) = sample_scored(&logits, 1.0, top_p, u);
                let (max, ln_total) = norm.expect("T = 1 sums the distribution");
                let lp = (logits[tok as usize] as f64 - max - ln_total) as f32;
                assert_eq!(lp.to_bits(), token_logprob(&logits, tok).to_bits(), "token {tok}");
                assert_eq!(tok, sample_token(&logits, 1.0, top_p, u));
            }
        }
        assert!(sample_scored(&logits, 0.7, 1.0, 0.5).1.is_none());
        assert!(sample_scored(&logits, 0.0, 1.0, 0.5).1.is_none());
    }
}
