//! Chat templates (the Jinja source from `tokenizer_config.json` or the GGUF's
//! `tokenizer.chat_template`) rendered with minijinja the way transformers renders them:
//! `trim_blocks` and `lstrip_blocks` on, Python string methods (pycompat), `raise_exception`,
//! and the variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`; and
//! `strftime_now`, which Llama-3.1/3.2 templates call for the "Today Date" line of their system
//! header, at a fixed date (see [`FIXED_DATE`]).

use crate::Error;
use minijinja::{context, Environment, ErrorKind};
use serde::{Deserialize, Serialize};

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Message {
        Message { role: role.into(), content: content.into() }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where the template came from (named in errors).
    pub origin: String,
    pub source: String,
    bos: String,
    eos: String,
}

/// The date `strftime_now` renders: 26 July 2024 (a Friday), 00:00:00. transformers renders
/// the current date, so the same conversation would tokenize — and give another φ — on another
/// day; onepass keeps runs reproducible with the date these templates fall back to themselves
/// when `strftime_now` is missing (`date_string = "26 Jul 2024"`).
pub const FIXED_DATE: &str = "2024-07-26";

/// Python's `strftime` on [`FIXED_DATE`], for the directives chat templates use.
fn strftime_now(format: String) -> Result<String, minijinja::Error> {
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let d = chars.next().unwrap_or('%');
        out.push_str(match d {
            'd' => "26",
            'e' => "26",
            'm' => "07",
            'b' | 'h' => "Jul",
            'B' => "July",
            'Y' => "2024",
            'y' => "24",
            'a' => "Fri",
            'A' => "Friday",
            'j' => "208",
            'H' | 'M' | 'S' => "00",
            'F' => FIXED_DATE,
            '%' => "%",
            other => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: the directive %{other} is not supported (onepass renders a fixed date)"),
                ))
            }
        });
    }
    Ok(out)
}

fn raise_exception(msg: String) -> Result<String, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    pub fn new(source: &str, origin: &str, bos: Option<&str>, eos: Option<&str>) -> Result<ChatTemplate, Error> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| Error::Template(format!("{origin}: the chat template does not parse: {e:#}")))?;
        Ok(ChatTemplate {
            env,
            origin: origin.into(),
            source: source.into(),
            bos: bos.unwrap_or("").into(),
            eos: eos.unwrap_or("").into(),
        })
    }

    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String, Error> {
        let t = self.env.get_template("chat").map_err(|e| Error::Template(format!("{}: {e:#}", self.origin)))?;
        t.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.as_str(),
            eos_token => self.eos.as_str(),
        })
        .map_err(|e| Error::Template(format!("{}: rendering the chat template failed: {e:#}", self.origin)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Llama-3.1 header line renders at the fixed date; an unknown directive is an error
    /// naming it (not a silent date).
    #[test]
    fn strftime_now_renders_the_fixed_date() {
        let src = "{{ strftime_now('%d %b %Y') }}|{{ strftime_now('%Y-%m-%d %A %%') }}";
        let t = ChatTemplate::new(src, "test", None, None).unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "26 Jul 2024|2024-07-26 Friday %");
        let bad = ChatTemplate::new("{{ strftime_now('%Q') }}", "test", None, None).unwrap();
        let e = bad.render(&[], false).unwrap_err().to_string();
        assert!(e.contains("%Q"), "{e}");
    }
}
