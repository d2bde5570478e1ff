//! The `[data]` table (`env.kind = "dataset"`): a preference dataset, how its rows are read,
//! selected and split, and the feature model (the φ key block of `phi.rs`).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

super::phi::phi_table! {
    /// The `[data]` table.
    #[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
    #[serde(deny_unknown_fields)]
    pub struct DataSpec {
        /// The dataset: a file, a `*` pattern in the file name (several files read in name order), or
        /// `hf:datasets/<owner>/<name>[@rev]:<file or pattern>`. `${VAR}` and `${VAR:-default}` are
        /// expanded from the environment.
        pub path: String,
        /// Held-out pairs from other files (e.g. UltraFeedback test_prefs); default: a seeded split.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub eval_path: Option<String>,
        /// How rows are read: from the file name ("auto"), a named dataset's layout, or
        /// `[data.keys]` ("generic").
        #[serde(default = "d_format")]
        pub format: Format,
        /// Key names of the `generic` format.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub keys: Option<Keys>,
        /// A malformed row (missing or null field, a conversation not ending with the assistant):
        /// an error naming file, row and field, or skipped and counted in meta.json.
        #[serde(default = "d_malformed")]
        pub malformed: Malformed,
        /// Pairs to use (default: every row of `path`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub rows: Option<usize>,
        /// Which `rows`: the first ones (the authors' code) or a seeded random sample (the paper).
        #[serde(default = "d_select")]
        pub select: Select,
        /// Seed of select = "random" (part of the preset, not of the run's seeds).
        #[serde(default)]
        pub select_seed: u64,
        /// Held-out share of the selected pairs when there is no `eval_path`.
        #[serde(default = "d_eval_fraction")]
        pub eval_fraction: f64,
        /// Seed of the train/held-out split (part of the preset, not of the run's seeds).
        #[serde(default)]
        pub split_seed: u64,
        /// Held-out pairs to use from `eval_path` (default: all).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub eval_rows: Option<usize>,
        /// Pairs whose two sides became the same tokens (z = 0): dropped (counted) or kept.
        #[serde(default = "d_degenerate")]
        pub degenerate: Degenerate,
        /// Pairs whose two sides have the same score (UltraFeedback): kept (default: the dataset as
        /// published) or dropped; counted either way.
        #[serde(default = "d_score_ties")]
        pub score_ties: ScoreTies,
    }
    cache = "crate::spec::phi::d_cache"
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Malformed {
    Error,
    Skip,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Select {
    First,
    Random,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Degenerate {
    Drop,
    Keep,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum ScoreTies {
    Keep,
    Drop,
}

fn d_score_ties() -> ScoreTies {
    ScoreTies::Keep
}
fn d_format() -> Format {
    Format::Auto
}
fn d_malformed() -> Malformed {
    Malformed::Error
}
fn d_select() -> Select {
    Select::First
}
fn d_eval_fraction() -> f64 {
    0.2
}
fn d_degenerate() -> Degenerate {
    Degenerate::Drop
}

/// `${VAR}` and `${VAR:-default}` from the environment; an unset variable without a default is
/// an error naming it.
pub fn expand_env(s: &str) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find("${") {
        out.push_str(&rest[..i]);
        let close = rest[i..].find('}').ok_or_else(|| format!("`{s}`: `${{` without a closing `}}`"))? + i;
        let inner = &rest[i + 2..close];
        let (name, default) = match inner.split_once(":-") {
            Some((n, d)) => (n, Some(d)),
            None => (inner, None),
        };
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(format!("`{s}`: `${{{inner}}}` is not a variable name"));
        }
        match (std::env::var(name).ok().filter(|v| !v.is_empty()), default) {
            (Some(v), _) => out.push_str(&v),
            (None, Some(d)) => out.push_str(d),
            (None, None) => return Err(format!("`{s}`: the environment variable {name} is not set")),
        }
        rest = &rest[close + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

impl DataSpec {
    /// Checks that need no file: (key, message).
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if !(self.eval_fraction > 0.0 && self.eval_fraction < 1.0) {
            return Err((
                "eval_fraction",
                format!("{}: expected a share strictly between 0 and 1", self.eval_fraction),
            ));
        }
        if self.rows == Some(0) || self.eval_rows == Some(0) {
            return Err(("rows", "expected at least 1 pair".into()));
        }
        self.phi().check()?;
        expand_env(&self.path).map_err(|m| ("path", m))?;
        if self.keys.is_some() && self.format != Format::Generic {
            return Err(("keys", "only the `generic` format reads key names: set data.format = \"generic\"".into()));
        }
        if let Some(e) = &self.eval_path {
            expand_env(e).map_err(|m| ("eval_path", m))?;
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Format {
    /// From the file name: .jsonl / .jsonl.gz → hh-rlhf, .parquet → ultrafeedback.
    Auto,
    /// Anthropic HH-RLHF jsonl(.gz): `chosen` / `rejected` transcripts.
    HhRlhf,
    /// UltraFeedback-binarized parquet: `chosen` / `rejected` message lists with scores.
    Ultrafeedback,
    /// The Mixture2 layout (the paper's appendix): `chosen` / `rejected` message lists.
    Mixture2,
    /// Key names from `[data.keys]` (jsonl(.gz) or parquet).
    Generic,
}

/// Column (or JSON key) names of the `generic` format.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Keys {
    /// The prompt: a string (one user message) or a message list. Absent: the sides are whole
    /// conversations (message lists). Present: it is put before each side.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// The preferred side (a string response, or a message list when `prompt` is absent).
    #[serde(default = "d_chosen")]
    pub chosen: String,
    /// The other side.
    #[serde(default = "d_rejected")]
    pub rejected: String,
    /// The preferred side's score, when the file has one (score_ties reads it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score_chosen: Option<String>,
    /// The other side's score.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score_rejected: Option<String>,
    /// The label form (a winner column over two responses, Chatbot Arena / PKU-SafeRLHF style):
    /// the two sides, the key of the label, and the label values that mean "a wins", "b wins"
    /// and "tie". Values are compared after JSON typing: `"1"` and `1` differ, so map both when
    /// a file mixes them. Used instead of `chosen`/`rejected` when `label` is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub side_a: Option<String>,
    /// The label form's second side (see side_a).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub side_b: Option<String>,
    /// The label form's key of the winner (see side_a).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// The label values that mean "side a wins".
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(with = "Vec<serde_json::Value>")]
    pub label_a: Vec<toml::Value>,
    /// The label values that mean "side b wins".
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(with = "Vec<serde_json::Value>")]
    pub label_b: Vec<toml::Value>,
    /// The label values that mean a tie (a soft label ½).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(with = "Vec<serde_json::Value>")]
    pub label_tie: Vec<toml::Value>,
    /// Instead of `label`: the key of a preference strength (HelpSteer2-Preference's −3…3), a
    /// soft label y that side a wins: `strength_map = "linear"` y = ½ + s/(2·scale), clamped to
    /// [0, 1], or `"bradley-terry"` y = σ(s/scale); `strength_a_wins` says which sign favours
    /// side a ("positive", the default, or "negative"). s = 0 is a tie.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strength: Option<String>,
    /// The strength form's scale (see strength).
    #[serde(default = "d_strength_scale")]
    pub strength_scale: f64,
    /// How a strength becomes a soft label (see strength).
    #[serde(default)]
    pub strength_map: StrengthMap,
    /// Which sign of the strength favours side a (see strength).
    #[serde(default)]
    pub strength_a_wins: StrengthSign,
    /// The ranked form (several rated completions per prompt, UltraFeedback raw / Nectar /
    /// HelpSteer style): the key of the list of responses (strings or objects) ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub responses: Option<String>,
    /// ... inside each object, the dotted path of its text (default "response") ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_text: Option<String>,
    /// ... the dotted path(s) of its score (several: averaged), e.g.
    /// "annotations.helpfulness.Rating" ...
    #[serde(default, skip_serializing_if = "Vec::is_empty", deserialize_with = "one_or_many")]
    pub score: Vec<String>,
    /// ... whether a lower score is better (a rank: Nectar's 1 is the best; the scores are then
    /// negated, so chosen − rejected stays positive) ...
    #[serde(default)]
    pub score_lower_is_better: bool,
    /// ... and how pairs are formed from the ranking.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pairs: Option<PairRule>,
    /// Seed of a ranked form's random pairs (part of the preset, not of the run's seeds).
    #[serde(default)]
    pub pairs_seed: u64,
}

fn d_strength_scale() -> f64 {
    3.0
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum StrengthMap {
    #[default]
    Linear,
    BradleyTerry,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum StrengthSign {
    #[default]
    Positive,
    Negative,
}

impl Keys {
    /// The soft label that side a wins for strength `s` (see [`Keys::strength`]).
    pub fn strength_y(&self, s: f64) -> f64 {
        let s = if self.strength_a_wins == StrengthSign::Negative { -s } else { s };
        match self.strength_map {
            StrengthMap::Linear => (0.5 + s / (2.0 * self.strength_scale)).clamp(0.0, 1.0),
            StrengthMap::BradleyTerry => 1.0 / (1.0 + (-s / self.strength_scale).exp()),
        }
    }
}

/// How the ranked form makes pairs of a prompt's scored responses (higher score = chosen).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum PairRule {
    /// The best against one other drawn uniformly (seeded by pairs_seed and the row): the
    /// UltraFeedback-binarized recipe.
    BestRandom,
    /// The best against the worst.
    BestWorst,
    /// Every two responses.
    All,
    /// Neighbours in the ranking.
    Adjacent,
}

fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize, JsonSchema)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) => vec![s],
        OneOrMany::Many(v) => v,
    })
}

/// How a dataset's rows say which response is preferred, from `[data.keys]` checked once
/// ([`Keys::label_form`]); the readers match it exhaustively.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LabelForm<'a> {
    /// Two sides, the first preferred (`chosen`, `rejected`).
    ChosenRejected { chosen: &'a str, rejected: &'a str },
    /// A winner column over two responses (`side_a`, `side_b`; `label`'s values mapped by
    /// `label_a`, `label_b`, `label_tie`).
    Winner { a: &'a str, b: &'a str, label: &'a str },
    /// A preference strength over two responses (`side_a`, `side_b`, `strength`): a soft label.
    Strength { a: &'a str, b: &'a str, strength: &'a str },
    /// A prompt's scored responses (`responses`, `score`), made into pairs by `pairs`.
    Ranked { responses: &'a str },
}

impl Keys {
    /// The label form, its settings checked. Errors: (key, message).
    pub fn label_form(&self) -> Result<LabelForm<'_>, (&'static str, String)> {
        // both or neither
        if self.responses.is_some() == self.score.is_empty() {
            return Err((
                "responses",
                "the ranked form needs both responses (the list's key) and score (the path of each response's score)"
                    .into(),
            ));
        }
        if self.responses.is_some() && self.label.is_some() {
            return Err(("responses", "the ranked form and the label form exclude each other".into()));
        }
        if self.responses.is_none() && (self.pairs.is_some() || self.response_text.is_some()) {
            return Err(("pairs", "belongs to the ranked form: set data.keys.responses and score too".into()));
        }
        if !(self.strength_scale.is_finite() && self.strength_scale > 0.0) {
            return Err(("strength_scale", format!("{}: expected a number > 0", self.strength_scale)));
        }
        if let Some(st) = &self.strength {
            if self.responses.is_some() {
                return Err(("strength", "the ranked form and a strength exclude each other".into()));
            }
            if self.label.is_some() {
                return Err(("strength", "a strength replaces the label: set one of label and strength".into()));
            }
            let (Some(a), Some(b)) = (&self.side_a, &self.side_b) else {
                return Err(("strength", "needs side_a and side_b (the keys of the two responses)".into()));
            };
            return Ok(LabelForm::Strength { a, b, strength: st });
        }
        let Some(label) = &self.label else {
            for (k, set) in [
                ("side_a", self.side_a.is_some()),
                ("side_b", self.side_b.is_some()),
                ("label_a", !self.label_a.is_empty()),
                ("label_b", !self.label_b.is_empty()),
                ("label_tie", !self.label_tie.is_empty()),
            ] {
                if set {
                    return Err((
                        k,
                        "belongs to the label form: set data.keys.label (the key of the winner column) or strength too"
                            .into(),
                    ));
                }
            }
            return Ok(match &self.responses {
                Some(r) => LabelForm::Ranked { responses: r },
                None => LabelForm::ChosenRejected { chosen: &self.chosen, rejected: &self.rejected },
            });
        };
        let (Some(a), Some(b)) = (&self.side_a, &self.side_b) else {
            return Err(("label", "the label form needs side_a and side_b (the keys of the two responses)".into()));
        };
        if self.label_a.is_empty() || self.label_b.is_empty() {
            return Err((
                "label",
                "the label form needs label_a and label_b (the values meaning \"a wins\" and \"b wins\")".into(),
            ));
        }
        let all: Vec<&toml::Value> = self.label_a.iter().chain(&self.label_b).chain(&self.label_tie).collect();
        for (i, v) in all.iter().enumerate() {
            if !matches!(
                v,
                toml::Value::String(_) | toml::Value::Integer(_) | toml::Value::Float(_) | toml::Value::Boolean(_)
            ) {
                return Err(("label_a", format!("{v}: label values are strings, numbers or booleans")));
            }
            if all[..i].iter().any(|w| same_label(w, v)) {
                return Err(("label_a", format!("{v} is mapped twice (label_a, label_b, label_tie must not overlap)")));
            }
        }
        Ok(LabelForm::Winner { a, b, label })
    }
}

/// Whether float `f` is exactly the integer `i` (no rounding either way: i as f64 may round, and
/// f as i64 truncates and saturates, so both must give the other back).
pub(crate) fn float_is_int(f: f64, i: i64) -> bool {
    f == i as f64 && f as i64 == i
}

/// Two mapped label values that one data value would match: equal, or the same number as an
/// integer and a float (1 and 1.0).
fn same_label(a: &toml::Value, b: &toml::Value) -> bool {
    match (a, b) {
        (toml::Value::Integer(i), toml::Value::Float(f)) | (toml::Value::Float(f), toml::Value::Integer(i)) => {
            float_is_int(*f, *i)
        }
        _ => a == b,
    }
}

fn d_chosen() -> String {
    "chosen".into()
}
fn d_rejected() -> String {
    "rejected".into()
}

impl Default for Keys {
    fn default() -> Self {
        Keys {
            prompt: None,
            chosen: d_chosen(),
            rejected: d_rejected(),
            score_chosen: None,
            score_rejected: None,
            side_a: None,
            side_b: None,
            label: None,
            label_a: Vec::new(),
            label_b: Vec::new(),
            label_tie: Vec::new(),
            strength: None,
            strength_scale: d_strength_scale(),
            strength_map: StrengthMap::Linear,
            strength_a_wins: StrengthSign::Positive,
            responses: None,
            response_text: None,
            score: Vec::new(),
            score_lower_is_better: false,
            pairs: None,
            pairs_seed: 0,
        }
    }
}
