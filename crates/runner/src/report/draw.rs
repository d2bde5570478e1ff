//! Which figures a report draws, with their titles, axes and subtitles, each as PNG and SVG
//! (`figures` draws them), and the font they need.

use super::efficiency::SE_WIN;
use super::figures::{self, Band, Layout, LineFigure};
use super::row::{series, Row, FIGURES, POLICY_FIGURES};
use crate::results;
use anyhow::{bail, Context, Result};
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const FONT_PATHS: [&str; 5] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/Library/Fonts/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];

/// Registers a TTF font for the figures: $ONEPASS_FONT, else a few system locations.
pub(super) fn register_font() -> Result<PathBuf> {
    let candidates: Vec<PathBuf> = std::env::var_os("ONEPASS_FONT")
        .map(PathBuf::from)
        .into_iter()
        .chain(FONT_PATHS.iter().map(PathBuf::from))
        .collect();
    for p in &candidates {
        if let Ok(bytes) = std::fs::read(p) {
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                return Ok(p.clone());
            }
        }
    }
    bail!(
        "no TTF font for the figures: set ONEPASS_FONT to a .ttf file (looked in {})",
        candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )
}

/// Draws one figure twice, as `<name>.png` and `<name>.svg` under `out` (plotters' backends are
/// different types, so the body is written once and expanded for each).
macro_rules! png_and_svg {
    ($out:expr, $name:expr, $size:expr, |$root:ident| $body:expr) => {{
        let png = $out.join(format!("{}.png", $name));
        let svg = $out.join(format!("{}.svg", $name));
        {
            let $root = BitMapBackend::new(&png, $size).into_drawing_area();
            $body.with_context(|| format!("drawing {}", png.display()))?;
        }
        {
            let $root = SVGBackend::new(&svg, $size).into_drawing_area();
            $body.with_context(|| format!("drawing {}", svg.display()))?;
        }
    }};
}

/// The y axis of a metric's figure (the figure's title says the rest).
fn axis_name(metric: &str) -> &'static str {
    match metric {
        "train_loss" | "eval_loss" => "logistic loss",
        "eval_accuracy" => "accuracy",
        "theta_err" => "‖θ − θ*‖",
        "subopt" | "subopt_avg" => "SubOpt",
        "regret" => "regret",
        "cost" => "flops per sample",
        "cum_pair_reward" => "cumulative reward",
        "policy_reward" | "bon_reward" => "oracle reward",
        "kendall_tau" => "Kendall τ",
        "kl" | "kl_initial" => "KL (nats)",
        _ => "value",
    }
}

/// A file's name from a path, a `*` pattern or an `hf:` locator (a model's without its extension).
fn short_name(p: &str) -> &str {
    let name = p.rsplit(['/', ':']).next().unwrap_or(p);
    [".gguf", ".safetensors"].iter().find_map(|e| name.strip_suffix(e)).unwrap_or(name)
}

/// What data a run's figures show, in a few words.
fn data_phrase(spec: &crate::spec::Spec) -> String {
    use crate::spec::EnvKind;
    match spec.env.kind {
        EnvKind::Synthetic => {
            format!("synthetic bandit (d = {}, {} contexts × {} arms)", spec.env.dim, spec.env.contexts, spec.env.arms)
        }
        EnvKind::Features => format!(
            "labelled pairs from {}",
            spec.env.path.as_ref().map_or("?".into(), |p| short_name(&p.display().to_string()).to_string())
        ),
        EnvKind::Dataset => match &spec.data {
            Some(d) => format!("{} pairs, φ from {}", short_name(&d.path), short_name(&d.model)),
            None => "a preference dataset".into(),
        },
        EnvKind::Generated => match (&spec.generate, &spec.features) {
            (Some(g), Some(f)) => {
                // a noisy labeller is part of the data: its flip rate in the subtitle
                let oracle = spec.oracle.as_ref().map_or("?".to_string(), |o| {
                    let kind = format!("{:?}", o.kind).to_lowercase();
                    if o.flip > 0.0 {
                        format!("{kind}, labels flipped with p = {}", o.flip)
                    } else {
                        kind
                    }
                });
                let models = if g.policy == f.model {
                    format!("{}: samples and φ", short_name(&g.policy))
                } else {
                    format!("{} samples, φ from {}", short_name(&g.policy), short_name(&f.model))
                };
                format!("{models}, prompts from {}, oracle {oracle}", short_name(&g.prompts))
            }
            _ => "generated responses".into(),
        },
    }
}

/// Every figure of the report (see `figures`); returns their names.
pub(super) fn draw_figures(
    run: &Path,
    out: &Path,
    rows: &[Row],
    policy: &[Row],
    se: &[Row],
    times: &BTreeMap<String, Vec<(f64, f64)>>,
    spec: Option<&crate::spec::Spec>,
) -> Result<Vec<String>> {
    let layout = Layout::new(rows.iter().chain(policy).map(|r| r.label.as_str()), legend_title(rows, spec));
    let seeds = rows.iter().map(|r| r.seed).collect::<std::collections::BTreeSet<_>>().len();
    let name = run.file_name().unwrap_or_default().to_string_lossy();
    // run directories are `<name>-<UTC time>`
    let name = name.rsplit_once('-').map_or(name.as_ref(), |x| x.0);
    let cap = Caption { name, data: spec.map(data_phrase).unwrap_or_default(), seeds };
    let mut made = Vec::new();
    draw_metric_lines(out, rows, policy, &layout, &cap, &mut made)?;
    if !se.is_empty() {
        draw_sample_efficiency(out, se, &cap, &mut made)?;
    }
    draw_times(out, rows, times, &cap, &mut made)?;
    draw_win_rates(run, out, &layout, &cap, &mut made)?;
    Ok(made)
}

/// What every figure's subtitle says of the run: its name, its data and its number of seeds.
struct Caption<'a> {
    name: &'a str,
    data: String,
    seeds: usize,
}

impl Caption<'_> {
    /// "s" after "seed" unless there is one.
    fn plural(&self) -> &'static str {
        if self.seeds == 1 {
            ""
        } else {
            "s"
        }
    }
}

/// The legend's title: what tells the run's configs apart in its setting.
fn legend_title(rows: &[Row], spec: Option<&crate::spec::Spec>) -> &'static str {
    use crate::spec::Setting;
    match spec.map(|s| s.setting) {
        // labels `estimator / strategy / arm` when several policy arms are swept
        Some(Setting::Deploy) if rows.iter().any(|r| r.label.matches(" / ").count() >= 2) => "strategy / policy arm",
        Some(Setting::Deploy) => "strategy",
        Some(Setting::Active) => "selection rule",
        _ => "config",
    }
}

/// One line figure per metric the rows have (`FIGURES` over samples seen, `POLICY_FIGURES`
/// over chunks): mean ± 1 sd over seeds.
fn draw_metric_lines(
    out: &Path,
    rows: &[Row],
    policy: &[Row],
    layout: &Layout,
    cap: &Caption<'_>,
    made: &mut Vec<String>,
) -> Result<()> {
    let (name, data, seeds, plural) = (cap.name, &cap.data, cap.seeds, cap.plural());
    let sub = format!("{name} · {data} · mean ± 1 sd over {seeds} seed{plural} (bands)");
    // (figures, their rows, the x axis, the file-name prefix)
    type FigureSet<'a> = (&'a [(&'a str, &'a str)], &'a [Row], &'a str, &'a str);
    let sets: [FigureSet<'_>; 2] = [
        (&FIGURES, rows, "samples seen", ""),
        (&POLICY_FIGURES, policy, "chunk (0: before the first update)", "policy_"),
    ];
    for (list, rows, x_title, prefix) in sets {
        for &(metric, title) in list {
            if series(rows, metric).is_empty() {
                continue;
            }
            let fig = LineFigure {
                metric,
                y_title: axis_name(metric),
                title: title.to_string(),
                subtitle: &sub,
                x_title,
                rows,
                layout,
                band: Band::Sd,
            };
            let size = figures::line_size(figures::panel_count(&fig));
            let file = format!("{prefix}{metric}");
            png_and_svg!(out, file, size, |root| figures::lines(root, &fig));
            made.push(file);
        }
    }
    Ok(())
}

/// The sample-efficiency figure: held-out accuracy (and win rate) against oracle queries,
/// mean ± a 95% t-interval over seeds.
fn draw_sample_efficiency(out: &Path, se: &[Row], cap: &Caption<'_>, made: &mut Vec<String>) -> Result<()> {
    let (name, data, seeds) = (cap.name, &cap.data, cap.seeds);
    // a panel per quantity (accuracy; win rate), a colour per config (estimator × strategy)
    let se_layout = Layout::new(se.iter().map(|r| r.label.as_str()), "config");
    let win = se.iter().any(|r| r.label.starts_with(SE_WIN));
    let band = if seeds == 1 {
        "1 seed: no band".to_string()
    } else {
        format!("mean ± 95% t-interval over {seeds} seeds (bands, df = {})", seeds - 1)
    };
    let sub = format!("{name} · {data} · {band}");
    let fig = LineFigure {
        metric: "value",
        y_title: if win { "accuracy / win rate" } else { "accuracy" },
        title: if win {
            "Sample efficiency: held-out reward accuracy and win rate against the base policy".to_string()
        } else {
            "Sample efficiency: held-out reward accuracy".to_string()
        },
        subtitle: &sub,
        x_title: "oracle queries (labelled pairs so far)",
        rows: se,
        layout: &se_layout,
        band: Band::T95,
    };
    let size = figures::line_size(figures::panel_count(&fig));
    png_and_svg!(out, "sample-efficiency", size, |root| figures::lines(root, &fig));
    made.push("sample-efficiency".to_string());
    Ok(())
}

/// Fig. 3c: each config's mean estimator and wall time per cell, as bars in the plan's order.
fn draw_times(
    out: &Path,
    rows: &[Row],
    times: &BTreeMap<String, Vec<(f64, f64)>>,
    cap: &Caption<'_>,
    made: &mut Vec<String>,
) -> Result<()> {
    // Fig. 3c: configs in the plan's order
    let mut order: Vec<&str> = Vec::new();
    for r in rows {
        if !order.contains(&r.label.as_str()) {
            order.push(&r.label);
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let bars: figures::Times = order
        .iter()
        .filter_map(|l| times.get(*l).map(|t| (l.to_string(), t)))
        .map(|(l, t)| {
            let est: Vec<f64> = t.iter().map(|x| x.0).collect();
            let wall: Vec<f64> = t.iter().map(|x| x.1).collect();
            (l, mean(&est), mean(&wall))
        })
        .collect();
    if !bars.is_empty() {
        let size = (1000, 62 + 90 + 34 * bars.len() as u32);
        let (name, data, seeds, plural) = (cap.name, &cap.data, cap.seeds, cap.plural());
        let sub = format!("{name} · {data} · mean over {seeds} seed{plural}");
        png_and_svg!(out, "time_per_cell", size, |root| figures::time_bars(root, &bars, &sub));
        made.push("time_per_cell".to_string());
    }
    Ok(())
}

/// The win-rate heatmap from winrates.parquet, when the run wrote one with rows.
fn draw_win_rates(run: &Path, out: &Path, layout: &Layout, cap: &Caption<'_>, made: &mut Vec<String>) -> Result<()> {
    let wpath = run.join("winrates.parquet");
    if wpath.exists() {
        let wins: Vec<(String, f64)> =
            results::read_winrates(run)?.into_iter().map(|(label, w)| (label, w.chunk_win_rate)).collect();
        if !wins.is_empty() {
            let size = figures::heatmap_size(&wins, layout);
            let (name, data, seeds, plural) = (cap.name, &cap.data, cap.seeds, cap.plural());
            let sub = format!("{name} · {data} · over {seeds} seed{plural} × chunks");
            png_and_svg!(out, "win_rates", size, |root| figures::win_heatmap(root, &wins, layout, &sub));
            made.push("win_rates".to_string());
        }
    }
    Ok(())
}
