//! Sampling through an OpenAI-compatible completions server — vLLM's `/v1/completions` — the
//! engine users scale generation with. The prompt goes as token ids (the policy's own chat
//! template, tokenised here) and each completion comes back as token ids (vLLM's
//! `return_token_ids`), so what onepass scores is exactly what was sampled, never a
//! re-tokenisation of the text. Requests run `concurrency` at a time; a transient failure
//! (no connection, HTTP 429 or 5xx) is retried with backoff, any other refusal is one error
//! naming the server, the model and what it said.

use crate::sampling::SampleOptions;
use crate::Error;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Where the server is and how to talk to it.
#[derive(Clone, Debug, PartialEq)]
pub struct Server {
    /// e.g. `http://localhost:8000` (`/v1/…` is appended).
    pub base_url: String,
    /// The name the server serves the policy under (`vllm serve <model> --served-model-name`).
    pub model: String,
    /// Requests in flight at once.
    pub concurrency: usize,
    /// Seconds one request may take.
    pub timeout_s: f64,
    /// Attempts after the first for a transient failure, 0.5 s · 2^k apart.
    pub retries: u32,
}

/// The completions of one request, or why there are none.
type Answer = Result<Vec<Completion>, Error>;

/// One prompt: its token ids and the seed of its n samples.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    pub ids: &'a [u32],
    pub seed: u64,
}

/// One completion as the server returned it.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    /// The sampled token ids (the stop token included when it stopped on one).
    pub ids: Vec<u32>,
    /// Stopped at a stop token (false: cut at `max_tokens`).
    pub stopped: bool,
    /// The server's log-probability of each sampled token (its own forward pass).
    pub logprobs: Vec<f32>,
}

/// The longest a connection may take to open (a request's whole time is `timeout_s`).
const CONNECT_TIMEOUT_S: f64 = 10.0;
/// The longest the start's `GET /v1/models` may take: a server that lists nothing in that long
/// is not answering (an accepted connection that never answers waited `timeout_s`, 600 s by
/// default, times each retry).
const MODELS_TIMEOUT_S: f64 = 10.0;
/// After this long without an answer (at most half of `timeout_s`), one line on stderr says
/// what the run waits for.
const NOTICE_AFTER_S: f64 = 15.0;

/// When the last "waiting for the server" line was printed: one line per [`NOTICE_AFTER_S`] for
/// the process, however many requests are in flight.
static LAST_NOTICE: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);

impl Server {
    /// A client whose request — connect, send, the whole answer read — takes at most
    /// `timeout_s` (ureq's overall deadline; connecting at most [`CONNECT_TIMEOUT_S`] of it).
    fn agent_for(&self, timeout_s: f64) -> ureq::Agent {
        let total = Duration::from_secs_f64(timeout_s.max(1.0));
        ureq::AgentBuilder::new()
            .timeout(total)
            .timeout_connect(total.min(Duration::from_secs_f64(CONNECT_TIMEOUT_S)))
            .build()
    }

    /// The line printed when a request of `what` has waited `waited_s` seconds.
    pub fn waiting_line(&self, what: &str, waited_s: f64, timeout_s: f64) -> String {
        format!(
            "onepass: waiting for the server at {} to answer {what} ({waited_s:.0} s so far; an attempt gives up after {timeout_s} s (generate.timeout_s), then up to {} retries (generate.retries))",
            self.base_url, self.retries
        )
    }

    fn url(&self, path: &str) -> String {
        format!("{}/v1/{path}", self.base_url.trim_end_matches('/').trim_end_matches("/v1"))
    }

    /// The model names the server lists (`GET /v1/models`): the base model and the adapters
    /// loaded on it.
    pub fn models(&self) -> Result<Vec<String>, Error> {
        let text = self.call_text_within(self.timeout_s.min(MODELS_TIMEOUT_S), "GET /v1/models", |a| {
            a.get(&self.url("models")).call().map_err(Box::new)
        })?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::Format(format!("{}: not JSON ({e}): {}", self.base_url, clip(&text))))?;
        let data = v.get("data").and_then(|d| d.as_array()).ok_or_else(|| self.odd("models", &v))?;
        Ok(data.iter().filter_map(|m| m.get("id").and_then(|i| i.as_str()).map(String::from)).collect())
    }

    /// Checks that the server answers and serves `self.model`: one error naming what it serves
    /// otherwise.
    pub fn check(&self) -> Result<(), Error> {
        let served = self.models()?;
        if !served.iter().any(|m| m == &self.model) {
            return Err(Error::Input(format!(
                "the server at {} serves {served:?}, not `{}`",
                self.base_url, self.model
            )));
        }
        Ok(())
    }

    /// `opts.n` completions of each request under `model` (the base's name or an adapter's),
    /// in request order; `stop` are the token ids that end a turn.
    pub fn complete(
        &self,
        model: &str,
        reqs: &[Request<'_>],
        opts: &SampleOptions,
        stop: &[u32],
        done: &(dyn Fn(usize) + Sync),
    ) -> Result<Vec<Vec<Completion>>, Error> {
        opts.check()?;
        let next = AtomicUsize::new(0);
        let workers = self.concurrency.clamp(1, reqs.len().max(1));
        let mut out: Vec<Option<Answer>> = (0..reqs.len()).map(|_| None).collect();
        let results: Vec<Vec<(usize, Answer)>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..workers)
                .map(|_| {
                    s.spawn(|| {
                        let mut got = Vec::new();
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            if i >= reqs.len() {
                                break;
                            }
                            let r = self.one(model, &reqs[i], opts, stop);
                            let failed = r.is_err();
                            got.push((i, r));
                            done(i);
                            if failed {
                                // the others stop taking new requests
                                next.store(reqs.len(), Ordering::Relaxed);
                                break;
                            }
                        }
                        got
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("a request thread panicked")).collect()
        });
        for (i, r) in results.into_iter().flatten() {
            out[i] = Some(r);
        }
        // the first failure in request order, else every request's completions
        out.into_iter()
            .enumerate()
            .map(|(i, r)| r.unwrap_or_else(|| Err(Error::Io(format!("request {i} was not sent after a failure")))))
            .collect()
    }

    /// The request body of one prompt (vLLM's completions API with its extensions).
    pub fn body(&self, model: &str, r: &Request<'_>, opts: &SampleOptions, stop: &[u32]) -> serde_json::Value {
        serde_json::json!({
            "model": model,
            "prompt": r.ids,
            "n": opts.n,
            "temperature": opts.temperature,
            "top_p": opts.top_p,
            "max_tokens": opts.max_new_tokens,
            // vLLM takes a signed 64-bit seed
            "seed": r.seed & (i64::MAX as u64),
            "stop_token_ids": stop,
            "return_token_ids": true,
            "logprobs": 0,
            "skip_special_tokens": false,
        })
    }

    fn one(&self, model: &str, r: &Request<'_>, opts: &SampleOptions, stop: &[u32]) -> Result<Vec<Completion>, Error> {
        let body = self.body(model, r, opts, stop).to_string();
        let v = self.call(|a| {
            a.post(&self.url("completions"))
                .set("Content-Type", "application/json")
                .send_string(&body)
                .map_err(Box::new)
        })?;
        let choices = v.get("choices").and_then(|c| c.as_array()).ok_or_else(|| self.odd("completions", &v))?;
        if choices.len() != opts.n {
            return Err(Error::Format(format!(
                "{}: {} completions of a prompt: expected n = {}",
                self.url("completions"),
                choices.len(),
                opts.n
            )));
        }
        let mut by_index: Vec<(usize, Completion)> = choices
            .iter()
            .map(|c| completion(c, stop).map_err(|m| Error::Format(format!("{}: {m}", self.url("completions")))))
            .collect::<Result<_, _>>()?;
        by_index.sort_by_key(|(i, _)| *i);
        Ok(by_index.into_iter().map(|(_, c)| c).collect())
    }

    /// One call with retries on transient failures; the body as JSON.
    fn call(
        &self,
        send: impl Fn(&ureq::Agent) -> Result<ureq::Response, Box<ureq::Error>>,
    ) -> Result<serde_json::Value, Error> {
        let text = self.call_text(send)?;
        serde_json::from_str(&text)
            .map_err(|e| Error::Format(format!("{}: not JSON ({e}): {}", self.base_url, clip(&text))))
    }

    /// One call with retries on transient failures (no connection, HTTP 429 or 5xx, 0.5 s · 2^k
    /// apart); the body as text. Another refusal is one error with what the server said.
    fn call_text(
        &self,
        send: impl Fn(&ureq::Agent) -> Result<ureq::Response, Box<ureq::Error>>,
    ) -> Result<String, Error> {
        self.call_text_within(self.timeout_s, "a request", send)
    }

    /// [`Server::call_text`] with each attempt bounded by `timeout_s`; past [`NOTICE_AFTER_S`]
    /// (or half of `timeout_s`) without an answer, one line on stderr says what it waits for.
    // the closures return ureq's own error, which the match below takes apart by variant
    #[allow(clippy::result_large_err)]
    fn call_text_within(
        &self,
        timeout_s: f64,
        what: &str,
        send: impl Fn(&ureq::Agent) -> Result<ureq::Response, Box<ureq::Error>>,
    ) -> Result<String, Error> {
        let agent = self.agent_for(timeout_s);
        let notice_after = Duration::from_secs_f64(NOTICE_AFTER_S.min(timeout_s / 2.0).max(0.5));
        let mut attempt = 0;
        loop {
            let sent = std::time::Instant::now();
            let (tx, rx) = std::sync::mpsc::channel::<()>();
            let answer = std::thread::scope(|sc| {
                let me = self;
                sc.spawn(move || {
                    // the sender dropped: answered (or failed) in time
                    if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(notice_after) {
                        let mut last = LAST_NOTICE.lock().unwrap_or_else(|e| e.into_inner());
                        if last.is_none_or(|t| t.elapsed() >= notice_after) {
                            *last = Some(std::time::Instant::now());
                            eprintln!("{}", me.waiting_line(what, sent.elapsed().as_secs_f64(), timeout_s));
                        }
                    }
                });
                let r = send(&agent)
                    .map_err(|e| *e)
                    .and_then(|resp| resp.into_string().map_err(|e| Box::new(ureq::Error::from(e))).map_err(|e| *e));
                drop(tx);
                r
            });
            let transient = match answer {
                Ok(text) => return Ok(text),
                Err(ureq::Error::Status(code, resp)) => {
                    let said = resp.into_string().unwrap_or_default();
                    if code != 429 && code < 500 {
                        return Err(Error::Input(format!(
                            "the server at {} refused the request (HTTP {code}): {}",
                            self.base_url,
                            clip(&said)
                        )));
                    }
                    format!("HTTP {code}: {}", clip(&said))
                }
                // a refused connection: no server at the address (named as such after the
                // retries, not blamed on the model's name)
                Err(ureq::Error::Transport(t)) if t.kind() == ureq::ErrorKind::ConnectionFailed => {
                    if attempt >= self.retries {
                        return Err(Error::Io(format!(
                            "nothing listens at {} (connection refused, {} attempt(s)): start the server there or fix generate.base_url",
                            self.base_url,
                            attempt + 1
                        )));
                    }
                    ureq::Error::Transport(t).to_string()
                }
                Err(e) => e.to_string(),
            };
            if attempt >= self.retries {
                return Err(Error::Io(format!(
                    "the server at {} failed {} time(s): {transient}",
                    self.base_url,
                    attempt + 1
                )));
            }
            std::thread::sleep(Duration::from_secs_f64(0.5 * 2f64.powi(attempt as i32)));
            attempt += 1;
        }
    }

    fn post(&self, path: &str, body: &serde_json::Value) -> Result<String, Error> {
        let body = body.to_string();
        self.call_text(|a| {
            a.post(&self.url(path)).set("Content-Type", "application/json").send_string(&body).map_err(Box::new)
        })
    }

    /// Loads the PEFT adapter directory `dir` (a path the server can read) as `name` (vLLM's
    /// runtime LoRA API: the server runs with `--enable-lora` and
    /// `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`); requests then name it as their model.
    pub fn load_adapter(&self, name: &str, dir: &std::path::Path) -> Result<(), Error> {
        let path = dir.canonicalize().map_err(|e| Error::Io(format!("{}: {e}", dir.display())))?;
        self.post("load_lora_adapter", &serde_json::json!({"lora_name": name, "lora_path": path}))
            .map_err(|e| Error::Input(format!("loading the adapter {name} from {}: {e}", path.display())))?;
        Ok(())
    }

    /// Unloads the adapter `name` (superseded by a newer one of its cell).
    pub fn unload_adapter(&self, name: &str) -> Result<(), Error> {
        self.post("unload_lora_adapter", &serde_json::json!({"lora_name": name}))
            .map_err(|e| Error::Input(format!("unloading the adapter {name}: {e}")))?;
        Ok(())
    }

    fn odd(&self, what: &str, v: &serde_json::Value) -> Error {
        Error::Format(format!("{}: an unexpected answer to /v1/{what}: {}", self.base_url, clip(&v.to_string())))
    }
}

/// (index, completion) of one choice; the stop token is kept at the end of the ids when the
/// choice stopped on one (vLLM returns it in `token_ids`, or names it in `stop_reason`).
fn completion(c: &serde_json::Value, stop: &[u32]) -> Result<(usize, Completion), String> {
    let index = c.get("index").and_then(|i| i.as_u64()).ok_or("a choice without its index")? as usize;
    let mut ids: Vec<u32> = c
        .get("token_ids")
        .and_then(|t| t.as_array())
        .ok_or("a choice without token_ids: the server does not return token ids (vLLM's return_token_ids)")?
        .iter()
        .map(|t| t.as_u64().map(|x| x as u32).ok_or("a token id that is not a number"))
        .collect::<Result<_, _>>()?;
    let stopped = match c.get("finish_reason").and_then(|f| f.as_str()) {
        Some("stop") => true,
        Some("length") => false,
        other => return Err(format!("finish_reason {other:?}: expected \"stop\" or \"length\"")),
    };
    if stopped && !ids.last().is_some_and(|t| stop.contains(t)) {
        let reason = c.get("stop_reason").and_then(|r| r.as_u64()).map(|r| r as u32);
        ids.push(reason.filter(|r| stop.contains(r)).unwrap_or(stop[0]));
    }
    let logprobs = c
        .get("logprobs")
        .and_then(|l| l.get("token_logprobs"))
        .and_then(|t| t.as_array())
        .map(|t| t.iter().map(|x| x.as_f64().unwrap_or(f64::NAN) as f32).collect())
        .unwrap_or_default();
    Ok((index, Completion { ids, stopped, logprobs }))
}

fn clip(s: &str) -> String {
    let s = s.trim();
    match s.char_indices().nth(300) {
        Some((at, _)) => format!("{}…", &s[..at]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A choice's token ids, stop and log-probs are read as vLLM writes them; a stop token the
    /// server left out of `token_ids` is put back from `stop_reason`; a server without token
    /// ids is refused naming what is missing.
    #[test]
    fn a_choice_reads_as_vllm_writes_it() {
        let stop = [2u32, 7];
        let c = serde_json::json!({"index": 1, "text": "hi", "token_ids": [5, 6, 7], "finish_reason": "stop",
            "logprobs": {"token_logprobs": [-0.5, -1.0, -0.25]}});
        let (i, got) = completion(&c, &stop).unwrap();
        assert_eq!((i, got.ids.clone(), got.stopped), (1, vec![5, 6, 7], true));
        assert_eq!(got.logprobs, vec![-0.5, -1.0, -0.25]);
        let c = serde_json::json!({"index": 0, "token_ids": [5, 6], "finish_reason": "stop", "stop_reason": 7});
        assert_eq!(completion(&c, &stop).unwrap().1.ids, vec![5, 6, 7]);
        let c = serde_json::json!({"index": 0, "token_ids": [5, 6], "finish_reason": "length"});
        let (_, got) = completion(&c, &stop).unwrap();
        assert_eq!((got.ids, got.stopped), (vec![5, 6], false));
        let e = completion(&serde_json::json!({"index": 0, "text": "x", "finish_reason": "stop"}), &stop).unwrap_err();
        assert!(e.contains("return_token_ids"), "{e}");
    }

    /// The request carries the prompt as ids, the sampling options, a seed vLLM accepts and the
    /// stop ids; the URL takes a base with or without `/v1`.
    #[test]
    fn the_request_names_ids_options_and_seed() {
        let s = Server {
            base_url: "http://h:8000/v1/".into(),
            model: "m".into(),
            concurrency: 2,
            timeout_s: 5.0,
            retries: 0,
        };
        assert_eq!(s.url("completions"), "http://h:8000/v1/completions");
        let o = SampleOptions { n: 3, temperature: 0.7, top_p: 0.9, max_new_tokens: 16, seed: 1 };
        let b = s.body("m-lora", &Request { ids: &[1, 2, 3], seed: u64::MAX }, &o, &[9]);
        assert_eq!(b["prompt"], serde_json::json!([1, 2, 3]));
        assert_eq!((b["n"].as_u64(), b["max_tokens"].as_u64()), (Some(3), Some(16)));
        assert_eq!(b["model"], "m-lora");
        assert_eq!(b["seed"].as_u64(), Some(i64::MAX as u64));
        assert_eq!(b["stop_token_ids"], serde_json::json!([9]));
    }

    /// A server that refuses an adapter (here as vLLM refuses a rank above its
    /// `--max-lora-rank`: HTTP 400) is asked once, not retried, and its words come back in one
    /// error naming the adapter; a 503 is retried (negative control: the stub counts requests).
    #[test]
    fn a_refused_adapter_is_one_error_with_the_servers_words() {
        use std::io::{Read, Write};
        let said = r#"{"object":"error","message":"LoRA rank 16 is greater than max_lora_rank 8.","code":400}"#;
        for (status, retried) in [("400 Bad Request", false), ("503 Service Unavailable", true)] {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let port = listener.local_addr().unwrap().port();
            let (status, body) = (status.to_string(), said.to_string());
            // answers every connection the same way until the client stops calling
            let stub = std::thread::spawn(move || {
                let mut n = 0;
                listener.set_nonblocking(false).unwrap();
                for conn in listener.incoming().take(if retried { 2 } else { 1 }) {
                    let mut c = conn.unwrap();
                    let mut buf = [0u8; 4096];
                    let _ = c.read(&mut buf);
                    n += 1;
                    let r = format!(
                        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    c.write_all(r.as_bytes()).unwrap();
                }
                n
            });
            let s = Server {
                base_url: format!("http://127.0.0.1:{port}"),
                model: "m".into(),
                concurrency: 1,
                timeout_s: 5.0,
                retries: if retried { 1 } else { 3 },
            };
            let dir = tempfile::tempdir().unwrap();
            let e = s.load_adapter("onepass-x-0123", dir.path()).unwrap_err().to_string();
            let calls = stub.join().unwrap();
            assert!(e.contains("onepass-x-0123") && e.contains("max_lora_rank 8"), "{e}");
            if retried {
                assert!(calls == 2 && e.contains("2 time(s)"), "{calls} calls: {e}");
            } else {
                assert!(calls == 1 && e.contains("HTTP 400"), "{calls} calls: {e}");
            }
        }
    }

    /// A server that accepts the connection and never answers: the start's model check gives
    /// up after its own bound, not after `timeout_s` (600 s by default) per attempt, and a
    /// completion request after `timeout_s`; each is one error naming the server.
    #[test]
    fn a_server_that_never_answers_is_given_up_on_in_bounded_time() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        // holds every accepted connection open, answering nothing, until the test ends
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for c in listener.incoming() {
                held.push(c);
            }
        });
        let s = Server {
            base_url: format!("http://{addr}"),
            model: "m".into(),
            concurrency: 1,
            timeout_s: 600.0,
            retries: 0,
        };
        let t = std::time::Instant::now();
        let e = s.check().unwrap_err().to_string();
        let took = t.elapsed().as_secs_f64();
        assert!(took < MODELS_TIMEOUT_S + 5.0, "the model check waited {took:.1} s: {e}");
        assert!(e.contains(&s.base_url) && e.contains("1 time(s)"), "{e}");
        let s = Server { timeout_s: 2.0, ..s };
        let t = std::time::Instant::now();
        let opts = SampleOptions { n: 1, temperature: 1.0, top_p: 1.0, max_new_tokens: 4, seed: 0 };
        let e = s.complete("m", &[Request { ids: &[1, 2], seed: 0 }], &opts, &[], &|_| {}).unwrap_err().to_string();
        let took = t.elapsed().as_secs_f64();
        assert!((1.5..10.0).contains(&took), "a completion waited {took:.1} s: {e}");
        assert!(e.contains(&s.base_url), "{e}");
        let line = s.waiting_line("a request", 15.0, 600.0);
        assert!(line.contains("generate.timeout_s") && line.contains(&s.base_url), "{line}");
    }

    /// A server that is not there fails after its retries with one error naming it.
    #[test]
    fn no_server_is_one_error_naming_it() {
        let s = Server {
            base_url: "http://127.0.0.1:9".into(),
            model: "m".into(),
            concurrency: 1,
            timeout_s: 2.0,
            retries: 1,
        };
        let e = s.models().unwrap_err().to_string();
        // a refused connection names the address, not the model, and counts its attempts
        assert!(e.contains("nothing listens at http://127.0.0.1:9") && e.contains("2 attempt(s)"), "{e}");
    }
}
