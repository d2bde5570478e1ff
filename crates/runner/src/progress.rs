//! Progress of the long stages (generation, φ extraction, cells) where the user can see it: indicatif
//! bars on a terminal; otherwise — stderr redirected to a file, as under nohup, SLURM or CI — a plain
//! line at most every `ONEPASS_PROGRESS_EVERY` seconds (default 15) and one at the stage's end, with
//! done/total, the rate and an ETA; nothing with `--quiet`.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How progress is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// indicatif bars (stderr is a terminal)
    Bars,
    /// plain lines in a log
    Lines,
    /// nothing (`--quiet`)
    Quiet,
}

impl Mode {
    /// Bars when stderr is a terminal, lines when it is not, nothing when `quiet`.
    pub fn for_stderr(quiet: bool) -> Mode {
        if quiet {
            Mode::Quiet
        } else if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            Mode::Bars
        } else {
            Mode::Lines
        }
    }
}

/// The interval between two plain lines: `ONEPASS_PROGRESS_EVERY` seconds (a number ≥ 0; tests use
/// 0 to see every update), 15 when unset or not a number.
fn interval() -> Duration {
    let secs = std::env::var("ONEPASS_PROGRESS_EVERY").ok().and_then(|s| s.trim().parse::<f64>().ok());
    Duration::from_secs_f64(secs.filter(|s| s.is_finite() && *s >= 0.0).unwrap_or(15.0))
}

struct Lines {
    every: Duration,
    last: Instant,
    done: u64,
    total: u64,
    message: String,
    finished: bool,
}

/// One stage's progress (shared by the threads that advance it).
pub struct Meter {
    stage: String,
    unit: &'static str,
    t0: Instant,
    bar: indicatif::ProgressBar,
    lines: Option<Mutex<Lines>>,
}

impl Meter {
    /// A meter for `stage` (e.g. "φ extraction") counting `total` `unit`s (e.g. "sequences").
    pub fn new(mode: Mode, stage: &str, unit: &'static str, total: u64) -> Meter {
        let bar = if mode == Mode::Bars && total > 0 {
            let b = indicatif::ProgressBar::new(total);
            b.set_style(
                indicatif::ProgressStyle::with_template(&format!(
                    "{stage} {{bar:30}} {{pos}}/{{len}} {unit} {{msg}} [{{elapsed}} < {{eta}}]"
                ))
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            b
        } else {
            indicatif::ProgressBar::hidden()
        };
        let t0 = Instant::now();
        let lines = (mode == Mode::Lines).then(|| {
            Mutex::new(Lines { every: interval(), last: t0, done: 0, total, message: String::new(), finished: false })
        });
        Meter { stage: stage.to_string(), unit, t0, bar, lines }
    }

    /// Changes the total (known only after the plan of the stage is made).
    pub fn set_length(&self, total: u64) {
        self.bar.set_length(total);
        self.update(|l| l.total = total, false);
    }

    /// Sets the number done.
    pub fn set_position(&self, done: u64) {
        self.bar.set_position(done);
        self.update(|l| l.done = done, true);
    }

    /// Adds to the number done.
    pub fn inc(&self, n: u64) {
        self.bar.inc(n);
        self.update(|l| l.done += n, true);
    }

    /// A short note after the counts (e.g. "812 tok/s").
    pub fn set_message(&self, message: String) {
        if let Some(l) = &self.lines {
            let mut l = l.lock().unwrap_or_else(|p| p.into_inner());
            l.message.clone_from(&message);
        }
        self.bar.set_message(message);
    }

    /// Ends the stage: the bar is cleared, a log gets its last line (when anything was counted).
    pub fn finish(&self) {
        self.bar.finish_and_clear();
        if let Some(l) = &self.lines {
            let mut l = l.lock().unwrap_or_else(|p| p.into_inner());
            if !l.finished && l.total > 0 {
                l.finished = true;
                eprintln!("{}", self.line(&l, true));
            }
        }
    }

    fn update(&self, f: impl FnOnce(&mut Lines), may_print: bool) {
        let Some(l) = &self.lines else { return };
        let mut l = l.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut l);
        let now = Instant::now();
        if may_print && !l.finished && now.duration_since(l.last) >= l.every {
            l.last = now;
            eprintln!("{}", self.line(&l, false));
        }
    }

    /// `onepass: φ extraction: 120/400 sequences (30%), 4.1 sequences/s, 812 tok/s, ETA 68 s`
    fn line(&self, l: &Lines, end: bool) -> String {
        let secs = self.t0.elapsed().as_secs_f64();
        let rate = l.done as f64 / secs.max(1e-9);
        let pct = 100.0 * l.done as f64 / (l.total as f64).max(1.0);
        let note = if l.message.is_empty() { String::new() } else { format!(", {}", l.message) };
        let tail = if end && l.done >= l.total {
            format!(", done in {}", duration(secs))
        } else if end {
            format!(", stopped after {}", duration(secs))
        } else if l.done > 0 && l.done < l.total {
            format!(", ETA {}", duration((l.total - l.done) as f64 / rate))
        } else {
            String::new()
        };
        format!(
            "onepass: {}: {}/{} {} ({pct:.0}%), {} {}/s{note}{tail}",
            self.stage,
            l.done,
            l.total,
            self.unit,
            rate_text(rate),
            self.unit
        )
    }
}

impl Drop for Meter {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}

fn rate_text(r: f64) -> String {
    if r >= 10.0 {
        format!("{r:.0}")
    } else if r >= 0.1 {
        format!("{r:.2}")
    } else {
        format!("{r:.4}")
    }
}

/// "42 s", "3 min 07 s", "2 h 05 min".
fn duration(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    if s < 60 {
        format!("{s} s")
    } else if s < 3600 {
        format!("{} min {:02} s", s / 60, s % 60)
    } else {
        format!("{} h {:02} min", s / 3600, (s % 3600) / 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_a_person_writes_them() {
        assert_eq!(duration(0.4), "0 s");
        assert_eq!(duration(59.4), "59 s");
        assert_eq!(duration(187.0), "3 min 07 s");
        assert_eq!(duration(7500.0), "2 h 05 min");
    }

    #[test]
    fn a_line_names_the_stage_the_counts_the_rate_and_the_eta() {
        let m = Meter::new(Mode::Lines, "φ extraction", "sequences", 400);
        let l = Lines {
            every: Duration::ZERO,
            last: m.t0,
            done: 100,
            total: 400,
            message: "812 tok/s".into(),
            finished: false,
        };
        let s = m.line(&l, false);
        assert!(s.starts_with("onepass: φ extraction: 100/400 sequences (25%), "), "{s}");
        assert!(s.contains("sequences/s, 812 tok/s, ETA "), "{s}");
        let s = m.line(&l, true);
        assert!(s.contains(", stopped after ") && !s.contains("ETA"), "an unfinished stage: {s}");
        let s = m.line(&Lines { done: 400, ..l }, true);
        assert!(s.contains("400/400 sequences (100%)") && s.contains(", done in ") && !s.contains("ETA"), "{s}");
    }
}
