//! What the generation examples share: the first prompts of a jsonl file (key `prompt`), each a
//! single user turn.

use features::Message;

pub fn first_prompts(path: &str, limit: usize) -> Vec<Vec<Message>> {
    let text = std::fs::read_to_string(path).expect("reading the prompts");
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .take(limit)
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            vec![Message::new("user", v["prompt"].as_str().expect("a `prompt` string"))]
        })
        .collect()
}
