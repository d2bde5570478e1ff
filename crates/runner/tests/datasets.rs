//! Dataset readers on files written here in the real layouts: an UltraFeedback-binarized parquet
//! (zstd-compressed, as the hub's files are) and HH-RLHF jsonl.gz.

use arrow_array::{ArrayRef, RecordBatch, StringArray};
use runner::world::datasets::{expand_glob, read_dataset, read_pairs, Format, Keys, ReadOptions};
use std::sync::Arc;

mod util;
use util::{messages, write_uf_scored};

fn write_uf(path: &std::path::Path, chosen: &[Vec<(&str, Option<&str>)>], rejected: &[Vec<(&str, Option<&str>)>]) {
    let scores: Vec<(f64, f64)> = vec![(8.0, 3.0); chosen.len()];
    write_uf_scored(path, chosen, rejected, &scores);
}

#[test]
fn ultrafeedback_parquet_zstd() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("train_prefs-00000-of-00001.parquet");
    let c = vec![
        vec![("user", Some("What is 2+2?")), ("assistant", Some("4"))],
        vec![("user", Some("Hi")), ("assistant", Some("Hello!")), ("user", Some("Bye")), ("assistant", Some("Bye!"))],
    ];
    let r = vec![
        vec![("user", Some("What is 2+2?")), ("assistant", Some("5"))],
        vec![("user", Some("Hi")), ("assistant", Some("Hello!")), ("user", Some("Bye")), ("assistant", Some("No."))],
    ];
    write_uf(&p, &c, &r);
    let pairs = read_pairs(&p, Format::Auto, None).unwrap();
    assert_eq!(pairs.len(), 2);
    assert_eq!(pairs[0].chosen.last().unwrap().content, "4");
    assert_eq!(pairs[0].rejected.last().unwrap().content, "5");
    assert_eq!(pairs[1].chosen.len(), 4);
    assert_eq!(pairs[1].rejected[3].role, "assistant");
    assert_eq!(read_pairs(&p, Format::Ultrafeedback, Some(1)).unwrap().len(), 1);
    assert_eq!(pairs[0].scores, Some((8.0, 3.0)));
    assert!(!pairs[0].score_tie());

    // a null content and a conversation that does not end with the assistant: file, row, field
    let bad = tmp.path().join("bad.parquet");
    write_uf(
        &bad,
        &[c[0].clone(), vec![("user", Some("q")), ("assistant", None)]],
        &[r[0].clone(), vec![("user", Some("q")), ("assistant", Some("a"))]],
    );
    let e = format!("{:#}", read_pairs(&bad, Format::Auto, None).unwrap_err());
    assert!(
        e.contains("bad.parquet")
            && e.contains("row 2")
            && e.contains("`chosen`")
            && e.contains("message 1 has a null"),
        "{e}"
    );
    let bad2 = tmp.path().join("bad2.parquet");
    write_uf(&bad2, &[vec![("user", Some("q"))]], &[vec![("user", Some("q")), ("assistant", Some("a"))]]);
    let e = format!("{:#}", read_pairs(&bad2, Format::Auto, None).unwrap_err());
    assert!(e.contains("row 1,") && e.contains("does not end with an assistant message"), "{e}");
}

/// Score ties (UltraFeedback pairs whose sides scored the same) are counted, and dropped when the
/// spec says so.
#[test]
fn score_ties_are_counted_and_dropped_on_request() {
    let tmp = tempfile::tempdir().unwrap();
    let qs: Vec<String> = (0..10).map(|i| format!("Question {i}?")).collect();
    let good: Vec<String> = (0..10).map(|i| format!("Good answer {i}.")).collect();
    let chosen: Vec<Vec<(&str, Option<&str>)>> =
        (0..10).map(|i| vec![("user", Some(qs[i].as_str())), ("assistant", Some(good[i].as_str()))]).collect();
    let rejected: Vec<Vec<(&str, Option<&str>)>> =
        (0..10).map(|i| vec![("user", Some(qs[i].as_str())), ("assistant", Some("Bad answer."))]).collect();
    let scores: Vec<(f64, f64)> = (0..10).map(|i| if i % 4 == 1 { (5.0, 5.0) } else { (9.0, 2.0) }).collect();
    write_uf_scored(&tmp.path().join("uf.parquet"), &chosen, &rejected, &scores);
    let spec = |ties: &str| {
        format!(
            "setting = \"passive\"\n[env]\nkind = \"dataset\"\n[stream]\nsamples = 4\neval_every = 2\n[data]\npath = \"uf.parquet\"\nmodel = \"{}\"\nmax_len = 64\neval_fraction = 0.3\nscore_ties = \"{ties}\"\n[[estimator]]\nkind = \"sgd\"\n",
            util::smollm2()
        )
    };
    let mut seen = Vec::new();
    for ties in ["keep", "drop"] {
        std::fs::write(tmp.path().join("s.toml"), spec(ties)).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_onepass"))
            .current_dir(tmp.path())
            .args(["run", "s.toml", "--out", &format!("out-{ties}")])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let dir = tmp.path().join(String::from_utf8_lossy(&out.stdout).trim().lines().last().unwrap());
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
        let d = meta["data"]["dataset"].clone();
        assert_eq!(d["score_ties"].as_u64(), Some(3), "rows 1, 5, 9: {d}");
        seen.push(d["train_pairs"].as_u64().unwrap() + d["eval_pairs"].as_u64().unwrap());
    }
    assert_eq!(seen, vec![10, 7], "keep all 10 pairs, or drop the 3 ties");
}

fn borrow<'a>(v: &'a [Vec<(&'a str, Option<String>)>]) -> Vec<Vec<(&'a str, Option<&'a str>)>> {
    v.iter().map(|c| c.iter().map(|(r, x)| (*r, x.as_deref())).collect()).collect()
}

/// Mixture2 (message lists, no scores) over several parquet files named by a pattern, and the
/// generic format on jsonl with a prompt string and response strings; malformed rows are errors
/// naming file, row and field, or skipped and counted.
#[test]
fn mixture2_shards_generic_jsonl_and_malformed_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let conv = |q: &str, a: &str| vec![("user", Some(q.to_string())), ("assistant", Some(a.to_string()))];
    let mut written = Vec::new();
    for shard in 0..2 {
        let qs: Vec<Vec<(&str, Option<String>)>> =
            (0..3).map(|i| conv(&format!("q{shard}{i}"), &format!("good{shard}{i}"))).collect();
        let rs: Vec<Vec<(&str, Option<String>)>> =
            (0..3).map(|i| conv(&format!("q{shard}{i}"), &format!("bad{shard}{i}"))).collect();
        let n = 3;
        let batch = RecordBatch::try_from_iter([
            ("chosen", messages(&borrow(&qs))),
            ("rejected", messages(&borrow(&rs))),
            ("source", Arc::new(StringArray::from(vec!["hh"; n])) as ArrayRef),
        ])
        .unwrap();
        // written in reverse name order: the reader sorts by name
        let p = tmp.path().join(format!("train-0000{}-of-00002-h{}.parquet", shard, 9 - shard));
        util::write_parquet(&p, &batch);
        written.push(p);
    }
    let files = expand_glob(&tmp.path().join("train-*.parquet")).unwrap();
    assert_eq!(files, written);
    let o = ReadOptions { format: Some(Format::Mixture2), ..Default::default() };
    let r = read_dataset(&files, &o).unwrap();
    assert_eq!((r.pairs.len(), r.rows_read, r.skipped), (6, 6, 0));
    assert_eq!(r.pairs[4].row, 4);
    assert_eq!(r.pairs[4].chosen[1].content, "good11");
    assert_eq!(r.pairs[4].rejected[0].content, "q11");
    assert_eq!(r.pairs[0].scores, None);
    let r = read_dataset(&files, &ReadOptions { limit: Some(4), ..o.clone() }).unwrap();
    assert_eq!(r.pairs.len(), 4);
    let e = format!("{:#}", expand_glob(&tmp.path().join("dev-*.parquet")).unwrap_err());
    assert!(e.contains("no file matches"), "{e}");
    // generic keys on a parquet without the column: the file and the columns it has
    let bad_keys = Keys { prompt: Some("question".into()), ..Keys::default() };
    let e = format!(
        "{:#}",
        read_dataset(&files, &ReadOptions { format: Some(Format::Generic), keys: bad_keys, ..Default::default() })
            .unwrap_err()
    );
    assert!(e.contains("no column `question`") && e.contains("chosen, rejected, source"), "{e}");

    let j = tmp.path().join("g.jsonl");
    std::fs::write(
        &j,
        [
            r#"{"question": "2+2?", "pos": "4", "neg": "5"}"#,
            r#"{"question": "Hi", "pos": "Hello", "neg": null}"#,
            r#"not json"#,
            r#"{"question": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Bye"}], "pos": "Bye!", "neg": "No."}"#,
        ]
        .join("\n"),
    )
    .unwrap();
    let keys =
        Keys { prompt: Some("question".into()), chosen: "pos".into(), rejected: "neg".into(), ..Keys::default() };
    let g = ReadOptions { format: Some(Format::Generic), keys, ..Default::default() };
    let e = format!("{:#}", read_dataset(std::slice::from_ref(&j), &g).unwrap_err());
    assert!(e.contains("g.jsonl: line 2, field `neg` (data.keys.rejected): missing or null"), "{e}");
    let r = read_dataset(std::slice::from_ref(&j), &ReadOptions { skip_malformed: true, ..g }).unwrap();
    assert_eq!((r.pairs.len(), r.rows_read, r.skipped), (2, 4, 2));
    assert!(r.skipped_examples[1].contains("line 3: not JSON"), "{:?}", r.skipped_examples);
    assert_eq!(r.pairs[1].chosen.len(), 3);
    assert_eq!(r.pairs[1].chosen[0].role, "system");
    assert_eq!(r.pairs[1].row, 3);
}

/// A jsonl row over the row limit is malformed (named, or skipped and counted with
/// `skip_malformed`) and is read in bounded pieces; the rows around it are read as usual.
#[test]
fn an_overlong_jsonl_row_is_malformed_not_a_memory_blowup() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("long.jsonl");
    let row = |q: &str, a: &str| {
        serde_json::json!({"chosen": format!("\n\nHuman: {q}\n\nAssistant: {a}"), "rejected": format!("\n\nHuman: {q}\n\nAssistant: no")})
            .to_string()
    };
    let huge = row("q", &"x".repeat(runner::world::datasets::MAX_ROW_BYTES + 10));
    std::fs::write(&p, [row("a", "yes"), huge, row("b", "yes")].join("\n") + "\n").unwrap();
    let o = ReadOptions { format: Some(Format::HhRlhf), ..Default::default() };
    let e = format!("{:#}", read_dataset(std::slice::from_ref(&p), &o).unwrap_err());
    assert!(e.contains("long.jsonl: line 2") && e.contains("over the 4 MiB a row may hold"), "{e}");
    let r = read_dataset(&[p], &ReadOptions { skip_malformed: true, ..o }).unwrap();
    assert_eq!((r.pairs.len(), r.rows_read, r.skipped), (2, 3, 1));
    assert_eq!(r.pairs[1].chosen.last().unwrap().content, "yes");
}

/// The label form (issue 21): a winner column over two responses, with string and integer labels
/// mapped explicitly ("1" and 1 are different values), ties kept as y = ½ (or dropped with
/// score_ties = "drop"); an unmapped value is an error naming the file, the row and the value.
#[test]
fn winner_column_labels_map_to_chosen_and_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    let j = tmp.path().join("arena.jsonl");
    std::fs::write(
        &j,
        [
            r#"{"q": "2+2?", "response_a": "4", "response_b": "5", "winner": "model_a"}"#,
            r#"{"q": "Hi", "response_a": "Go away.", "response_b": "Hello!", "winner": "model_b"}"#,
            r#"{"q": "Sky?", "response_a": "Blue.", "response_b": "Azure.", "winner": "tie"}"#,
            r#"{"q": "Bye", "response_a": "Bye!", "response_b": "No.", "winner": 0}"#,
            r#"{"q": "Yo", "response_a": "Hm.", "response_b": "Yo!", "winner": "1"}"#,
            r#"{"q": "Eh", "response_a": "a", "response_b": "b", "winner": "tie (bothbad)"}"#,
        ]
        .join("\n"),
    )
    .unwrap();
    let v = |s: &str| toml::Value::String(s.into());
    let keys = Keys {
        prompt: Some("q".into()),
        side_a: Some("response_a".into()),
        side_b: Some("response_b".into()),
        label: Some("winner".into()),
        label_a: vec![v("model_a"), toml::Value::Integer(0)],
        label_b: vec![v("model_b"), v("1")],
        label_tie: vec![v("tie")],
        ..Keys::default()
    };
    let o = ReadOptions { format: Some(Format::Generic), keys, ..Default::default() };
    // "tie (bothbad)" is not mapped: an error naming the file, the row and the value
    let e = format!("{:#}", read_dataset(std::slice::from_ref(&j), &o).unwrap_err());
    assert!(
        e.contains(
            "arena.jsonl: line 6, field `winner` (data.keys.label): \"tie (bothbad)\" is not a mapped label value"
        ),
        "{e}"
    );
    let r = read_dataset(std::slice::from_ref(&j), &ReadOptions { skip_malformed: true, ..o.clone() }).unwrap();
    assert_eq!((r.pairs.len(), r.skipped), (5, 1));
    let last = |p: &runner::world::datasets::Pair, side: &str| -> String {
        let m = if side == "c" { &p.chosen } else { &p.rejected };
        m.last().unwrap().content.clone()
    };
    // a wins: (a, b); b wins: (b, a); the integer 0 and the string "1" as mapped
    assert_eq!((last(&r.pairs[0], "c"), last(&r.pairs[0], "r")), ("4".into(), "5".into()));
    assert_eq!((last(&r.pairs[1], "c"), last(&r.pairs[1], "r")), ("Hello!".into(), "Go away.".into()));
    assert_eq!((last(&r.pairs[3], "c"), r.pairs[3].y()), ("Bye!".into(), 1.0));
    assert_eq!(last(&r.pairs[4], "c"), "Yo!");
    // a tie: kept with y = ½ and counted among the score ties
    assert!(r.pairs[2].tie && r.pairs[2].score_tie() && r.pairs[2].y() == 0.5);
    assert!(!r.pairs[0].score_tie());
    // negative control: the integer 1 is not the mapped string "1"
    std::fs::write(&j, r#"{"q": "x", "response_a": "a", "response_b": "b", "winner": 1}"#).unwrap();
    let e = format!("{:#}", read_dataset(std::slice::from_ref(&j), &o).unwrap_err());
    assert!(e.contains("field `winner` (data.keys.label): 1 is not a mapped label value"), "{e}");
    // integers compare as integers (issue 34): 2^53 + 1 is not the mapped 2^53, which f64
    // would round it to; 2^53 itself and the float 3.0 against the integer 3 match
    let big = Keys {
        label_a: vec![toml::Value::Integer(3)],
        label_b: vec![toml::Value::Integer(9007199254740992)],
        label_tie: vec![],
        ..o.keys.clone()
    };
    let ob = ReadOptions { keys: big, ..o.clone() };
    std::fs::write(&j, r#"{"q": "x", "response_a": "a", "response_b": "b", "winner": 9007199254740993}"#).unwrap();
    let e = format!("{:#}", read_dataset(std::slice::from_ref(&j), &ob).unwrap_err());
    assert!(e.contains("9007199254740993 is not a mapped label value"), "{e}");
    std::fs::write(
        &j,
        "{\"q\": \"x\", \"response_a\": \"a\", \"response_b\": \"b\", \"winner\": 9007199254740992}\n\
         {\"q\": \"y\", \"response_a\": \"c\", \"response_b\": \"d\", \"winner\": 3.0}",
    )
    .unwrap();
    let r = read_dataset(std::slice::from_ref(&j), &ob).unwrap();
    assert_eq!((last(&r.pairs[0], "c"), last(&r.pairs[1], "c")), ("b".into(), "c".into()));
    // 1 and 1.0 would match the same values: an overlap, refused as a repeated string is
    let overlap =
        Keys { label_a: vec![toml::Value::Integer(1)], label_b: vec![toml::Value::Float(1.0)], ..o.keys.clone() };
    assert!(overlap.label_form().unwrap_err().1.contains("mapped twice"), "1 and 1.0 overlap");
    // half a label form is refused
    let half = Keys { side_a: Some("response_a".into()), ..Keys::default() };
    assert!(half.label_form().unwrap_err().1.contains("set data.keys.label"));
}

/// A winner-column file through a passive run on the tiny GGUF: ties are counted (and kept as
/// y = ½ — a soft label the estimators take), then dropped on request.
#[test]
fn a_winner_column_dataset_runs_passive() {
    let tmp = tempfile::tempdir().unwrap();
    let winners = ["model_a", "model_b", "tie"];
    let lines: Vec<String> = (0..30)
        .map(|i| {
            serde_json::json!({
                "question": format!("Question {i}: what is {i} times two?"),
                "response_a": format!("It is {}.", 2 * i),
                "response_b": format!("Maybe {}.", 3 * i + 1),
                "winner": winners[i % 3],
            })
            .to_string()
        })
        .collect();
    std::fs::write(tmp.path().join("arena.jsonl"), lines.join("\n")).unwrap();
    let spec = format!(
        "setting = \"passive\"\n[env]\nkind = \"dataset\"\n[stream]\nsamples = 12\neval_every = 6\n[data]\npath = \"arena.jsonl\"\nformat = \"generic\"\nmodel = \"{}\"\nmax_len = 48\neval_fraction = 0.3\n[data.keys]\nprompt = \"question\"\nside_a = \"response_a\"\nside_b = \"response_b\"\nlabel = \"winner\"\nlabel_a = [\"model_a\"]\nlabel_b = [\"model_b\"]\nlabel_tie = [\"tie\"]\n[[estimator]]\nkind = \"sgd\"\n",
        util::tiny_gguf().display()
    );
    std::fs::write(tmp.path().join("spec.toml"), spec).unwrap();
    for (ties, kept) in [("keep", 30), ("drop", 20)] {
        let r = util::onepass(
            tmp.path(),
            &["run", "spec.toml", "--out", ties, "--set", &format!("data.score_ties={ties}")],
        );
        let dir = tmp.path().join(r.dir());
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
        let d = &meta["data"];
        assert_eq!(d["dataset"]["score_ties"].as_u64(), Some(10), "{d}");
        let rows = d["train_rows"].as_u64().unwrap() + d["eval_rows"].as_u64().unwrap();
        assert_eq!(rows, kept, "{ties}: {d}");
        assert!(dir.join("metrics.parquet").exists());
    }
}

/// The ranked form (issue 21): responses with nested scores (a dotted path, two paths averaged),
/// every pair rule against a hand enumeration, equal scores as ties, a missing score path named
/// by file, row and path; and the same from parquet (a list of structs).
#[test]
fn ranked_completions_make_pairs_by_rule() {
    use runner::world::datasets::PairRule;
    let tmp = tempfile::tempdir().unwrap();
    let j = tmp.path().join("ranked.jsonl");
    let resp = |t: &str, h: f64, c: f64| serde_json::json!({"response": t, "annotations": {"helpfulness": {"Rating": h}, "honesty": {"Rating": c}}});
    let rows = [
        // averaged scores: A 4, B 2, C 5, D 3  → ranking C, A, D, B
        serde_json::json!({"prompt": "p0", "completions": [resp("A", 4.0, 4.0), resp("B", 1.0, 3.0), resp("C", 5.0, 5.0), resp("D", 3.0, 3.0)]}),
        // two responses with equal scores: one tied pair
        serde_json::json!({"prompt": "p1", "completions": [resp("E", 2.0, 2.0), resp("F", 2.0, 2.0)]}),
        // one response: no pair
        serde_json::json!({"prompt": "p2", "completions": [resp("G", 1.0, 1.0)]}),
    ];
    std::fs::write(&j, rows.iter().map(|r| r.to_string()).collect::<Vec<_>>().join("\n")).unwrap();
    let keys = |rule: PairRule| Keys {
        prompt: Some("prompt".into()),
        responses: Some("completions".into()),
        score: vec!["annotations.helpfulness.Rating".into(), "annotations.honesty.Rating".into()],
        pairs: Some(rule),
        ..Keys::default()
    };
    let read = |rule: PairRule| -> Vec<(String, String, bool)> {
        let o = ReadOptions { format: Some(Format::Generic), keys: keys(rule), ..Default::default() };
        read_dataset(std::slice::from_ref(&j), &o)
            .unwrap()
            .pairs
            .iter()
            .map(|p| (p.chosen.last().unwrap().content.clone(), p.rejected.last().unwrap().content.clone(), p.tie))
            .collect()
    };
    let t = |a: &str, b: &str| (a.to_string(), b.to_string(), false);
    let tie = ("E".to_string(), "F".to_string(), true);
    assert_eq!(read(PairRule::BestWorst), vec![t("C", "B"), tie.clone()]);
    assert_eq!(read(PairRule::Adjacent), vec![t("C", "A"), t("A", "D"), t("D", "B"), tie.clone()]);
    assert_eq!(
        read(PairRule::All),
        vec![t("C", "A"), t("C", "D"), t("C", "B"), t("A", "D"), t("A", "B"), t("D", "B"), tie.clone()]
    );
    let br = read(PairRule::BestRandom);
    assert_eq!(br.len(), 2);
    assert_eq!(br[0].0, "C", "best-random: the best is chosen");
    assert!(["A", "D", "B"].contains(&br[0].1.as_str()));
    assert_eq!(read(PairRule::BestRandom), br, "seeded: the same draw again");
    // ranks (lower is better) reverse the order: B (2) is now the best, C (5) the worst
    let o = ReadOptions {
        format: Some(Format::Generic),
        keys: Keys { score_lower_is_better: true, ..keys(PairRule::BestWorst) },
        ..Default::default()
    };
    let p = &read_dataset(std::slice::from_ref(&j), &o).unwrap().pairs[0];
    assert_eq!((p.chosen.last().unwrap().content.as_str(), p.rejected.last().unwrap().content.as_str()), ("B", "C"));
    assert_eq!(p.scores, Some((-2.0, -5.0)));
    // the prompt is the first message of each side
    let o = ReadOptions { format: Some(Format::Generic), keys: keys(PairRule::BestWorst), ..Default::default() };
    let p = &read_dataset(std::slice::from_ref(&j), &o).unwrap().pairs[0];
    assert_eq!((p.chosen[0].content.as_str(), p.scores), ("p0", Some((5.0, 2.0))));
    // a missing score path: file, row and path
    let bad = Keys { score: vec!["annotations.truthfulness.Rating".into()], ..keys(PairRule::All) };
    let o = ReadOptions { format: Some(Format::Generic), keys: bad, ..Default::default() };
    let e = format!("{:#}", read_dataset(std::slice::from_ref(&j), &o).unwrap_err());
    assert!(
        e.contains(
            "ranked.jsonl: line 1, field `completions[0].annotations.truthfulness.Rating` (data.keys.responses): missing or not a number"
        ),
        "{e}"
    );

    // parquet: a list of structs with a nested score (completions[i].annotations.helpfulness.Rating
    // as a string, as in UltraFeedback's raw files), read through the same rules
    use arrow_array::builder::{ListBuilder, StringBuilder, StructBuilder};
    use arrow_schema::{DataType, Field, Fields};
    let rating = Fields::from(vec![Field::new("Rating", DataType::Utf8, true)]);
    let helpfulness = Fields::from(vec![Field::new("helpfulness", DataType::Struct(rating.clone()), true)]);
    let item = Fields::from(vec![
        Field::new("response", DataType::Utf8, true),
        Field::new("annotations", DataType::Struct(helpfulness.clone()), true),
    ]);
    let annotations = || {
        let inner = StructBuilder::new(rating.clone(), vec![Box::new(StringBuilder::new())]);
        StructBuilder::new(helpfulness.clone(), vec![Box::new(inner)])
    };
    let mut lb = ListBuilder::new(StructBuilder::new(
        item.clone(),
        vec![Box::new(StringBuilder::new()), Box::new(annotations())],
    ))
    .with_field(std::sync::Arc::new(Field::new("item", DataType::Struct(item), true)));
    for (text, r) in [("X", "7"), ("Y", "2"), ("Z", "9")] {
        let st = lb.values();
        st.field_builder::<StringBuilder>(0).unwrap().append_value(text);
        let ann = st.field_builder::<StructBuilder>(1).unwrap();
        let help = ann.field_builder::<StructBuilder>(0).unwrap();
        help.field_builder::<StringBuilder>(0).unwrap().append_value(r);
        help.append(true);
        ann.append(true);
        st.append(true);
    }
    lb.append(true);
    let pq = tmp.path().join("ranked.parquet");
    let batch = RecordBatch::try_from_iter([
        ("prompt", std::sync::Arc::new(StringArray::from(vec!["q"])) as ArrayRef),
        ("completions", std::sync::Arc::new(lb.finish()) as ArrayRef),
    ])
    .unwrap();
    util::write_parquet(&pq, &batch);
    let k = Keys {
        prompt: Some("prompt".into()),
        responses: Some("completions".into()),
        score: vec!["annotations.helpfulness.Rating".into()],
        pairs: Some(PairRule::Adjacent),
        ..Keys::default()
    };
    let o = ReadOptions { format: Some(Format::Generic), keys: k, ..Default::default() };
    let got: Vec<(String, String)> = read_dataset(&[pq], &o)
        .unwrap()
        .pairs
        .iter()
        .map(|p| (p.chosen.last().unwrap().content.clone(), p.rejected.last().unwrap().content.clone()))
        .collect();
    assert_eq!(got, vec![("Z".to_string(), "X".to_string()), ("X".to_string(), "Y".to_string())]);
}

/// A ranked-completions file through a passive and an active run on the tiny GGUF: meta.json
/// reports the pairs per prompt and the score gaps; a prompt's pairs stay on one side of the
/// held-out split.
#[test]
fn a_ranked_dataset_runs_passive_and_active() {
    let tmp = tempfile::tempdir().unwrap();
    let lines: Vec<String> = (0..12)
        .map(|i| {
            let c: Vec<serde_json::Value> = (0..4)
                .map(|r| serde_json::json!({"response": format!("Answer {r} to {i}: {}", "ok ".repeat(r + 1)), "rating": (r * 2 + i % 3) as f64}))
                .collect();
            serde_json::json!({"prompt": format!("Question number {i}?"), "completions": c}).to_string()
        })
        .collect();
    std::fs::write(tmp.path().join("ranked.jsonl"), lines.join("\n")).unwrap();
    let spec = |setting: &str, extra: &str| {
        format!(
            "setting = \"{setting}\"\n[env]\nkind = \"dataset\"\n[stream]\nsamples = 12\neval_every = 6\n{extra}[data]\npath = \"ranked.jsonl\"\nformat = \"generic\"\nmodel = \"{}\"\nmax_len = 48\neval_fraction = 0.2\n[data.keys]\nprompt = \"prompt\"\nresponses = \"completions\"\nscore = \"rating\"\npairs = \"adjacent\"\n[[estimator]]\nkind = \"sgd\"\n",
            util::tiny_gguf().display()
        )
    };
    std::fs::write(tmp.path().join("passive.toml"), spec("passive", "")).unwrap();
    std::fs::write(
        tmp.path().join("active.toml"),
        spec("active", "batch_size = 2\n[active]\nrule = [\"random\", \"stream\"]\ncandidates = 4\nkeep = 2\n"),
    )
    .unwrap();
    for s in ["passive.toml", "active.toml"] {
        let r = util::onepass(tmp.path(), &["run", s, "--out", "out"]);
        let dir = tmp.path().join(r.dir());
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
        let ranked = &meta["data"]["dataset"]["ranked"];
        assert_eq!((ranked["prompts"].as_u64(), ranked["pairs"].as_u64()), (Some(12), Some(36)), "{ranked}");
        assert_eq!(ranked["pairs_per_prompt"]["mean"].as_f64(), Some(3.0));
        // rows are rows, pairs are pairs (issue 34: rows_read counted pairs)
        let d = &meta["data"]["dataset"];
        assert_eq!((d["rows_read"].as_u64(), d["pairs_read"].as_u64()), (Some(12), Some(36)), "{d}");
        assert_eq!(ranked["score_gap"]["min"].as_f64(), Some(2.0), "adjacent ranks differ by 2");
        // 20% of 36 pairs is 7: whole prompts are held out until 7 are reached → 3 prompts, 9
        // pairs (a split by pairs would hold out 7 and put some prompts on both sides)
        assert_eq!(meta["data"]["eval_rows"].as_u64(), Some(9), "{}", meta["data"]);
        assert!(dir.join("metrics.parquet").exists());
    }
}

/// Preference strengths as soft labels (HelpSteer2-Preference style, −3…3, negative: response 1
/// better): y by hand for the linear and the Bradley–Terry maps; chosen is the favoured side; 0 is
/// a tie. Then the soft y in an estimator's update, against a hand computation.
#[test]
fn preference_strengths_are_soft_labels() {
    use runner::spec::data::{StrengthMap, StrengthSign};
    let tmp = tempfile::tempdir().unwrap();
    let j = tmp.path().join("strength.jsonl");
    let rows: Vec<String> = [-3.0, -1.0, 0.0, 2.0, 3.0]
        .iter()
        .map(|s| {
            serde_json::json!({"prompt": "p", "response_1": "one", "response_2": "two", "preference_strength": s})
                .to_string()
        })
        .collect();
    std::fs::write(&j, rows.join("\n")).unwrap();
    let keys = |map: StrengthMap| Keys {
        prompt: Some("prompt".into()),
        side_a: Some("response_1".into()),
        side_b: Some("response_2".into()),
        strength: Some("preference_strength".into()),
        strength_scale: 3.0,
        strength_map: map,
        strength_a_wins: StrengthSign::Negative,
        ..Keys::default()
    };
    let read = |map: StrengthMap| {
        let o = ReadOptions { format: Some(Format::Generic), keys: keys(map), ..Default::default() };
        read_dataset(std::slice::from_ref(&j), &o).unwrap().pairs
    };
    let lin = read(StrengthMap::Linear);
    let winner: Vec<&str> = lin.iter().map(|p| p.chosen.last().unwrap().content.as_str()).collect();
    assert_eq!(winner, ["one", "one", "one", "two", "two"]);
    // linear: y = 1/2 + |s|/6 for the favoured side
    let want = [1.0, 0.5 + 1.0 / 6.0, 0.5, 0.5 + 2.0 / 6.0, 1.0];
    for (p, w) in lin.iter().zip(want) {
        assert!((f64::from(p.y()) - w).abs() < 1e-6, "{} vs {w}", p.y());
    }
    assert!(lin[2].tie && lin[2].score_tie());
    // Bradley–Terry: y = σ(|s|/3)
    let bt = read(StrengthMap::BradleyTerry);
    let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
    for (p, s) in bt.iter().zip([3.0, 1.0, 0.0, 2.0, 3.0]) {
        assert!((f64::from(p.y()) - sig(s / 3.0)).abs() < 1e-6);
    }
    // the soft y in one sgd step from θ = 0: θ = −lr (σ(0) − y) z, by hand
    let z = [1.0f32, -2.0];
    let y = [lin[1].y()];
    let cfg: estimators::EstimatorConfig =
        estimators::EstimatorConfig::Sgd(estimators::SgdConfig { lr: 0.5, clip: None });
    let setup = estimators::Setup { dim: 2, init: estimators::Init::Zero, seed: 0, planned_steps: None };
    let mut est = estimators::build(&cfg, &setup).unwrap();
    est.update(&estimators::Batch::new(&z, &y, 2).unwrap()).unwrap();
    let g = 0.5 - f64::from(y[0]);
    let theta = est.theta();
    for (t, zi) in theta.iter().zip(z) {
        assert!((t - (-0.5 * g * f64::from(zi))).abs() < 1e-6, "{theta:?}");
    }
    assert!(theta[0] > 0.0, "a soft label above 1/2 moves θ toward z");
}

/// The label form with winners and the label form with strengths, each through a passive and an
/// active run on the tiny GGUF (soft labels reach the estimators; ties counted).
#[test]
fn label_and_strength_forms_run_passive_and_active() {
    let tmp = tempfile::tempdir().unwrap();
    let winners = ["model_a", "model_b", "tie", "model_a"];
    let strengths = [-3, -1, 0, 2, 3];
    let lines: Vec<String> = (0..40)
        .map(|i| {
            serde_json::json!({
                "prompt": format!("Question {i}: name a number near {i}."),
                "response_1": format!("{} is near it.", i + 1),
                "response_2": format!("I would say {}.", 3 * i + 7),
                "winner": winners[i % 4],
                "preference_strength": strengths[i % 5],
            })
            .to_string()
        })
        .collect();
    std::fs::write(tmp.path().join("pairs.jsonl"), lines.join("\n")).unwrap();
    let keys = [
        "label = \"winner\"\nlabel_a = [\"model_a\"]\nlabel_b = [\"model_b\"]\nlabel_tie = [\"tie\"]\n",
        "strength = \"preference_strength\"\nstrength_a_wins = \"negative\"\nstrength_map = \"bradley-terry\"\n",
    ];
    for (form, k) in keys.iter().enumerate() {
        for (setting, extra) in
            [("passive", ""), ("active", "batch_size = 2\n[active]\nrule = [\"random\", \"pool-argmax\"]\n")]
        {
            let spec = format!(
                "setting = \"{setting}\"\n[env]\nkind = \"dataset\"\n[stream]\nsamples = 12\neval_every = 6\n{extra}[data]\npath = \"pairs.jsonl\"\nformat = \"generic\"\nmodel = \"{}\"\nmax_len = 48\neval_fraction = 0.25\n[data.keys]\nprompt = \"prompt\"\nside_a = \"response_1\"\nside_b = \"response_2\"\n{k}[[estimator]]\nkind = \"sgd\"\n[[estimator]]\nkind = \"omd-exact\"\n",
                util::tiny_gguf().display()
            );
            std::fs::write(tmp.path().join("spec.toml"), spec).unwrap();
            let r = util::onepass(tmp.path(), &["run", "spec.toml", "--out", &format!("out{form}")]);
            let dir = tmp.path().join(r.dir());
            let meta: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
            // ties: a quarter of the winners; a fifth of the strengths (s = 0)
            let ties = meta["data"]["dataset"]["score_ties"].as_u64();
            assert_eq!(ties, Some([10, 8][form]), "{setting} form {form}: {}", meta["data"]);
            let m = util::table(&dir.join("metrics.parquet"));
            assert!(util::f64s(&m, "eval_loss").iter().all(|v| v.is_finite()), "{setting} form {form}");
        }
    }
}

/// A jsonl file that starts with a UTF-8 byte-order mark reads as without one (it was "row 0:
/// not JSON"); blank lines are no rows and keep the line numbers of the rows after them; a file
/// of blank lines is an error saying it has no rows (it was "row 0: not JSON: EOF") — issue 34.
#[test]
fn a_bom_and_blank_lines_in_jsonl() {
    let tmp = tempfile::tempdir().unwrap();
    let j = tmp.path().join("hh.jsonl");
    let row = |a: &str| {
        serde_json::json!({"chosen": format!("\n\nHuman: q\n\nAssistant: {a}"), "rejected": "\n\nHuman: q\n\nAssistant: no"}).to_string()
    };
    std::fs::write(&j, format!("\u{feff}{}\n\n{}\n", row("yes"), row("sure"))).unwrap();
    let pairs = read_pairs(&j, Format::HhRlhf, None).unwrap();
    assert_eq!(pairs.len(), 2);
    assert_eq!(pairs[0].chosen.last().unwrap().content, "yes");
    // negative control: a BOM in the middle of the file is still not JSON
    std::fs::write(&j, format!("{}\n\u{feff}{}\n", row("yes"), row("sure"))).unwrap();
    let e = format!("{:#}", read_pairs(&j, Format::HhRlhf, None).unwrap_err());
    assert!(e.contains("line 2") && e.contains("not JSON"), "{e}");
    std::fs::write(&j, "\n  \n\n").unwrap();
    let e = format!("{:#}", read_pairs(&j, Format::HhRlhf, None).unwrap_err());
    assert!(e.contains("hh.jsonl: no rows"), "{e}");
}

/// A generic jsonl file whose data.keys names a score field its rows lack is refused, naming
/// the field (a misspelt `score_chosen` was ignored over jsonl while parquet refused it —
/// issue 34); with the right name the scores are read.
#[test]
fn a_named_score_field_is_required_in_jsonl_too() {
    let tmp = tempfile::tempdir().unwrap();
    let j = tmp.path().join("g.jsonl");
    let conv = |a: &str| serde_json::json!([{"role": "user", "content": "q"}, {"role": "assistant", "content": a}]);
    let line = serde_json::json!({"chosen": conv("a"), "rejected": conv("b"), "score_chosen": 5, "score_rejected": 1});
    std::fs::write(&j, line.to_string()).unwrap();
    let keys = |c: &str| Keys {
        score_chosen: Some(c.into()),
        score_rejected: Some("score_rejected".into()),
        ..Keys::default()
    };
    let o = |c: &str| ReadOptions { format: Some(Format::Generic), keys: keys(c), ..Default::default() };
    let e = format!("{:#}", read_dataset(std::slice::from_ref(&j), &o("score_chsen")).unwrap_err());
    assert!(e.contains("field `score_chsen` (data.keys.score_chosen): missing"), "{e}");
    let r = read_dataset(std::slice::from_ref(&j), &o("score_chosen")).unwrap();
    assert_eq!(r.pairs[0].scores, Some((5.0, 1.0)));
}

/// Parquet columns of the narrower number types (UInt8, UInt16, Float16, Decimal128) and
/// dictionary-encoded strings are read as the numbers and strings they hold (they were refused
/// as types onepass does not read); a NaN label is named as such, not as "missing or null" —
/// issue 34.
#[test]
fn narrow_and_dictionary_parquet_columns_read() {
    use arrow_array::types::Int32Type;
    use arrow_array::{Decimal128Array, DictionaryArray, Float64Array, UInt16Array, UInt8Array};
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("arena.parquet");
    let write = |winner: ArrayRef| {
        let dict = |v: Vec<&str>| Arc::new(v.into_iter().collect::<DictionaryArray<Int32Type>>()) as ArrayRef;
        let batch = RecordBatch::try_from_iter([
            ("q", Arc::new(StringArray::from(vec!["2+2?", "Hi"])) as ArrayRef),
            ("response_a", dict(vec!["4", "Go away."])),
            ("response_b", dict(vec!["5", "Hello!"])),
            ("winner", winner),
        ])
        .unwrap();
        util::write_parquet(&p, &batch);
    };
    let keys = Keys {
        prompt: Some("q".into()),
        side_a: Some("response_a".into()),
        side_b: Some("response_b".into()),
        label: Some("winner".into()),
        label_a: vec![toml::Value::Integer(0)],
        label_b: vec![toml::Value::Integer(1)],
        ..Keys::default()
    };
    let o = ReadOptions { format: Some(Format::Generic), keys, ..Default::default() };
    let chosen = |r: &runner::world::datasets::ReadOut| -> Vec<String> {
        r.pairs.iter().map(|p| p.chosen.last().unwrap().content.clone()).collect()
    };
    for (what, col) in [
        ("UInt8", Arc::new(UInt8Array::from(vec![0u8, 1])) as ArrayRef),
        ("UInt16", Arc::new(UInt16Array::from(vec![0u16, 1])) as ArrayRef),
        (
            "Decimal128",
            Arc::new(Decimal128Array::from(vec![0i128, 1]).with_precision_and_scale(5, 0).unwrap()) as ArrayRef,
        ),
        (
            "Float16",
            Arc::new(arrow_array::Float16Array::from(vec![half::f16::from_f32(0.0), half::f16::from_f32(1.0)]))
                as ArrayRef,
        ),
    ] {
        write(col);
        let r = read_dataset(std::slice::from_ref(&p), &o).unwrap_or_else(|e| panic!("{what}: {e:#}"));
        assert_eq!(chosen(&r), vec!["4", "Hello!"], "{what}");
    }
    write(Arc::new(Float64Array::from(vec![0.0, f64::NAN])));
    let e = format!("{:#}", read_dataset(std::slice::from_ref(&p), &o).unwrap_err());
    assert!(e.contains("NaN") && !e.contains("missing or null"), "{e}");
}

/// The ranked form averages a response's scores without overflow (issue 34): scores of 1e308
/// and 1e308 average to 1e308, not to inf — which made two different responses a tie.
#[test]
fn huge_ranked_scores_do_not_overflow_into_a_tie() {
    use runner::world::datasets::PairRule;
    let tmp = tempfile::tempdir().unwrap();
    let j = tmp.path().join("ranked.jsonl");
    let resp = |t: &str, a: f64, b: f64| serde_json::json!({"response": t, "s": {"a": a, "b": b}});
    let row = serde_json::json!({"prompt": "p", "completions": [resp("A", 1e308, 1e308), resp("B", 1e308, 9e307)]});
    std::fs::write(&j, row.to_string()).unwrap();
    let keys = Keys {
        prompt: Some("prompt".into()),
        responses: Some("completions".into()),
        score: vec!["s.a".into(), "s.b".into()],
        pairs: Some(PairRule::BestWorst),
        ..Keys::default()
    };
    let o = ReadOptions { format: Some(Format::Generic), keys, ..Default::default() };
    let r = read_dataset(std::slice::from_ref(&j), &o).unwrap();
    assert_eq!(r.pairs.len(), 1);
    let p = &r.pairs[0];
    assert!(!p.tie, "1e308 vs 9.5e307 is no tie");
    assert_eq!(p.chosen.last().unwrap().content, "A");
}
