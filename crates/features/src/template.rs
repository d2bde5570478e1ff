//! Chat templates (the Jinja source from `tokenizer_config.json` or the GGUF's
//! `tokenizer.chat_template`) rendered with minijinja the way transformers renders them:
//! `trim_blocks` and `lstrip_blocks` on, Python string methods (pycompat), `raise_exception`,
//! and the variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`.

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
